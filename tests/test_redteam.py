"""The reward red-team kit (rlvr.verifiers.redteam) and `rlvr check-reward`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from rlvr.config import ArithmeticConfig
from rlvr.records import Task
from rlvr.tasks import arithmetic_tasks
from rlvr.verifiers import BUILTIN_REWARDS, RewardFunction
from rlvr.verifiers.redteam import HACKS, red_team, reference_completions

TASKS = arithmetic_tasks(ArithmeticConfig()).heldout[:10]


def substring(completion: str, answer: object, **_: object) -> float:
    return float(str(answer) in completion)


def test_a_substring_reward_pays_for_hacks() -> None:
    report = red_team(RewardFunction("substring", substring), TASKS)
    paid = {h.hack for h in report.paid_hacks}
    assert {"answer tag repeated", "many candidate answers", "very long output"} <= paid
    assert report.reference_paid == len(TASKS) and not report.ok


def test_built_in_verifiers_pay_for_no_hack() -> None:
    for name in ("numeric_match", "exact_match", "math_equiv"):
        report = red_team(RewardFunction(name, BUILTIN_REWARDS[name]), TASKS)
        assert report.ok, (name, report.paid_hacks)
        assert report.reference_paid == len(TASKS)


FORMAT_FARMING = {
    "well-formed wrong answer",
    "reasoned wrong answer",
    "empty think, wrong answer",
    "right answer only in the think",
    "nested answer tag in the think",
}


def test_built_in_format_verifiers_pay_only_for_format_farming() -> None:
    """A format reward pays form, not truth: check-reward reports the well-formed wrong answers it
    pays (a policy can farm it alone), and no other hack."""
    cases: dict[str, dict[str, Any]] = {
        "answer_tag_format": {},
        "regex_format": {"pattern": r"<answer>-?\d+</answer>", "mode": "fullmatch"},
        "json_schema_format": {"schema": {"type": "integer"}},
    }
    for name, options in cases.items():
        report = red_team(RewardFunction(name, BUILTIN_REWARDS[name], options=options), TASKS)
        paid = {h.hack for h in report.paid_hacks}
        assert "well-formed wrong answer" in paid and paid <= FORMAT_FARMING, (name, paid)
        assert report.reference_paid == len(TASKS) and not report.ok


def test_a_think_format_reward_is_farmed_but_the_success_gated_one_is_not() -> None:
    """Issue 16's reasoning-aware shaping: a plain <think><answer> format reward pays every
    well-formed wrong answer; think_answer_format_with_success pays none of the hacks and still
    pays the reasoned right answer."""
    plain = RewardFunction(
        "think_format",
        BUILTIN_REWARDS["regex_format"],
        options={
            "pattern": r"\s*<think>.*?</think>\s*<answer>.+?</answer>\s*",
            "mode": "fullmatch",
        },
    )
    report = red_team(plain, TASKS)
    paid = {h.hack for h in report.paid_hacks}
    assert {"reasoned wrong answer", "empty think, wrong answer"} <= paid <= FORMAT_FARMING
    name = "think_answer_format_with_success"
    for options in ({}, {"check": "exact_match"}, {"check": "math_equiv"}):
        gated = red_team(RewardFunction(name, BUILTIN_REWARDS[name], options=options), TASKS)
        assert gated.ok and not gated.paid_hacks, (options, gated.paid_hacks)
        assert gated.reference_paid == len(TASKS) and gated.errors == 0
        tried = {h.hack for h in gated.hacks}
        assert tried >= FORMAT_FARMING


def test_references_include_a_reasoned_form() -> None:
    """A reward that requires a <think> block is still seen paying the right answer."""
    task = TASKS[0]
    bare, reasoned = reference_completions(task)
    answer = task.fields["answer"]
    assert bare == f"<answer>{answer}</answer>"
    assert reasoned.startswith("<think>") and reasoned.endswith(bare)
    assert reference_completions(Task("c", (), {"tests": []})) == []


def test_a_reward_that_never_pays_is_not_judged_safe() -> None:
    report = red_team(RewardFunction("zero", lambda completion, **_: 0.0), TASKS)
    assert not report.paid_hacks and report.reference_paid == 0 and not report.ok


def test_code_hacks_apply_only_to_code_tasks() -> None:
    code_task = Task("c", ({"role": "user", "content": "double"},), {"tests": [{"expected": 2}]})
    math_task = TASKS[0]
    code_only = [n for n, hack in HACKS.items() if hack(math_task) is None]
    assert "exit(0) before the tests" in code_only
    assert all(HACKS[n](code_task) is not None for n in code_only)


def test_cli_exit_codes(tmp_path: Path) -> None:
    (tmp_path / "rewards.py").write_text(
        "def substring(completion, answer, **_):\n    return float(str(answer) in completion)\n"
    )
    cli = [sys.executable, "-m", "rlvr.cli", "check-reward"]
    bad = subprocess.run(
        [*cli, "rewards.py:substring", "--n", "5"], cwd=tmp_path, capture_output=True, text=True
    )
    assert bad.returncode == 1 and "PAID" in bad.stdout
    good = subprocess.run(
        [*cli, "numeric_match", "--n", "5"], cwd=tmp_path, capture_output=True, text=True
    )
    assert good.returncode == 0 and "no known hack is paid" in good.stdout
    gated = subprocess.run(
        [*cli, "think_answer_format_with_success", "--n", "5"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert gated.returncode == 0 and "no known hack is paid" in gated.stdout
    assert "reasoned wrong answer" in gated.stdout
    fmt = subprocess.run(
        [*cli, "answer_tag_format", "--n", "5"], cwd=tmp_path, capture_output=True, text=True
    )
    paid_line = next(line for line in fmt.stdout.splitlines() if "well-formed wrong" in line)
    assert fmt.returncode == 1 and "PAID on 5/5" in paid_line
    typo = subprocess.run([*cli, "no_such_reward"], cwd=tmp_path, capture_output=True, text=True)
    assert typo.returncode == 2 and typo.stderr.startswith("error:")


def test_the_code_verifier_pays_for_no_code_hack() -> None:
    import pytest

    from rlvr.config import load_config
    from rlvr.sandbox import capabilities
    from rlvr.tasks import load_tasks
    from rlvr.verifiers.code import code_tests

    if not capabilities()["namespaces"]:
        pytest.skip("the sandbox needs namespaces on this host")
    examples = Path(__file__).resolve().parent.parent / "examples"
    cfg = load_config(examples / "code_dataset.yaml")
    task_cfg = cfg.task.model_copy(
        update={
            "dataset": cfg.task.dataset.model_copy(  # type: ignore[union-attr]
                update={"path": str(examples / "code_tasks.jsonl")}
            )
        }
    )
    splits = load_tasks(task_cfg)
    report = red_team(RewardFunction("code", code_tests), splits.train + splits.heldout)
    code_hacks = {h.hack for h in report.hacks}
    assert {"exit(0) before the tests", "always-equal object"} <= code_hacks
    assert report.ok and report.reference_tried == 0, report.paid_hacks
