"""Reward functions for examples/tiny.yaml: a dense signal a random tiny model can learn in seconds."""

from __future__ import annotations


def digit_fraction(completion: str, **_: object) -> float:
    """Share of the completion's characters that are digits (0.0 for an empty completion)."""
    text = completion.strip()
    if not text:
        return 0.0
    return sum(ch.isdigit() for ch in text) / len(text)
