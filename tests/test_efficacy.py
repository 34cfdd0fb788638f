"""benchmarks/efficacy.py, the instrument behind docs/efficacy.md: its statistics by hand, its
target rule, and one row end to end on the tiny model (the real rows train SmolLM2 for minutes)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_efficacy(efficacy: ModuleType, argv: list[str]) -> None:
    """benchmarks/efficacy.py's main() with `argv` as its command line."""
    old = sys.argv
    sys.argv = argv
    try:
        efficacy.main()
    finally:
        sys.argv = old


@pytest.fixture(scope="module")
def efficacy() -> ModuleType:
    spec = importlib.util.spec_from_file_location("efficacy", ROOT / "benchmarks" / "efficacy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["efficacy"] = module
    spec.loader.exec_module(module)
    return module


def test_paired_bootstrap_interval_by_hand(efficacy: ModuleType) -> None:
    ci = efficacy.paired_bootstrap_ci
    # No instance changed: every resample's mean difference is 0.
    assert ci([0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]) == (0.0, 0.0)
    # Every instance went 0 -> 1: every resample's mean difference is 1.
    assert ci([0.0] * 5, [1.0] * 5) == (1.0, 1.0)
    # Half the instances gained 1, half stayed: the mean of 100 resampled 0/1 values is
    # Binomial(100, 1/2)/100, whose 95% range is about 0.5 +/- 1.96 * 0.05 = (0.40, 0.60).
    low, high = ci([0.0] * 100, [1.0] * 50 + [0.0] * 50)
    assert 0.37 <= low <= 0.42 and 0.58 <= high <= 0.63
    # Pairing matters: after = before shifted by one instance has the same accuracy, gain 0,
    # and an interval around 0 that an unpaired reading would not distinguish.
    low, high = ci([1.0, 0.0] * 50, [0.0, 1.0] * 50)
    assert low < 0.0 < high


def test_targets_are_read_from_the_measured_numbers(efficacy: ModuleType) -> None:
    rows = efficacy.BY_NAME
    # A level with a time condition (the demo: >= 80% in <= 10 min).
    assert efficacy.met(rows["arithmetic"], 0.09, 0.81, 9.5, 0.0)
    assert not efficacy.met(rows["arithmetic"], 0.09, 0.81, 10.5, 0.0)
    assert not efficacy.met(rows["arithmetic"], 0.09, 0.79, 9.5, 0.0)
    # A level with a tool-use condition.
    assert efficacy.met(rows["calculator-1op"], 0.0, 0.91, 25.0, 0.96)
    assert not efficacy.met(rows["calculator-1op"], 0.0, 0.91, 25.0, 0.90)
    # A gain in points.
    assert efficacy.met(rows["frozenlake"], 0.20, 0.50, 25.0, 0.0)
    assert not efficacy.met(rows["frozenlake"], 0.20, 0.49, 25.0, 0.0)


@pytest.mark.slow
def test_one_row_end_to_end_on_the_tiny_model(efficacy: ModuleType, tmp_path: Path) -> None:
    """Before, train, after and the rendered table, with the tiny model standing in for SmolLM2
    (pinned fp32: model.bf16 off). The numbers are the tiny model's; what is checked is that the
    row is measured on the held-out instances and lands in the table with its command."""
    results, out = tmp_path / "results.jsonl", tmp_path / "efficacy.md"
    argv = [
        "efficacy.py", "--rows", "arithmetic", "--n", "6", "--k", "2", "--budget-minutes", "5",
        "--runs-dir", str(tmp_path / "runs"), "--results", str(results), "--out", str(out),
        "--set", "model.name=tiny-random", "--set", "model.bf16='off'",
        "--set", "train.steps=2", "--set", "sampling.max_new_tokens=6",
    ]  # fmt: skip
    run_efficacy(efficacy, argv)
    (row,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert row["row"] == "arithmetic" and row["n"] == 6 and row["steps"] == 2
    assert 0.0 <= row["before"] <= 1.0 and 0.0 <= row["after"] <= 1.0
    assert row["gain_ci95"][0] <= row["gain"] <= row["gain_ci95"][1]
    assert row["mean@2_before"] is not None and row["k"] == 2
    table = out.read_text()
    assert "| arithmetic, 2-digit addition (the demo) | >= 80% in <= 10 min | 6 |" in table
    assert "--set model.name=tiny-random" in table  # the command that produced the row
    assert "| calculator, 1 operation | >= 90%, tool used in >= 95% | not measured yet |" in table


@pytest.mark.slow
def test_a_warmup_row_reports_the_warmup_apart(efficacy: ModuleType, tmp_path: Path) -> None:
    """frozenlake-warmup on the tiny model: the pipeline's SFT format warm-up (env demos), then
    RL; the row has the warm-up's own held-out number, RL's gain over it, and minutes that count
    both. The tiny model's numbers mean nothing; the bookkeeping is what is checked."""
    results, out = tmp_path / "results.jsonl", tmp_path / "efficacy.md"
    argv = [
        "efficacy.py", "--rows", "frozenlake-warmup", "--n", "3", "--k", "1",
        "--budget-minutes", "5", "--runs-dir", str(tmp_path / "runs"), "--results", str(results),
        "--out", str(out), "--set", "model.name=tiny-random", "--set", "model.bf16='off'",
        "--set", "train.steps=1", "--set", "rollout.max_turns=2",
        "--warmup-set", "train.steps=2", "--warmup-set", "train.max_length=4096",
    ]  # fmt: skip
    run_efficacy(efficacy, argv)
    (row,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert row["row"] == "frozenlake-warmup" and row["n"] == 3 and row["steps"] == 1
    assert 0.0 <= row["after_warmup"] <= 1.0
    assert row["rl_gain"] == pytest.approx(row["after"] - row["after_warmup"])
    assert row["rl_gain_ci95"][0] <= row["rl_gain"] <= row["rl_gain_ci95"][1]
    assert 0 < row["warmup_minutes"] <= row["train_minutes"]
    assert row["warmup_metrics"]["demos/rows"] > 0
    assert "--warmup-set train.steps=2" in row["command"]
    table = out.read_text()
    line = next(li for li in table.splitlines() if li.startswith("| frozenlake 4x4, not slippery;"))
    assert "RL alone" in line and line.count("|") == 16  # 15 columns
