"""One generation server per torchrun job (issue 35, item 1): rank 0 launches it (here `rlvr serve`,
the stand-in speaking vLLM's protocol) and syncs it once per step, every rank sends it its prompts.

Before, every rank launched a server of its own and synced it. Checked with 2 gloo ranks, ddp and
fsdp (whose sync is written from the weights gathered from the shards): one server started, one sync
folder per step, and the behaviour log-probs every rank brought back equal the trainer's (fp32 on
both sides), so all ranks sampled from the synced weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlvr.precision import logprob_gap_tolerance


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_server_per_job(
    strategy: str, tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / strategy
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "--tee", "3", "-m", "rlvr.cli", "train", str(tiny_config_dir / "tiny.yaml"),
        "--output-dir", str(run_dir),
        "--set", f"model.name={tiny_model_dir}", "--set", "train.steps=2",
        "--set", "tracking.progress=false", "--set", "eval.at_start=false",
        "--set", "eval.at_end=false", "--set", "model.bf16=off",
        "--set", "generator.backend=server", "--set", "generator.launch=rlvr",
        "--set", "generator.weight_sync=full",
        "--set", f"distributed.strategy={strategy}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:] + done.stdout[-2000:]
    log = (run_dir / "generator_server.log").read_text()
    assert log.count("rlvr serve: ") == 1, log[-2000:]
    rows = [
        r
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    ]
    assert [r["step"] for r in rows] == [1, 2]
    tolerance = logprob_gap_tolerance(False)
    assert all(r["update/rows_trained"] == 32 for r in rows)  # both ranks' shares, gathered
    assert all(r["update/behaviour_logprob_abs_diff"] < tolerance for r in rows), rows
    assert all(r["sync/canary_logprob_abs_diff"] < tolerance for r in rows), rows
