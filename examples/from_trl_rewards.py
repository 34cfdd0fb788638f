"""Reward functions written for TRL's GRPOTrainer, used as they are by rlvr (docs/coming_from_trl.md).

TRL calls each function once per batch with every argument a list (one entry per completion);
conversational completions are lists of chat messages. None means "does not apply to this sample".
"""

from __future__ import annotations

import re


def digit_reward(completions, **kwargs):
    """Share of each reply's characters that are digits: a dense signal a tiny model can learn."""
    contents = [completion[0]["content"].strip() for completion in completions]
    return [sum(ch.isdigit() for ch in text) / len(text) if text else 0.0 for text in contents]


def correct_answer(completions, answer, **kwargs):
    """1.0 when the reply's last number is the answer; None where the row has no answer."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        if expected is None:
            rewards.append(None)
            continue
        numbers = re.findall(r"-?\d+", completion[0]["content"])
        rewards.append(float(bool(numbers) and numbers[-1] == expected))
    return rewards
