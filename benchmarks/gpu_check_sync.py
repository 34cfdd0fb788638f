"""The weight-sync part of the GPU check (issue 35): seconds and bytes of one full-weight sync of a
Qwen2.5-1.5B-shaped random model (benchmarks/gpu_check.py builds it), each way rlvr has:

- file, old: `save_pretrained` of the fp32 weights to disk, then read back (what a server reload
  reads);
- file, new: rlvr's bf16 shards in /dev/shm, then read back (`generator.backend: server` with a
  launched bf16 vLLM);
- colocated vLLM: the weights handed to `reload_weights` in memory, in bf16
  (`generator.backend: vllm_colocate`), with the canary gap after the sync and the seconds of a
  sleep/wake cycle;
- served vLLM: a launched `vllm serve`, synced through /dev/shm by `reload_weights` over HTTP.

The two vLLM rows need vLLM installed where the check runs (`import vllm`; `vllm` on PATH); without
it they are recorded as skipped, with that reason. Each sync is timed twice after the first (which
pays allocations), best of two.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any


def _file_rows(policy: Any, work: Path) -> list[dict[str, Any]]:
    import torch

    from rlvr.rollout.server import save_full, write_tied_head
    from weight_sync import timed  # benchmarks/weight_sync.py: write, read back, best of N

    def old(d: str) -> None:
        policy.model.save_pretrained(d)
        write_tied_head(policy.model, d)

    shm_root = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
    shm = Path(tempfile.mkdtemp(prefix="rlvr-gpu-check-sync-", dir=shm_root))
    try:
        old_s, old_b = timed(work / "old-sync", old, 2)
        new_s, new_b = timed(shm / "s", lambda d: save_full(policy, d, dtype=torch.bfloat16), 2)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return [
        {"part": "sync", "name": "file fp32 disk (old)", "ok": True, "seconds": round(old_s, 3),
         "bytes": old_b},
        {"part": "sync", "name": "file bf16 /dev/shm", "ok": True, "seconds": round(new_s, 3),
         "bytes": new_b},
    ]  # fmt: skip


def _engine_row(name: str, generator: Any, policy: Any, bf16: bool) -> dict[str, Any]:
    """Two more syncs after the one the generator was built with; the canary after the last."""
    from rlvr.train.canary import canary_gap

    seconds, sent = float("inf"), 0.0
    for step in (1, 2):
        generator.sync_weights(policy, step=step)
        seconds = min(seconds, generator.last_sync["sync/weight_seconds"])
        sent = generator.last_sync["sync/weight_bytes"]
    row = {"part": "sync", "name": name, "ok": True, "seconds": round(seconds, 3)}
    row |= {"bytes": int(sent), "canary_gap": canary_gap(generator, policy, bf16=bf16)}
    return row


def _colocated_row(policy: Any, model_dir: Path, work: Path, cuda: bool) -> dict[str, Any]:
    from rlvr.config import GeneratorConfig
    from rlvr.rollout.vllm_colocate import build_colocated

    cfg = GeneratorConfig(
        backend="vllm_colocate",
        weight_sync="full",
        vllm={
            "dtype": "bfloat16" if cuda else "float32",
            "sleep": "auto",
            "engine_args": {"enforce_eager": True, "max_model_len": 256},
        },
    )
    generator = build_colocated(policy, cfg, str(model_dir), work, seed=0)
    try:
        row = _engine_row("colocated vLLM, in memory", generator, policy, bf16=cuda)
        if generator.sleep_mode:  # a sleep/wake cycle around an update, then the sync
            started = time.perf_counter()
            generator.sleep()
            generator.sync_weights(policy, step=3)
            row["sleep_wake_sync_s"] = round(time.perf_counter() - started, 3)
        return row
    finally:
        generator.close()


def _served_row(policy: Any, model_dir: Path, work: Path, cuda: bool) -> dict[str, Any]:
    from rlvr.config import GeneratorConfig
    from rlvr.rollout.server import build_server_generator

    cfg = GeneratorConfig(
        backend="server",
        launch="vllm",
        weight_sync="full",
        vllm={"dtype": "bfloat16" if cuda else "float32"},
        launch_args=["--enforce-eager", "--max-model-len", "256"],
    )
    generator = build_server_generator(
        policy, cfg, work / "served", seed=0, model_path=str(model_dir)
    )
    try:
        return _engine_row("served vLLM, /dev/shm files", generator, policy, bf16=cuda)
    finally:
        generator.close()


def sync_runs(clock: Any, device: str, work: Path, model_dir: Path) -> list[dict[str, Any]]:
    """The rows above for the model at `model_dir` (loaded in fp32 on `device`, as a run holds it)."""
    import importlib.util

    from rlvr.models import load_policy

    if not clock.allows(60):
        return [{"part": "sync", "name": "weight sync", "ok": None, "skipped": "time budget"}]
    policy = load_policy(str(model_dir), device=device)
    cuda = device.startswith("cuda")
    try:
        rows = _file_rows(policy, work)
    except Exception as err:  # recorded; the engine rows still run
        rows = [
            {
                "part": "sync",
                "name": "file syncs",
                "ok": False,
                "error": f"{type(err).__name__}: {err}"[:500],
            }
        ]
    have_vllm = importlib.util.find_spec("vllm") is not None
    engines = [
        ("colocated vLLM, in memory", _colocated_row, have_vllm, "vllm is not importable here"),
        ("served vLLM, /dev/shm files", _served_row, shutil.which("vllm") is not None,
         "no vllm executable on PATH"),
    ]  # fmt: skip
    for name, row_of, available, why in engines:
        if not available or not clock.allows(240):
            skipped = why if not available else "time budget"
            rows.append({"part": "sync", "name": name, "ok": None, "skipped": skipped})
            continue
        try:
            rows.append(row_of(policy, model_dir, work, cuda))
        except Exception as err:  # recorded; the check goes on
            rows.append(
                {
                    "part": "sync",
                    "name": name,
                    "ok": False,
                    "error": f"{type(err).__name__}: {err}"[:500],
                }
            )
    return rows


def sync_table(parts: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| weight sync | ok | seconds | MiB | canary gap | sleep+wake+sync s |",
        "|---" * 6 + "|",
    ]
    for p in parts:
        if p.get("part") != "sync":
            continue
        if p.get("ok") is None:
            lines.append(f"| {p['name']} | skipped ({p['skipped']}) | | | | |")
        elif not p["ok"]:
            lines.append(f"| {p['name']} | ERROR: {p['error'][:120]} | | | | |")
        else:
            gap = p.get("canary_gap")
            lines.append(
                f"| {p['name']} | yes | {p['seconds']} | {p['bytes'] / 2**20:.0f} | "
                f"{'' if gap is None else f'{gap:.1e}'} | {p.get('sleep_wake_sync_s', '')} |"
            )
    return lines
