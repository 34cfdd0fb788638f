"""A run directory holds one run: never mixed with another, never lost to Ctrl-C.

- `check_run_dir` (before any model loads, so the answer is immediate): a fresh start into a
  directory that already holds a run is refused unless `overwrite`; restarting at step 0 there used
  to append a second run's rows to metrics.jsonl and overwrite its checkpoints. `--resume` needs a
  checkpoint to resume from.
- `open_run_dir` (after the model loaded, so a failed load leaves nothing behind): `overwrite`
  moves the old run aside to `DIR.old-<timestamp>` (nothing is deleted), then the directory is made.
- `StopSignals`: the first SIGINT / SIGTERM asks the loop to finish its step, save a checkpoint and
  raise `RunInterrupted`; a second one stops at once.
- `eval_history`: the held-out evals of a run read back from metrics.jsonl (a resumed run's
  summary starts at the base model's eval, not at the step it resumed from).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from rlvr.errors import ConfigError, RunInterrupted

# What a training run writes; any of them means the directory already holds a run.
RUN_FILES = ("config.yaml", "metrics.jsonl", "rollouts.jsonl", "checkpoints")


def holds_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in RUN_FILES)


def check_run_dir(run_dir: Path, *, resume: bool, overwrite: bool, main: bool = True) -> None:
    """Refuse what would mix or lose runs; see the module docstring. Only the main process (rank 0)
    checks for an existing run: other ranks may start after it made the directory."""
    if resume:
        if overwrite:
            raise ConfigError("--resume and --overwrite contradict each other; give one")
        from rlvr.train.checkpoint import checkpoint_dirs

        if not checkpoint_dirs(run_dir):
            raise ConfigError(
                f"--resume '{run_dir}': no checkpoint there to resume from; start it over with "
                "--overwrite (the old files are moved aside)"
            )
        return
    if main and holds_run(run_dir) and not overwrite:
        raise ConfigError(
            f"output_dir '{run_dir}' already holds a run: continue it with "
            f"`rlvr train --resume {run_dir}`, start over with --overwrite (moves it to "
            f"{run_dir.name}.old-<time>), or choose another --output-dir"
        )


def open_run_dir(run_dir: Path, *, overwrite: bool, main: bool = True) -> Path | None:
    """Make the run directory; with `overwrite`, first move an old run aside. Returns where the old
    run went (None when there was none). Only the main process (rank 0) moves anything."""
    moved = None
    if overwrite and main and holds_run(run_dir):
        base = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        moved, n = base, 1
        while moved.exists():  # two overwrites within one second
            moved, n = base.with_name(f"{base.name}-{n}"), n + 1
        run_dir.rename(moved)
    run_dir.mkdir(parents=True, exist_ok=True)
    return moved


def eval_history(rows: list[dict[str, Any]]) -> list[tuple[int, dict[str, float]]]:
    """(step, eval metrics) for every metrics.jsonl row that carries a held-out eval, in order."""
    out = []
    for row in rows:
        if "event" in row or "eval/accuracy" not in row:
            continue
        found = {k: v for k, v in row.items() if k.startswith("eval/")}
        out.append((int(row["step"]), found))
    return out


class StopSignals:
    """SIGINT / SIGTERM handlers for the length of a run (main thread only; restored by `restore`).

    The first signal only sets a flag: the step in flight finishes (its metrics are written), then
    the loop saves a checkpoint and raises `interrupted(...)`. Stopping mid-step would need the
    RNG, sampler and optimizer state of the step's start, which a step does not keep. A second
    signal stops at once: KeyboardInterrupt for SIGINT, SystemExit(143) for SIGTERM.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            self.restore()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.signum = signum
        name = signal.Signals(signum).name
        # os.write: safe inside a handler, and shown even while the progress bar owns the terminal.
        os.write(
            2,
            f"\n{name}: finishing this step, then saving a checkpoint "
            f"(send it again to stop at once, without one)\n".encode(),
        )

    def requested(self, dist: Any = None) -> bool:
        """Whether a stop was asked for; under torchrun rank 0's answer, so every rank agrees."""
        asked = self.signum is not None
        if dist is not None:
            asked = bool(dist.broadcast_object(asked))
            if asked and self.signum is None:
                self.signum = signal.SIGTERM
        return asked

    def interrupted(self, step: int, run_dir: Path) -> RunInterrupted:
        return RunInterrupted(step, run_dir, self.signum or signal.SIGINT)

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
