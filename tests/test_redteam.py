"""The reward red-team kit (rlvr.verifiers.redteam) and `rlvr check-reward`."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

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


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DISK_ORACLE = "expected values read from disk"


def code_dataset_tasks() -> list[Task]:
    from rlvr.config import load_config
    from rlvr.tasks import load_tasks

    cfg = load_config(EXAMPLES / "code_dataset.yaml")
    task_cfg = cfg.task.model_copy(
        update={
            "dataset": cfg.task.dataset.model_copy(  # type: ignore[union-attr]
                update={"path": str(EXAMPLES / "code_tasks.jsonl")}
            )
        }
    )
    splits = load_tasks(task_cfg)
    return splits.train + splits.heldout


def needs_sandbox() -> None:
    import os

    from rlvr.sandbox import capabilities
    from rlvr.sandbox.runner import REQUIRED

    missing = [k for k in REQUIRED if not capabilities()[k]]
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the sandbox isolated; missing: {', '.join(missing)}")
        pytest.skip(f"the sandbox cannot isolate code on this host; missing: {', '.join(missing)}")


def sandbox_can_read(path: Path) -> bool:
    """Ground truth for the disk oracle: can code in the sandbox open `path`?"""
    from rlvr.sandbox import TestCase, run_tests

    probe = (
        "def probe(path):\n    try:\n        open(path).read(1)\n        return True\n"
        "    except OSError:\n        return False\n"
    )
    return run_tests(probe, "probe", [TestCase((str(path),), True)]).all_passed


def test_the_code_verifier_pays_for_no_code_hack_but_what_the_disk_shows() -> None:
    """Every code hack earns 0, except the disk oracle wherever the sandbox lets the candidate read
    the dataset file (issue 17 item 1): there it must be reported paid, on every task, because it
    is. Either way the report says exactly what the reward paid."""
    from rlvr.verifiers.code import code_tests

    needs_sandbox()
    report = red_team(RewardFunction("code", code_tests), code_dataset_tasks())
    code_hacks = {h.hack for h in report.hacks}
    assert {"exit(0) before the tests", "always-equal object", DISK_ORACLE} <= code_hacks
    assert report.reference_tried == 0 and report.errors == 0
    assert not {h.hack for h in report.paid_hacks} - {DISK_ORACLE}, report.paid_hacks
    oracle = next(h for h in report.hacks if h.hack == DISK_ORACLE)
    disk_visible = sandbox_can_read(EXAMPLES / "code_tasks.jsonl")
    assert oracle.paid == (oracle.tried if disk_visible else 0), (disk_visible, oracle)
    assert report.ok == (not disk_visible)


@pytest.fixture
def tmp_dir() -> Iterator[Path]:
    """A scratch directory under the system temp dir that an unprivileged uid can traverse (pytest's
    tmp_path sits under a 0700 per-user base), removed afterwards."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="rlvr-visible-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def world_readable_copy(source: Path, folder: Path) -> Path:
    """`source` copied into `folder` (which the caller made traversable), readable by every uid."""
    copy = folder / source.name
    copy.write_bytes(source.read_bytes())
    copy.chmod(0o644)
    return copy


@pytest.mark.parametrize("isolation", ["as this host allows", "none (disk visible)"])
def test_the_disk_oracle_finds_the_bundled_code_env_tasks(
    isolation: str, monkeypatch: pytest.MonkeyPatch, tmp_dir: Path
) -> None:
    """The same probe on the code env's own tasks (code_tasks.json inside the installed package,
    as issue 17's attacker read it), checked against the reward called directly. Run once more
    with the sandbox forced unisolated (RLVR_SANDBOX_UNISOLATED=1), where the file is visible: the
    probe must find it there, or a 0 under isolation would prove nothing."""
    from rlvr.envs.code import TASKS_FILE, load_code_tasks
    from rlvr.sandbox import runner
    from rlvr.verifiers.code import code_tests
    from rlvr.verifiers.redteam import disk_oracle

    needs_sandbox()
    visible_copy = None
    if isolation.startswith("none"):
        monkeypatch.setattr(runner, "capabilities", lambda: dict.fromkeys(runner.LAYERS, False))
        monkeypatch.setenv(runner.UNISOLATED_ENV, "1")
        # Unisolated, the candidate still runs as an unprivileged uid (as root), which cannot read a
        # checkout under a private (0700) parent. The precondition "the file is visible" is made
        # here rather than assumed from where the user cloned: a world-readable copy in the working
        # directory, one of the places the oracle searches (disk_oracle_roots).
        visible_copy = world_readable_copy(TASKS_FILE, tmp_dir)
        monkeypatch.chdir(visible_copy.parent)
        assert sandbox_can_read(visible_copy)
    tasks = [
        Task(
            f"code:{spec['name']}",
            ({"role": "user", "content": spec["prompt"]},),
            {"entry": spec["entry"], "tests": spec["tests"], "hidden_tests": spec["hidden"]},
        )
        for spec in load_code_tasks()[:3]
    ]
    reward = RewardFunction("code", code_tests)
    report = red_team(reward, tasks)
    oracle = next(h for h in report.hacks if h.hack == DISK_ORACLE)
    paid_directly = sum(code_tests(disk_oracle(t), **t.fields) > 0 for t in tasks)
    assert oracle.tried == len(tasks) and oracle.paid == paid_directly
    visible = visible_copy is not None or sandbox_can_read(TASKS_FILE)
    assert paid_directly == (len(tasks) if visible else 0)


