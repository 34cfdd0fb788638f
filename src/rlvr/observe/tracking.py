"""Where metrics go: RUN_DIR/metrics.jsonl always, and the trackers `tracking.report_to` names
(trackio by default; wandb, tensorboard, mlflow: observe/trackers.py).

One JSON object per line: {"step": k, "time": unix seconds, <metric>: value, ...}; an event row (an
alert, a curriculum promotion) has "event" instead of metrics. Rollout samples go to
RUN_DIR/rollouts.jsonl so a run can be read back trajectory by trajectory.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlvr.observe.trackers import Backend, numeric, open_backends


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
        report_to: Sequence[str] = (),
        project: str,
        run_name: str,
        config: dict[str, Any],
        resume_step: int | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.rollouts_path = run_dir / "rollouts.jsonl"
        # The last step the trackers were sent before the stop (the files still hold it here).
        logged_upto = _last_step(self.metrics_path) if resume_step is not None else None
        if resume_step is not None:
            truncate_jsonl(self.metrics_path, resume_step)
            truncate_jsonl(self.rollouts_path, resume_step)
        # Event rows so far: trackers that show them as one table redraw it with each new one.
        self.events = (
            [row for row in read_metrics(run_dir) if "event" in row]
            if resume_step is not None and self.metrics_path.exists()
            else []
        )
        self.backends: list[Backend] = []
        if report_to:
            self.backends = open_backends(
                run_dir,
                report_to,
                project=project,
                run_name=run_name,
                config=config,
                resume_step=resume_step,
                resumed_upto=logged_upto,
            )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """One row of metrics.jsonl: a step's metrics, or an event row (it has "event")."""
        record = {"step": step, "time": round(time.time(), 3)}
        record.update({k: _finite_or_none(v) for k, v in metrics.items()})
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if "event" in metrics:
            self.events.append(record)
            for backend in self.backends:
                backend.log_event(record, self.events, step)
            return
        values = numeric(metrics)
        for backend in self.backends:
            backend.log(values, step)

    def log_rollouts(self, rows: list[dict[str, Any]], step: int) -> None:
        with self.rollouts_path.open("a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")
        for backend in self.backends:
            backend.log_rollouts(rows, step)

    def close(self) -> None:
        backends, self.backends = self.backends, []
        for backend in backends:
            backend.close()


def _last_step(path: Path) -> int | None:
    if not path.exists():
        return None
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line]
    return max(steps, default=None)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class NullTracker(Tracker):
    """What a non-zero torchrun rank logs to: nothing (rank 0 writes the run's files)."""

    def __init__(self, run_dir: Path, **_: Any) -> None:
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.rollouts_path = run_dir / "rollouts.jsonl"
        self.events = []
        self.backends = []

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def log_rollouts(self, rows: list[dict[str, Any]], step: int) -> None:
        pass
