"""Model FLOPs of the update, for achieved FLOP/s and MFU (model FLOPs utilisation, PaLM appendix B).

A dense decoder's matmuls cost 2 FLOPs per weight per token forward, and the backward twice that
(one product for the activations' gradient, one for the weights'). Frozen weights (a LoRA run's base)
need only the activations' gradient: 1x forward. The lm_head counts only at positions whose logits are
used (the completion tokens), since the trainer asks the model for no others. Attention's own
products (QK^T, AV: 4 x layers x width x context per token) are left out: under 3% of the total for
SmolLM2 at a 100-token context. Padding is not counted: MFU is about useful work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LinearWeights:
    """Weights of the model's matmuls: `body` (every linear layer but the output head) and `head`
    (the lm_head), each split into trainable and frozen counts."""

    body_trainable: int
    body_frozen: int
    head_trainable: int
    head_frozen: int

    @property
    def body(self) -> int:
        return self.body_trainable + self.body_frozen

    @property
    def head(self) -> int:
        return self.head_trainable + self.head_frozen


def linear_weights(model: Any) -> LinearWeights:
    """Count the weights that take part in matmuls (embedding lookups do not)."""
    head_module = model.get_output_embeddings()
    head_ids = {id(p) for p in head_module.parameters()} if head_module is not None else set()
    counts = {"body_trainable": 0, "body_frozen": 0, "head_trainable": 0, "head_frozen": 0}
    seen: set[int] = set()
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        for p in module.parameters(recurse=False):
            if id(p) in seen or p.dim() != 2:
                continue
            seen.add(id(p))
            part = "head" if id(p) in head_ids else "body"
            counts[f"{part}_{'trainable' if p.requires_grad else 'frozen'}"] += p.numel()
    return LinearWeights(**counts)


def forward_flops(weights: LinearWeights, tokens: float, scored: float) -> float:
    """One forward over `tokens` positions with logits at `scored` of them."""
    return 2.0 * weights.body * tokens + 2.0 * weights.head * scored


def backward_flops(weights: LinearWeights, tokens: float, scored: float) -> float:
    """The backward of that forward: the activations' gradient through every matmul, plus the
    weights' gradient of the trainable ones."""
    activations = forward_flops(weights, tokens, scored)
    trainable = 2.0 * weights.body_trainable * tokens + 2.0 * weights.head_trainable * scored
    return activations + trainable
