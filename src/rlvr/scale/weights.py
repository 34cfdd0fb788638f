"""Moving the trained weights from the learner to whatever samples: a copy in another thread (async
rollouts), Ray actors, a server. Only the parameters that train move (LoRA: the adapters)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    """{parameter name: a detached CPU copy} of every parameter that trains (requires_grad)."""
    return {
        name: p.detach().to("cpu", copy=True)
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def load_trainable_state(model: Any, state: Mapping[str, torch.Tensor]) -> None:
    """Copy `state` (from `trainable_state` of a model with the same architecture) into `model` in place.

    A name `model` does not have is an error naming it: a silent partial load would sample from a
    model the learner never trained."""
    params = dict(model.named_parameters())
    missing = [name for name in state if name not in params]
    if missing:
        raise KeyError(f"weight sync: the receiving model has no parameter {missing[0]!r}")
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))
