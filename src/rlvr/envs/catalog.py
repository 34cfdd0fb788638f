"""The built-in env families: importing this module registers each (`rlvr envs` lists them).

rlvr.registry reads `ENV_FAMILIES` from here, so the protocol (base.py) never imports the families
that implement it.
"""

from rlvr.envs import bandit, calculator, code, countdown, frozenlake, sokoban, sudoku  # noqa: F401
from rlvr.envs.base import ENV_FAMILIES

__all__ = ["ENV_FAMILIES"]
