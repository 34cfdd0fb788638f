"""Resuming a torchrun job equals the uninterrupted job (issue 35, item 4): 2 gloo ranks, ddp and fsdp.

Under fsdp the optimizer state is sharded and saved with torch.distributed.checkpoint (each rank its
shard); every rank saves and restores its own RNGs (each samples its own share of the prompts with a
seed of its own). The job runs 2 steps with a checkpoint after each; a copy of its run directory
without the step-2 checkpoint is resumed and must reach the same step-2 metrics and weights.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlvr.models import load_policy
from rlvr.train.critic import WEIGHTS_FILE

TIMING = ("time", "seconds", "_s", "per_s", "tokens_per", "mfu", "gflop", "memory", "rss")


def _torchrun(*args: str) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "--tee", "3", "-m", "rlvr.cli", "train", *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:] + done.stdout[-3000:]


def _step_row(run_dir: Path, step: int) -> dict[str, object]:
    row: dict[str, object] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("step") == step and "event" not in record:
            row.update(record)
    return {k: v for k, v in row.items() if not any(t in k for t in TIMING)}


@pytest.mark.parametrize(("strategy", "algorithm"), [("ddp", "grpo"), ("fsdp", "ppo")])
def test_a_resumed_torchrun_job_equals_the_uninterrupted_one(
    strategy: str, algorithm: str, tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """fsdp runs ppo: its critic is sharded too, its optimizer saved as shards beside the policy's."""
    whole = tmp_path / "whole"
    _torchrun(
        str(tiny_config_dir / "tiny.yaml"),
        "--output-dir", str(whole),
        "--set", f"model.name={tiny_model_dir}", "--set", "train.steps=2",
        "--set", "tracking.progress=false", "--set", "checkpoint.every=1",
        "--set", "eval.at_start=false", "--set", "eval.at_end=false",
        "--set", "model.bf16=off", "--set", f"distributed.strategy={strategy}",
        "--set", f"algorithm={algorithm}",
    )  # fmt: skip
    first = whole / "checkpoints" / "step-000001"
    assert (first / "rng-rank1.pt").is_file()  # rank 1's own RNGs
    if strategy == "fsdp":
        assert (first / "optimizer").is_dir() and not (first / "optimizer.pt").exists()
        assert (first / "critic" / "optimizer").is_dir()
        assert not (first / "critic" / "optimizer.pt").exists()
    else:
        assert (first / "optimizer.pt").is_file()

    split = tmp_path / "split"
    shutil.copytree(whole, split)
    shutil.rmtree(split / "checkpoints" / "step-000002")
    _torchrun("--resume", str(split))

    assert _step_row(split, 2) == _step_row(whole, 2)
    after = [
        load_policy(str(run / "checkpoints" / "step-000002" / "model")).model
        for run in (whole, split)
    ]
    for a, b in zip(after[0].parameters(), after[1].parameters(), strict=True):
        assert torch.equal(a, b)
    if algorithm == "ppo":
        critics = [
            load_file(str(run / "checkpoints" / "step-000002" / "critic" / WEIGHTS_FILE))
            for run in (whole, split)
        ]
        assert critics[0].keys() == critics[1].keys()
        for name, tensor in critics[0].items():
            assert torch.equal(tensor, critics[1][name]), name
        assert critics[0]["head.weight"].abs().max() > 0  # the critic trained
    # and the step moved the weights (the comparison is not between two untouched models)
    base = load_policy(str(tiny_model_dir)).model
    assert any(
        not torch.equal(a, b) for a, b in zip(after[0].parameters(), base.parameters(), strict=True)
    )


def test_fsdp_gathers_bf16_weights_and_keeps_fp32_shards(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A bf16 update under fsdp: the forward sees bf16 weights (FSDP2 MixedPrecisionPolicy, not an
    fp32 all-gather cast again by autocast), the shards, their gradients (reduced in fp32) and so the
    optimizer stay fp32, and the entropy and gradient norm are one process's bf16 autocast ones within
    bf16 rounding."""
    sys.path.insert(0, str(Path(__file__).parent))
    import torchrun_mixed_precision_check as mp

    out_file = tmp_path / "mp.pt"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(Path(__file__).with_name("torchrun_mixed_precision_check.py")),
        str(tiny_model_dir), str(out_file),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    got = torch.load(out_file)
    assert got["forward_weight_dtypes"] == ["torch.bfloat16"]
    assert got["shard_dtypes"] == ["torch.float32"]
    assert got["grad_dtypes"] == ["torch.float32"]
    with torch.random.fork_rng(devices=[]):
        one = mp.run(str(tiny_model_dir), None)
    assert one["forward_weight_dtypes"] == ["torch.float32"]  # autocast casts inside the matmul
    # The forward (entropy) and the summed gradient (its norm) within bf16 rounding.
    for key in ("entropy", "grad_norm"):
        assert got["metrics"][key] == pytest.approx(one["metrics"][key], rel=2e-2), key
