"""What every endpoint of `rlvr serve` shares."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from rlvr.rollout.hf import HFGenerator


@dataclass
class ServeState:
    """The served policy and its bookkeeping.

    `model` is the policy (a peft model when LoRA adapters are loaded), `generator` samples from it;
    `lock` serialises generation and weight loads (one model, one RNG). `model_name` is the id
    clients pass as `model` (the OpenAI API requires one); `recorder` keeps trajectories per rollout
    id (the app makes one when None). `adapters` maps a loaded LoRA adapter's name to its folder.
    """

    model: Any
    tokenizer: Any
    generator: HFGenerator
    model_name: str
    recorder: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    adapters: dict[str, str] = field(default_factory=dict)
    weights_version: int = 0
    # Training behind the endpoint (`rollout: external`): requests sample at the run's temperature (the
    # trainer recomputes log-probs at it; another would make every ratio wrong) and at most the run's
    # token budget per reply. None = whatever the request asks.
    required_temperature: float | None = None
    max_tokens_cap: int | None = None
    # The temperature of a request that names none (OpenAI's default 1; 0 = greedy, for evals).
    default_temperature: float = 1.0
