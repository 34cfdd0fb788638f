"""Visible and hidden tests in separate sandbox runs: a candidate never holds a hidden input while it
can still write text that reaches the policy.

Why: a sandbox run holds every input it tests in memory, and the candidate can read them
(`sys._getframe(1).f_locals["inputs"]`) and raise them as an exception message; the code env feeds a
failing test's error text back to the policy. Issue 17 (item 2) did exactly that and every hidden
input appeared in the next turn's prompt. So here:
- the visible tests run first, in a sandbox that holds only their inputs; their outcomes keep the
  candidate's error text, which can only repeat what the prompt already shows;
- the hidden tests run in a sandbox of their own, and only what cannot carry text comes back of it:
  pass / fail / missing per test, and for an error at most the name of a *built-in* exception (a
  candidate names its own classes as it likes: `type("in_3_7", (Exception,), {})`). Its stdout and
  stderr are dropped; the load error reported is the visible run's;
- both runs share one wall-clock budget: the hidden run gets what the visible run left, so a task's
  `wall_seconds` still bounds the whole check.

`runner.run_tests` is one sandbox run and hides nothing; what `rlvr.sandbox` exports as `run_tests`
is this module's.
"""

from __future__ import annotations

import builtins
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import rlvr.sandbox.runner as runner
from rlvr.sandbox.runner import SandboxLimits, SandboxResult, TestCase

# Names that carry no information but the kind of failure: the interpreter's own exception classes.
BUILTIN_EXCEPTIONS = frozenset(
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
)
# Less than this left of the budget: the hidden run could not even start an interpreter.
MIN_HIDDEN_SECONDS = 0.1
NOT_RUN = "not run"
OneRun = Callable[[str, str, Sequence[TestCase], SandboxLimits | None], SandboxResult]


@dataclass
class SuiteResult(SandboxResult):
    """A SandboxResult over visible and hidden tests, in the order given. Outcomes are those of
    SandboxResult, plus "not run" for hidden tests skipped after a visible run that could not load
    the code (or, when asked, failed a test); a hidden test's "error: ..." names at most a built-in
    exception. `timed_out` is either run's."""

    visible_timed_out: bool = False
    hidden_timed_out: bool = False


def builtin_exception_name(error: str) -> str | None:
    """The exception named at the start of `error` ("ValueError: ...") if it is a built-in one."""
    name = error.split(":", 1)[0].strip()
    return name if name in BUILTIN_EXCEPTIONS else None


def hidden_outcome(outcome: str) -> str:
    """What may be said of a hidden test's outcome: its kind, and a built-in exception's name."""
    if outcome in ("pass", "fail", "missing"):
        return outcome
    name = builtin_exception_name(outcome.removeprefix("error: "))
    return f"error: {name}" if name else "error"


def run_tests(
    code: str,
    entry: str,
    tests: Sequence[TestCase],
    limits: SandboxLimits | None = None,
    *,
    skip_hidden_after_visible_failure: bool = False,
    one_run: OneRun | None = None,
) -> SuiteResult:
    """Run the visible tests, then the hidden ones in a separate sandbox (see the module docstring).
    With `skip_hidden_after_visible_failure` (a reward that only asks "did all pass?") a visible
    failure ends the check: the hidden tests are "not run" and cost no second sandbox. `one_run`
    is one sandbox run, this process's by default (client.py passes a SandboxFusion server's)."""
    limits = limits or SandboxLimits()
    run_one = one_run or runner.run_tests
    started = time.monotonic()
    visible_at = [i for i, t in enumerate(tests) if not t.hidden]
    hidden_at = [i for i, t in enumerate(tests) if t.hidden]
    outcomes = ["missing"] * len(tests)
    visible: SandboxResult | None = None
    hidden: SandboxResult | None = None
    hidden_timed_out = False
    if visible_at or not tests:  # no tests at all: the runner still says whether it could run
        visible = run_one(code, entry, [tests[i] for i in visible_at], limits)
        for i, outcome in zip(visible_at, visible.outcomes, strict=True):
            outcomes[i] = outcome
    if hidden_at:
        left = limits.clamped().wall_seconds - (time.monotonic() - started)
        if visible is not None and visible.load_error is not None:
            for i in hidden_at:  # the code did not even load: nothing to learn from a second run
                outcomes[i] = NOT_RUN
        elif visible is not None and skip_hidden_after_visible_failure and not visible.all_passed:
            for i in hidden_at:
                outcomes[i] = NOT_RUN
        elif (visible is not None and visible.timed_out) or left < MIN_HIDDEN_SECONDS:
            hidden_timed_out = True  # the budget went on the visible tests: hidden stay "missing"
        else:
            budget = dataclasses.replace(limits, wall_seconds=left)
            hidden = run_one(code, entry, [tests[i] for i in hidden_at], budget)
            hidden_timed_out = hidden.timed_out
            for i, outcome in zip(hidden_at, hidden.outcomes, strict=True):
                outcomes[i] = hidden_outcome(outcome)
    load_error = visible.load_error if visible is not None else None
    if visible is None and hidden is not None and hidden.load_error is not None:
        name = builtin_exception_name(hidden.load_error.removeprefix("load: "))
        load_error = f"load: {name or 'error'}"
    shown = visible if visible is not None else hidden
    visible_timed_out = visible is not None and visible.timed_out
    return SuiteResult(
        passed=sum(o == "pass" for o in outcomes),
        total=len(tests),
        outcomes=outcomes,
        timed_out=visible_timed_out or hidden_timed_out,
        load_error=load_error,
        stdout=visible.stdout if visible is not None else "",
        stderr=visible.stderr if visible is not None else "",
        seconds=time.monotonic() - started,
        isolation=shown.isolation if shown is not None else {},
        uid=shown.uid if shown is not None else None,  # the visible run's, when there was one
        visible_timed_out=visible_timed_out,
        hidden_timed_out=hidden_timed_out,
    )
