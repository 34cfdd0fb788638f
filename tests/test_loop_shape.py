"""The RL step stays readable (issue 37): `train()` calls its stages in order, and no stage of the
run (set-up, step, update, credit) grows past ~80 lines. A stage that needs more is split into
named parts, as policy_update was (prepare_update, fixed_logprobs, micro_batch_backward, ...)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "rlvr" / "train"
# The files whose functions are the run's stages, and the limit (lines, docstring included).
STAGE_FILES = ["loop.py", "run_setup.py", "update.py", "micro_batching.py", "selection.py"]
LIMIT = 80


def functions(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    return [
        (node.name, (node.end_lineno or node.lineno) - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
    ]


@pytest.mark.parametrize("name", STAGE_FILES)
def test_no_stage_is_longer_than_the_limit(name: str) -> None:
    too_long = [(f, n) for f, n in functions(SRC / name) if n > LIMIT]
    assert not too_long, f"train/{name}: functions over {LIMIT} lines: {too_long}"


def test_train_calls_its_stages_in_order() -> None:
    """train() reads as the run: set-up stages, then per step rl_step -> record_step -> end_step,
    then finish. A stage called out of order (or inlined back) fails here."""
    tree = ast.parse((SRC / "loop.py").read_text())
    train = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "train")
    calls = [n for n in ast.walk(train) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    calls.sort(key=lambda n: (n.lineno, n.col_offset))  # ast.walk is breadth first
    called = [n.func.id for n in calls if isinstance(n.func, ast.Name)]
    stages = [
        "load_run",
        "build_trainer",
        "restore",
        "open_reporting",
        "evaluate_base",
        "rl_step",
        "record_step",
        "end_step",
        "finish",
    ]
    positions = [called.index(s) for s in stages]  # ValueError: a stage train() no longer calls
    assert positions == sorted(positions), [called[i] for i in sorted(positions)]
    assert (train.end_lineno or 0) - train.lineno + 1 <= 50
