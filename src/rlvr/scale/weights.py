"""Moving the trained weights from the learner to whatever samples: a copy in another thread (async
rollouts), Ray actors, a server. Only the parameters that train move (LoRA: the adapters)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def trainable_state(model: Any, matmul_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """{parameter name: a detached CPU copy} of every parameter that trains (requires_grad).

    `matmul_dtype` (bf16 for a receiver that samples from a bf16 weight copy): the weights of linear
    layers are sent in it, half the bytes; everything its copy keeps in fp32 (norms, biases, the
    embedding, a head tied to it) is sent in fp32. The receiver's copy is then bit-identical to one
    built from the fp32 weights (tests/test_weight_sync.py)."""
    matmul = _linear_weight_names(model) if matmul_dtype is not None else set()
    return {
        name: p.detach().to("cpu", matmul_dtype if name in matmul else p.dtype, copy=True)
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def state_bytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _linear_weight_names(model: Any) -> set[str]:
    """Parameter names of nn.Linear weights, less one shared with the input embedding (a tied head:
    the embedding is looked up in fp32)."""
    get_embedding = getattr(model, "get_input_embeddings", None)
    embedding = get_embedding() if get_embedding is not None else None
    tied = getattr(embedding, "weight", None)
    return {
        f"{name}.weight" if name else "weight"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module.weight is not tied
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
