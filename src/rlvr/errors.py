"""User-facing errors: the CLI prints these as one line, without a traceback."""

from __future__ import annotations


class RlvrError(Exception):
    """A problem the user can fix (bad config, missing file, failing reward function...).

    The message must say what was wrong and where, in one line.
    """


class ConfigError(RlvrError):
    pass


class RewardError(RlvrError):
    """Too many reward-function failures: the run stops rather than train on silent zeros."""


class RunInterrupted(RlvrError):
    """SIGINT / SIGTERM stopped a run after a step, with a checkpoint saved; the CLI prints the
    message and exits with 128 + the signal number (130 for Ctrl-C, 143 for SIGTERM)."""

    def __init__(self, step: int, run_dir: object, signum: int, hint: str | None = None) -> None:
        self.step, self.run_dir, self.signum = step, run_dir, signum
        how = hint or f"rlvr train --resume {run_dir}"
        super().__init__(f"interrupted at step {step}; resume with: {how}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
