"""rlvr.allocator: after keep_freed_memory() a large tensor comes from the heap, not a fresh mmap."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# A fresh interpreter: the setting is for the whole process, and pytest's may already have it.
_PROBE = """
import ctypes
import torch
from rlvr.allocator import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
if not hasattr(libc, "mallinfo2"):  # glibc before 2.33, or not glibc
    print("no-mallinfo2")
    raise SystemExit(0)
libc.mallinfo2.restype = MallInfo2

def mmapped_while_alive(nbytes):
    before = libc.mallinfo2().hblkhd
    tensor = torch.ones(nbytes, dtype=torch.uint8)
    during = libc.mallinfo2().hblkhd
    del tensor
    return during - before

default = mmapped_while_alive(64 << 20)
applied = keep_freed_memory()
again = keep_freed_memory()
kept = mmapped_while_alive(64 << 20)
print(default, applied, again, kept)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_tensors_come_from_the_heap_after_keep_freed_memory() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    if proc.stdout.strip() == "no-mallinfo2":
        pytest.skip("this libc has no mallinfo2 to count mmapped blocks")
    default, applied, again, kept = proc.stdout.split()
    assert int(default) >= 64 << 20  # glibc's default: a 64 MiB block is its own mmap
    assert applied == again == "True"  # applied once, idempotent after
    assert int(kept) == 0  # now served from the heap, and its pages stay for the next one


@pytest.mark.parametrize("keep", [True, False])
def test_the_loop_applies_it_only_when_the_config_says(
    keep: bool,
    tiny_config_dir: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import rlvr.train.run_setup as run_setup
    from rlvr.config import load_config
    from rlvr.train.loop import train

    calls: list[bool] = []
    monkeypatch.setattr(run_setup, "keep_freed_memory", lambda: calls.append(True) or True)
    cfg = load_config(
        tiny_config_dir / "tiny.yaml",
        [
            f"model.name={tiny_model_dir}",
            f"output_dir={tmp_path / 'run'}",
            "tracking.progress=false",
            "train.steps=1",
            "eval.every=0",
            "eval.at_start=false",
            "eval.at_end=false",
            f"train.keep_freed_memory={str(keep).lower()}",
            "model.bf16=off",
        ],
    )
    train(cfg, config_dir=tiny_config_dir)
    assert calls == ([True] if keep else [])
