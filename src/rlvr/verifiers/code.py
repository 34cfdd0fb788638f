"""A reward for dataset tasks that carry their own tests: run the completion's code in the sandbox.

Use it as `rlvr.verifiers.code:code_tests` with the tests as task fields (`task.dataset.extra_columns:
[entry, tests, hidden_tests]`). Each test is `{"args": [...], "expected": ...}`; a column may also
hold the JSON text of that list (Arrow, under `datasets`, cannot store lists of mixed types).
"""

from __future__ import annotations

import json
from typing import Any

from rlvr.envs.code import extract_code
from rlvr.sandbox import SandboxLimits, TestCase, run_tests
from rlvr.verifiers.rubric import parallel_reward


def _cases(tests: Any, hidden: bool, what: str) -> list[TestCase]:
    if tests is None:
        return []
    if isinstance(tests, str):
        tests = json.loads(tests)
    if not isinstance(tests, list):
        raise ValueError(f"{what} must be a list of {{'args': [...], 'expected': ...}}")
    cases = []
    for i, test in enumerate(tests):
        if not isinstance(test, dict) or "args" not in test or "expected" not in test:
            raise ValueError(f"{what}[{i}] is not {{'args': [...], 'expected': ...}}: {test!r:.80}")
        if not isinstance(test["args"], list | tuple):
            raise ValueError(f"{what}[{i}]['args'] must be a list")
        cases.append(TestCase(tuple(test["args"]), test["expected"], hidden=hidden))
    return cases


@parallel_reward
def code_tests(
    completion: str,
    tests: list[dict[str, Any]] | str,
    entry: str,
    hidden_tests: list[dict[str, Any]] | str | None = None,
    wall_seconds: float = 5.0,
    **_: Any,
) -> float:
    """1.0 iff the completion's code (last ```python block) passes every test, visible and hidden.

    No code block scores 0.0. No tests at all raises ValueError: that is broken data, which the
    rubric records as an error rather than teaching the policy a 0.
    """
    cases = _cases(tests, False, "tests") + _cases(hidden_tests, True, "hidden_tests")
    if not cases:
        raise ValueError("the task has no tests (fields 'tests' / 'hidden_tests' are empty)")
    code = extract_code(completion)
    if code is None:
        return 0.0
    # Only "did every test pass" is asked: a visible failure needs no hidden run.
    limits = SandboxLimits(wall_seconds=wall_seconds)
    result = run_tests(code, entry, cases, limits, skip_hidden_after_visible_failure=True)
    return 1.0 if result.all_passed else 0.0
