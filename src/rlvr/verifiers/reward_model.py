"""A learned reward model as a reward function. NOT a verifier: its score is a model's guess.

In a config rubric:

    rewards:
      - fn: rlvr.verifiers.reward_model:reward_model
        options: {path: runs/rm/model}

A policy optimised against a reward model learns to exploit it (reward hacking, Gao et al. 2022), so
the function carries `mark_not_verifiable` and its values should be read apart from verified ones.

The score depends on the prompt. A rubric passes it as `prompt`: the task's own `prompt` field when
it has one, else the task's prompt messages (see `RewardFunction.keyword_arguments`). Called without
a prompt the function raises rather than score the completion out of context.

The model is loaded once per (path, max_length) and shared by every call and thread.
"""

from __future__ import annotations

import threading
from typing import Any

from rlvr.verifiers.judge import mark_not_verifiable

__all__ = ["reward_model"]

_SCORERS: dict[tuple[str, int], Any] = {}
_LOAD_LOCK = threading.Lock()


def _scorer(path: str, max_length: int) -> Any:
    key = (path, max_length)
    with _LOAD_LOCK:
        scorer = _SCORERS.get(key)
        if scorer is None:
            from rlvr.offline.reward_model import load_reward_model

            scorer = _SCORERS[key] = load_reward_model(path, max_length=max_length)
    return scorer


def reward_model(
    completion: str,
    path: str,
    prompt: str | list[dict[str, str]] | None = None,
    max_length: int = 1024,
    scale: float = 1.0,
) -> float:
    """`scale` * the reward model's score of `completion` as the assistant's reply to `prompt`.

    `path` is a reward model directory (or the OUTPUT_DIR of `train_reward_model`). Scores are
    unbounded logits; `scale` (or the rubric weight) sets their size next to other rewards.
    """
    if prompt is None:
        raise ValueError("reward_model needs the prompt the completion answers (prompt=...)")
    return scale * float(_scorer(path, max_length).score(prompt, completion))


mark_not_verifiable(reward_model)
