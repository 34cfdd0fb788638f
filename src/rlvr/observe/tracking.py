"""Where metrics go: RUN_DIR/metrics.jsonl always, trackio (local) when enabled.

One JSON object per line: {"step": k, "time": unix seconds, <metric>: value, ...}. Rollout samples go
to RUN_DIR/rollouts.jsonl so a run can be read back trajectory by trajectory.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def truncate_jsonl(path: Path, after_step: int) -> None:
    """Drop lines logged after `after_step` (they belong to a future a resumed run will redo)."""
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line).get("step", 0) <= after_step
    ]
    path.write_text("".join(line + "\n" for line in kept))


class Tracker:
    def __init__(
        self,
        run_dir: Path,
        *,
        use_trackio: bool,
        project: str,
        run_name: str,
        config: dict[str, Any],
        resume_step: int | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.rollouts_path = run_dir / "rollouts.jsonl"
        if resume_step is not None:
            truncate_jsonl(self.metrics_path, resume_step)
            truncate_jsonl(self.rollouts_path, resume_step)
        self._trackio: Any = None
        if use_trackio:
            import trackio

            trackio.init(
                project=project,
                name=run_name,
                config=config,
                resume="allow" if resume_step is not None else "never",
                embed=False,
            )
            self._trackio = trackio

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step, "time": round(time.time(), 3)}
        record.update({k: _finite_or_none(v) for k, v in metrics.items()})
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._trackio is not None:
            numeric = {
                k: v
                for k, v in metrics.items()
                if isinstance(v, int | float) and not isinstance(v, bool)
            }
            self._trackio.log(numeric, step=step)

    def log_rollouts(self, rows: list[dict[str, Any]], step: int) -> None:
        with self.rollouts_path.open("a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")

    def close(self) -> None:
        if self._trackio is not None:
            self._trackio.finish()
            self._trackio = None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class NullTracker(Tracker):
    """What a non-zero torchrun rank logs to: nothing (rank 0 writes the run's files)."""

    def __init__(self, run_dir: Path, **_: Any) -> None:
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.rollouts_path = run_dir / "rollouts.jsonl"
        self._trackio = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def log_rollouts(self, rows: list[dict[str, Any]], step: int) -> None:
        pass
