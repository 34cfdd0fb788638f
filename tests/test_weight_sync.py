"""Weight sync in bf16 (rlvr.scale.weights): linear weights sent in bf16 give a receiver that samples
from a bf16 weight copy exactly the copy the fp32 weights give, at about half the bytes."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import torch

from rlvr.models import load_policy
from rlvr.rollout.fast_decode import DecodeWeights
from rlvr.scale.weights import load_trainable_state, state_bytes, trainable_state


def _flat(weights: DecodeWeights) -> list[torch.Tensor]:
    """Every tensor of a decode copy, in a fixed order."""
    out: list[torch.Tensor] = []

    def walk(value: object) -> None:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif hasattr(value, "__dataclass_fields__"):
            for f in fields(value):  # type: ignore[arg-type]
                walk(getattr(value, f.name))

    walk(weights)
    return out


def test_bf16_sync_gives_the_receiver_the_same_bf16_copy(tiny_model_dir: Path) -> None:
    trained = load_policy(str(tiny_model_dir)).model
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trained.parameters():  # a stand-in for updates, off the bf16 grid
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    fp32 = trainable_state(trained)
    bf16 = trainable_state(trained, torch.bfloat16)
    assert set(bf16) == set(fp32)
    halved = {n for n, t in bf16.items() if t.dtype == torch.bfloat16}
    # the decoder's projections are sent in bf16; the embedding (a tied head's too) and norms in fp32
    assert "model.layers.0.self_attn.q_proj.weight" in halved
    assert "model.embed_tokens.weight" not in halved
    assert not any("norm" in n for n in halved)
    assert state_bytes(bf16) < 0.8 * state_bytes(fp32)

    receiver = load_policy(str(tiny_model_dir)).model
    load_trainable_state(receiver, bf16)
    want = _flat(DecodeWeights.build(trained, torch.bfloat16))
    got = _flat(DecodeWeights.build(receiver, torch.bfloat16))
    assert len(want) == len(got) > 10
    for a, b in zip(want, got, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
