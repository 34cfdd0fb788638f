"""The Generator seam: token ids in, sampled token ids and their behaviour log-probs out.

Implementations: `HFGenerator` (transformers, in process, KV cache). A vLLM/OpenAI-server backend plugs in
behind the same protocol; the loop never knows which one it talks to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `n` completions per prompt; temperature 0 means greedy.

    The behaviour log-probs returned are those of the temperature-scaled distribution (before top-p
    truncation), which is what the trainer recomputes, so the importance ratio starts at 1.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class Completion:
    """One sampled continuation: tokens exactly as sampled (EOS included when it ended the turn)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: Literal["stop", "length"]


class Generator(Protocol):
    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        """For each of the P prompts, `sampling.n` completions: a (P, n) nested list."""
        ...
