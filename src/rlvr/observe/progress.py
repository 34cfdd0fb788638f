"""A live progress bar with the numbers a practitioner watches: reward, accuracy, entropy, step time."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress


class Progress:
    def __init__(
        self, total: int, start: int = 0, enabled: bool = True, label: str = "train"
    ) -> None:
        self.console = Console(stderr=True)
        self.enabled = enabled
        self._bar: RichProgress | None = None
        self._last_eval = ""
        if enabled:
            self._bar = RichProgress(
                TextColumn(f"[bold]{label}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                console=self.console,
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total, completed=start, info="")
            self._bar.start()

    def note(self, text: str) -> None:
        if self.enabled:
            self.console.print(text)

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        if self._bar is None:
            return
        if "eval/accuracy" in metrics:
            self._last_eval = f" heldout {metrics['eval/accuracy']:.0%}"
        if "reward" not in metrics:  # an offline stage (SFT, DPO, reward model): its loss
            if "eval/loss" in metrics:
                self._last_eval = f" eval loss {metrics['eval/loss']:.3f}"
            info = f"loss {metrics.get('loss', float('nan')):.3f}{self._last_eval}"
            self._bar.update(self._task, completed=step, info=info)
            return
        info = (
            f"reward {metrics.get('reward', float('nan')):.2f} "
            f"entropy {metrics.get('entropy', float('nan')):.2f} "
            f"len {metrics.get('completions/mean_length', 0):.0f} "
            f"{metrics.get('step_time', 0):.1f}s/step{self._last_eval}"
        )
        self._bar.update(self._task, completed=step, info=info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