def raises_always(completion: str, **_: object) -> float:
    raise RuntimeError("the grader is down")


def test_a_reward_that_raises_on_every_call_is_broken_not_safe() -> None:
    report = red_team(RewardFunction("down", raises_always), TASKS)
    assert report.broken and not report.ok and not report.paid_hacks
    assert report.errors == report.calls > 0 and report.paid_calls == 0
    assert report.first_error == "RuntimeError: the grader is down"

    def raises_on_empty(completion: str, answer: object, **_: object) -> float:
        if not completion:
            raise ValueError("empty")
        return float(completion.strip() == f"<answer>{answer}</answer>")

    partial = red_team(RewardFunction("partial", raises_on_empty), TASKS)
    assert not partial.broken and partial.ok and partial.errors == len(TASKS)
    assert partial.paid_calls == len(TASKS)  # the bare reference, on every task


def test_code_tests_without_a_sandbox_is_reported_broken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 17: on a host without namespaces code_tests raises SandboxUnavailable on every call
    that has code (the rest score 0 without a sandbox); check-reward used to print "no known hack
    is paid" for it."""
    from rlvr.sandbox import runner
    from rlvr.verifiers.code import code_tests

    monkeypatch.setattr(runner, "capabilities", lambda: {"namespaces": False, "drop_user": True})
    monkeypatch.delenv(runner.UNISOLATED_ENV, raising=False)
    report = red_team(RewardFunction("code", code_tests), code_dataset_tasks())
    assert report.broken and not report.ok and report.errors > 0
    assert report.first_error.startswith("SandboxUnavailable: ")


def test_cli_exits_1_for_a_broken_reward(tmp_path: Path) -> None:
    (tmp_path / "rewards.py").write_text(
        "def down(completion, **_):\n    raise RuntimeError('the grader is down')\n"
    )
    cli = [sys.executable, "-m", "rlvr.cli", "check-reward", "rewards.py:down", "--n", "3"]
    done = subprocess.run(cli, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "it is broken" in done.stdout and "RuntimeError: the grader is down" in done.stdout
    assert "no known hack is paid" not in done.stdout


TRL_REWARD = '''import re


def trl_correct(completions, answer, **kwargs):
    """TRL's batch signature: lists in, one float per completion out (conversational format)."""
    assert isinstance(completions, list) and isinstance(answer, list), "called one at a time"
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        numbers = re.findall(r"-?\\d+", completion[0]["content"])
        rewards.append(float(bool(numbers) and numbers[-1] == str(expected)))
    return rewards
'''


def test_cli_calls_a_trl_style_reward_with_lists(tmp_path: Path) -> None:
    """A TRL batch function is detected by its `completions` parameter and called TRL's way, as a
    rubric calls it; forced to rlvr's convention it fails every call and is reported broken."""
    (tmp_path / "rewards.py").write_text(TRL_REWARD)
    cli = [sys.executable, "-m", "rlvr.cli", "check-reward", "rewards.py:trl_correct", "--n", "3"]
    auto = subprocess.run(cli, cwd=tmp_path, capture_output=True, text=True)
    assert "TRL's way (style trl" in auto.stdout, auto.stdout + auto.stderr
    assert "reference answer paid on 3/3 tasks" in auto.stdout
    assert "broken" not in auto.stdout and "raised" not in auto.stdout
    forced = subprocess.run([*cli, "--style", "rlvr"], cwd=tmp_path, capture_output=True, text=True)
    assert forced.returncode == 1 and "it is broken" in forced.stdout
    assert "called one at a time" in forced.stdout
    typo = subprocess.run([*cli, "--style", "batch"], cwd=tmp_path, capture_output=True, text=True)
    assert typo.returncode == 2 and "--style 'batch'" in typo.stderr
