"""Importing this module registers every built-in env family (`rlvr envs` lists them)."""

from rlvr.envs import bandit, calculator, code, countdown, frozenlake, sokoban, sudoku  # noqa: F401
