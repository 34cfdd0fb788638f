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
from rlvr.envs.gym_adapter import GymEnv, GymSpec, InvalidAction, gym_family
from rlvr.envs.tools import Tool, ToolEnv

__all__ = [
    "ENV_FAMILIES",
    "AnswerWithFeedbackEnv",
    "Env",
    "EnvFamily",
    "EnvOptions",
    "EnvReset",
    "EnvStep",
    "GymEnv",
    "GymSpec",
    "InvalidAction",
    "SingleTurnEnv",
    "Tool",
    "ToolEnv",
    "get_env_family",
    "gym_family",
    "register_env",
    "split_instances",
    "stable_fraction",
]
