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
