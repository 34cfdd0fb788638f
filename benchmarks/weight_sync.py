"""Seconds and bytes of one full-weight sync to a generation server: the old file path against the
new one (issue 35, item 3), on the same weights, in one run.

    python benchmarks/weight_sync.py                      # SmolLM2-135M (bundled)
    python benchmarks/weight_sync.py --shape qwen2.5-1.5b # a random model of Qwen2.5-1.5B's shape

- old: `save_pretrained` of the fp32 policy into RUN_DIR/weight_sync on disk (what every full sync
  did before), plus the tied head;
- new: rlvr.rollout.server.save_full in bf16 (the dtype a bf16 vLLM computes in), cast one tensor
  at a time into ~1 GiB shards, into /dev/shm (what a launched server gets by default).

Each is timed as the sync's write plus the server side's read of every tensor back into memory
(rlvr.rollout.weight_files.read_weight_files, what rlvr serve's reload does before copying), best of
`--repeats`. vLLM's own reload then copies the tensors into its model, the same for both. No GPU
and no server process: this isolates what changed. On a GPU box the NCCL transfer (not built) would
skip the host entirely.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine
from rlvr.models import load_policy
from rlvr.rollout.server import save_full, write_folder, write_tied_head
from rlvr.rollout.weight_files import read_weight_files as read_weights

REPO = Path(__file__).resolve().parent.parent
SHAPES = {"qwen2.5-1.5b": REPO / "tests" / "data" / "configs" / "qwen2.5-1.5b.json"}


def load(shape: str | None) -> object:
    if shape is None:
        return load_policy("smollm2-135m-instruct")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(SHAPES[shape]))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    folder = Path(tempfile.mkdtemp(prefix="rlvr-bench-model-"))
    model.save_pretrained(folder)
    load_policy("smollm2-135m-instruct").tokenizer.save_pretrained(
        folder
    )  # any tokenizer: never used here
    del model
    policy = load_policy(str(folder))
    shutil.rmtree(folder)
    return policy


def timed(target: Path, write: object, repeats: int) -> tuple[float, int]:
    best, size = float("inf"), 0
    for _ in range(repeats):
        started = time.perf_counter()
        folder = write_folder(target, write)  # type: ignore[arg-type]
        weights = read_weights(folder)
        best = min(best, time.perf_counter() - started)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        del weights
        shutil.rmtree(folder)
    return best, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    policy = load(args.shape)
    model = policy.model  # type: ignore[attr-defined]
    n = sum(p.numel() for p in model.parameters())
    print("\n".join(_machine.machine().header()))
    print(
        f"model: {args.shape or 'SmolLM2-135M'} ({n / 1e6:.0f}M parameters), best of {args.repeats}"
    )

    def old(d: str) -> None:
        model.save_pretrained(d)
        write_tied_head(model, d)

    disk = Path(tempfile.mkdtemp(prefix="rlvr-bench-sync-", dir=REPO))
    shm = Path(tempfile.mkdtemp(prefix="rlvr-bench-sync-", dir="/dev/shm"))
    try:
        rows = [
            ("fp32 save_pretrained, disk (old)", *timed(disk / "s", old, args.repeats)),
            (
                "bf16 shards, /dev/shm (new)",
                *timed(
                    shm / "s", lambda d: save_full(policy, d, dtype=torch.bfloat16), args.repeats
                ),  # type: ignore[arg-type]
            ),
        ]
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    print("| sync | bytes | seconds (write + read back) |")
    print("|---|---:|---:|")
    for name, seconds, size in rows:
        print(f"| {name} | {size / 2**20:.0f} MiB | {seconds:.2f} |")
    print(
        f"new / old: {rows[1][1] / rows[0][1]:.2f}x the seconds, {rows[1][2] / rows[0][2]:.2f}x the bytes"
    )


if __name__ == "__main__":
    main()
