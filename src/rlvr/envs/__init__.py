"""Environments: the protocol (base.py), tool use (tools.py), and the built-in families (catalog.py)."""

from rlvr.envs.base import (
    ENV_FAMILIES,
    AnswerWithFeedbackEnv,
    Env,
    EnvFamily,
    EnvOptions,
    EnvReset,
    EnvStep,
    SingleTurnEnv,
    get_env_family,
    register_env,
    split_instances,
    stable_fraction,
)

__all__ = [
    "ENV_FAMILIES",
    "AnswerWithFeedbackEnv",
    "Env",
    "EnvFamily",
    "EnvOptions",
    "EnvReset",
    "EnvStep",
    "SingleTurnEnv",
    "get_env_family",
    "register_env",
    "split_instances",
    "stable_fraction",
]
