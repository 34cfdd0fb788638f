"""What comes back out of the sandbox (issue 17 items 2 and 3): hidden inputs never reach feedback,
and nothing a candidate writes into the result channel can crash the judge.

Exfiltration: the hidden tests hold inputs no prompt shows (CANARY_INT, CANARY_TEXT). Each program
below reads them the ways a candidate can (the harness's frames, gc, its own arguments) and
pushes them out every way that once reached the policy or a log: an exception message, an exception
class named after them, a load error, stdout/stderr, forged result records. Neither the code env's
feedback nor the result's outcomes, load error or output may contain them, while a failing visible
test keeps its full error text.

Result channel: lines a candidate writes to the harness's result descriptor (a 100k-deep `[`, huge
numbers, records of the wrong shape, bytes that are not UTF-8) are skipped: the verdict is the honest
records' or a failed test, never an exception in the host.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from rlvr.envs.code import CodeEnv, make_task
from rlvr.sandbox import SandboxLimits, TestCase, capabilities, run_tests
from rlvr.sandbox.results import MAX_RECORD_CHARS, parse_record, parse_records
from rlvr.sandbox.runner import REQUIRED
from rlvr.sandbox.runner import run_tests as one_run
from rlvr.verifiers.code import code_tests

TestCase.__test__ = False  # type: ignore[attr-defined]  # a dataclass, not a pytest class

CANARY_INT = 918273645
CANARY_TEXT = "zq-hidden-canary"
SPEC: dict[str, Any] = {
    "name": "double",
    "entry": "solve",
    "prompt": "Write `def solve(x)` returning x doubled.",
    "tests": [{"args": [1], "expected": 2}, {"args": [5], "expected": 10}],
    "hidden": [
        {"args": [CANARY_INT], "expected": 2 * CANARY_INT},
        {"args": [CANARY_TEXT], "expected": CANARY_TEXT * 2},
        {"args": [-3], "expected": -6},
    ],
}
WALL = 3.0


def no_sandbox(test: Callable[..., None]) -> Callable[..., None]:
    """Marks a test that runs no sandbox (the parser's), so it runs on any host."""
    test.no_sandbox = True  # type: ignore[attr-defined]
    return test


@pytest.fixture(autouse=True)
def _needs_the_sandbox(request: pytest.FixtureRequest) -> None:
    """Sandbox runs need a host where it isolates; the parser-only tests do not. CI must have one."""
    missing = [k for k in REQUIRED if not capabilities()[k]]
    if getattr(request.function, "no_sandbox", False) or not missing:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the sandbox isolated; missing: {', '.join(missing)}")
    pytest.skip(f"the sandbox cannot isolate code on this host; missing: {', '.join(missing)}")


def cases() -> list[TestCase]:
    visible = [TestCase(tuple(t["args"]), t["expected"]) for t in SPEC["tests"]]
    return visible + [
        TestCase(tuple(t["args"]), t["expected"], hidden=True) for t in SPEC["hidden"]
    ]


def assert_no_canary(*texts: str) -> None:
    for text in texts:
        assert str(CANARY_INT) not in text and CANARY_TEXT not in text, text[:300]


# Every program reads the inputs of its own run; only a run that holds hidden tests has the canaries.
READ_INPUTS = (
    "import sys, gc, json\n"
    "def stolen():\n"
    "    frame = sys._getframe()\n"
    "    while frame is not None and 'inputs' not in frame.f_locals:\n"
    "        frame = frame.f_back\n"
    "    return repr(frame.f_locals['inputs']) if frame is not None else ''\n"
)
# Each of these leaks the canaries when every test shares one run (test_each_attack_is_real).
LEAKING = {
    "exception message": READ_INPUTS + "def solve(x):\n    raise Exception(stolen() + repr(x))\n",
    "exception class named after the inputs": READ_INPUTS
    + "def solve(x):\n"
    + "    name = 'E_' + ''.join(c if c.isalnum() else '_' for c in stolen() + repr(x))\n"
    + "    raise type(name[:200], (Exception,), {})()\n",
    "a custom __str__": READ_INPUTS
    + "class Leak(Exception):\n    def __str__(self):\n        return stolen()\n"
    + "def solve(x):\n    raise Leak()\n",
    "gc snooping": (
        "import gc\n"
        "def solve(x):\n"
        "    lists = [o for o in gc.get_objects() if isinstance(o, list) and len(o) > 1\n"
        "             and all(isinstance(a, list) and len(a) == 1 for a in o)]\n"
        "    raise ValueError(repr(lists)[:250])\n"
    ),
    "load error": READ_INPUTS + "raise ValueError(stolen())\n",
    "load error, class named after the inputs": READ_INPUTS
    + "raise type('E' + stolen().replace(' ', ''), (Exception,), {})()\n",
    "stdout and stderr": READ_INPUTS
    + "print(stolen())\nprint(stolen(), file=sys.stderr)\n"
    + "def solve(x):\n    print(repr(x))\n    print(repr(x), file=sys.stderr)\n    return 3 * x\n",
    "forged error records": READ_INPUTS
    + "import os\nfd = int(sys.argv[1])\n"
    + "for i in range(-1, 5):\n"
    + "    os.write(fd, (json.dumps({'i': i, 'error': 'ValueError: ' + stolen()}) + '\\n').encode())\n"
    + "def solve(x):\n    return 3 * x\n",
}
EXFILTRATION = {
    **LEAKING,
    "wrong answer that quotes its input": "def solve(x):\n    return 'leak:' + repr(x)\n",
    "an error on visible inputs, a timeout on hidden ones": (
        "def solve(x):\n"
        "    if x in (1, 5):\n        raise KeyError('visible ' + repr(x))\n"
        "    while True:\n        pass\n"
    ),
}


@pytest.mark.parametrize("name", list(LEAKING))
def test_each_attack_is_real(name: str) -> None:
    """The control: in one sandbox run holding every test (runner.run_tests, what rlvr.sandbox ran
    before issue 17), each program gets a canary into text the old feedback showed."""
    result = one_run(LEAKING[name], "solve", cases(), SandboxLimits(wall_seconds=WALL))
    shown = " ".join([*result.outcomes, result.load_error or "", result.stdout, result.stderr])
    assert str(CANARY_INT) in shown


@pytest.mark.parametrize("name", list(EXFILTRATION))
def test_hidden_inputs_never_reach_feedback(name: str) -> None:
    env = CodeEnv(make_task(SPEC, wall_seconds=WALL))
    env.reset()
    code = EXFILTRATION[name]
    parsed, solved, feedback = env.check(f"```python\n{code}```")
    assert parsed and not solved
    assert_no_canary(feedback)
    result = run_tests(code, "solve", cases(), SandboxLimits(wall_seconds=WALL))
    assert not result.all_passed
    assert_no_canary(*result.outcomes, result.load_error or "", result.stdout, result.stderr)
    for outcome in result.outcomes[2:]:  # the hidden ones: a kind and a built-in name at most
        assert outcome in ("pass", "fail", "missing", "not run", "error") or (
            outcome.startswith("error: ") and outcome[7:].isidentifier()
        ), outcome


def test_hidden_inputs_do_not_cross_to_the_next_turn_through_shared_scratch() -> None:
    """Turn 1's hidden run writes its inputs to every world-writable directory; turn 2's visible run
    reads them back and raises them. Each run's scratch is its own (issue 17 item 4), so turn 2
    finds nothing and its feedback holds no canary."""
    dirs = ["/tmp", "/var/tmp", "/dev/shm", "/run/lock", "."]
    code = (
        READ_INPUTS
        + "import os\n"
        + f"DIRS = {dirs!r}\n"
        + "for d in DIRS:\n"
        + "    try:\n"
        + "        with open(os.path.join(d, 'rlvr-turn-note'), 'a') as f:\n"
        + "            f.write(stolen())\n"
        + "    except OSError:\n"
        + "        pass\n"
        + "def solve(x):\n"
        + "    notes = []\n"
        + "    for d in DIRS:\n"
        + "        try:\n"
        + "            notes.append(open(os.path.join(d, 'rlvr-turn-note')).read())\n"
        + "        except OSError:\n"
        + "            pass\n"
        + "    raise Exception(' '.join(notes)[:250])\n"
    )
    env = CodeEnv(make_task(SPEC, wall_seconds=WALL))
    env.reset()
    feedback = [env.check(f"```python\n{code}```")[2] for _ in range(2)]
    assert "[[1], [5]]" in feedback[0]  # the note of the turn's own visible run comes back
    assert_no_canary(*feedback)
    for d in dirs[:-1]:
        assert not os.path.exists(os.path.join(d, "rlvr-turn-note")), d  # the host's scratch too


def test_visible_failures_keep_their_details() -> None:
    """Only the hidden run is reduced: a visible error still says what happened, with its text."""
    env = CodeEnv(make_task(SPEC, wall_seconds=WALL))
    code = "def solve(x):\n    raise ValueError(f'no doubling for {x}')\n"
    _, solved, feedback = env.check(f"```python\n{code}```")
    assert not solved
    assert "solve(1) raised an error: ValueError: no doubling for 1." in feedback
    assert "3 hidden tests failed." in feedback
    result = run_tests(code, "solve", cases())
    assert result.outcomes == [
        "error: ValueError: no doubling for 1",
        "error: ValueError: no doubling for 5",
        "error: ValueError",
        "error: ValueError",
        "error: ValueError",
    ]


def test_hidden_tests_run_in_a_process_of_their_own() -> None:
    """The visible run never sees a hidden input: it reports what it holds, and that is only the
    visible ones (a failing visible test shows its run's whole input list)."""
    code = (
        "import sys\ndef solve(x):\n    raise KeyError(repr(sys._getframe(1).f_locals['inputs']))\n"
    )
    result = run_tests(code, "solve", cases())
    assert result.outcomes[0] == "error: KeyError: '[[1], [5]]'"
    assert result.outcomes[2:] == ["error: KeyError"] * 3


def test_the_hidden_run_gets_what_the_visible_run_left() -> None:
    """One wall budget for the whole check: a visible run that spends it leaves no hidden run."""
    slow_on_visible = "import time\ndef solve(x):\n    if x in (1, 5):\n        time.sleep(60)\n    return 2 * x\n"
    started = time.monotonic()
    result = run_tests(slow_on_visible, "solve", cases(), SandboxLimits(wall_seconds=1.5))
    assert time.monotonic() - started < 1.5 + 1.0
    assert result.visible_timed_out and result.hidden_timed_out and result.timed_out
    assert result.outcomes == ["missing"] * 5 and result.passed == 0
    env = CodeEnv(make_task(SPEC, wall_seconds=1.5))
    _, _, feedback = env.check(f"```python\n{slow_on_visible}```")
    assert (
        "solve(1) timed out" in feedback
        and "3 hidden tests failed (the run timed out)." in feedback
    )


def test_a_reward_skips_the_hidden_run_after_a_visible_failure() -> None:
    result = run_tests(
        "def solve(x):\n    return 0\n", "solve", cases(), skip_hidden_after_visible_failure=True
    )
    assert result.outcomes == ["fail", "fail", "not run", "not run", "not run"]
    assert not result.all_passed and not result.hidden_timed_out
    right = run_tests("def solve(x):\n    return 2 * x\n", "solve", cases())
    assert right.all_passed and right.outcomes == ["pass"] * 5


def test_only_hidden_tests_report_a_load_error_by_type_alone() -> None:
    hidden_only = [TestCase((CANARY_INT,), 2 * CANARY_INT, hidden=True)]
    code = "import sys\nraise RuntimeError(repr(sys._getframe(1).f_locals['inputs']))\n"
    result = run_tests(code, "solve", hidden_only)
    assert result.load_error == "load: RuntimeError" and result.outcomes == ["missing"]
    named = "import sys\nraise type('X' + repr(sys._getframe(1).f_locals['inputs']), (Exception,), {})()\n"
    assert run_tests(named, "solve", hidden_only).load_error == "load: error"


# ------------------------------------------------------------------------------ the result channel
WRITE_TO_CHANNEL = "import os, sys\nfd = int(sys.argv[1])\nos.write(fd, {payload})\n"
JUNK: dict[str, str] = {
    "nesting bomb": "b'[' * 100_000 + b'\\n'",
    "nesting bomb inside a record": "b'{\"i\": 0, \"out\": ' + b'[' * 100_000 + b'\\n'",
    "object nesting bomb": "b'{\"a\":' * 100_000 + b'\\n'",
    "a number of 100k digits": 'b\'{"i": 0, "out": "2", "n": \' + b\'7\' * 100_000 + b\'}\\n\'',
    "an index of 100k digits": "b'{\"i\": ' + b'1' * 100_000 + b', \"out\": \"2\"}\\n'",
    "a line longer than the channel": "b'x' * (3 << 20) + b'\\n'",
    "not UTF-8": 'b\'\\xff\\xfe{"i": 0, "out": "2"}\\x80\\n\'',
    "wrong types": (
        'b\'{"i": true, "out": "2"}\\n{"i": 0, "out": 2}\\n{"i": 0.0, "out": "2"}\\n'
        '{"i": 0, "error": [[[[1]]]]}\\n{"i": -7, "out": "2"}\\n[0, "2"]\\n'
        '{"i": 0, "out": NaN}\\n{"i": 0, "out": "2", "error": 5}\\n\''
    ),
    "a deep but parseable record": "b'{\"i\": 0, \"error\": ' + b'[' * 900 + b']' * 900 + b'}\\n'",
}


@pytest.mark.parametrize("name", list(JUNK))
def test_junk_in_the_result_channel_is_a_failed_test_not_a_crash(name: str) -> None:
    """The junk comes before any honest record and the function is wrong: nothing passes, nothing
    raises, in run_tests, the code env or the code_tests reward."""
    code = WRITE_TO_CHANNEL.format(payload=JUNK[name]) + "def solve(x):\n    return 3 * x\n"
    result = run_tests(code, "solve", cases(), SandboxLimits(wall_seconds=WALL))
    assert result.passed == 0 and not result.all_passed
    # "missing" where the junk filled the channel (1 MiB) before the harness wrote its records.
    assert set(result.outcomes[:2]) <= {"fail", "missing"}, result.outcomes
    env = CodeEnv(make_task(SPEC, wall_seconds=WALL))
    parsed, solved, _ = env.check(f"```python\n{code}```")
    assert parsed and not solved
    reward = code_tests(
        f"```python\n{code}```",
        tests=SPEC["tests"],
        hidden_tests=SPEC["hidden"],
        entry="solve",
        wall_seconds=WALL,
    )
    assert reward == 0.0


def test_junk_then_exit_leaves_every_test_failed() -> None:
    """The candidate writes only junk and exits before the harness reports anything."""
    code = WRITE_TO_CHANNEL.format(payload="b'[' * 100_000 + b'\\n'") + "os._exit(0)\n"
    result = run_tests(code, "solve", cases(), SandboxLimits(wall_seconds=WALL))
    assert result.outcomes == ["missing"] * 5 and result.load_error is None


def test_junk_does_not_change_an_honest_verdict() -> None:
    """Malformed lines are skipped, not attributed: a right function behind them still passes."""
    code = (
        WRITE_TO_CHANNEL.format(payload=JUNK["nesting bomb"]) + "def solve(x):\n    return 2 * x\n"
    )
    assert run_tests(code, "solve", cases(), SandboxLimits(wall_seconds=WALL)).all_passed


@no_sandbox
@pytest.mark.parametrize(
    "line",
    [
        "[" * 100_000,
        "{" * 50_000,
        '{"i": 0, "out": "2", "n": ' + "9" * 100_000 + "}",
        '{"i": ' + "1" * 5000 + ', "out": "2"}',
        "x" * (MAX_RECORD_CHARS + 1),
        '{"i": true, "out": "2"}',
        '{"i": 0, "out": 2}',
        '{"i": -2, "out": "2"}',
        '{"i": 0, "error": {"a": 1}}',
        '{"i": 0}',
        "null",
        "",
        "\udcff",
    ],
)
def test_the_parser_rejects_without_raising(line: str) -> None:
    assert parse_record(line) is None


@no_sandbox
def test_the_parser_survives_a_deep_host_stack() -> None:
    """A record nested well under the recursion limit, parsed where the host's own stack is already
    deep (a trainer thread several frames down): RecursionError is caught there too."""
    line = '{"i": 0, "out": "2", "x": ' + "[" * 600 + "]" * 600 + "}"

    def deep(n: int) -> dict[str, Any] | None:
        return deep(n - 1) if n else parse_record(line)

    limit = sys.getrecursionlimit()
    assert deep(limit - 450) in ({"i": 0, "out": "2"}, None)  # either way: no exception


@no_sandbox
def test_the_parser_keeps_the_first_well_formed_record_per_test() -> None:
    raw = (
        b"[" * 100_000
        + b'\n{"i": 0, "out": 2}\n{"i": 0, "out": "4"}\n{"i": 0, "out": "2"}\n'
        + b'{"i": 1, "error": "'
        + b"e" * 1000
        + b'"}\n{"i": -1, "error": "load: X"}\n'
    )
    seen, load_error = parse_records(raw)
    assert seen[0] == {"i": 0, "out": "4"} and len(seen[1]["error"]) == 300
    assert load_error == "load: X"
