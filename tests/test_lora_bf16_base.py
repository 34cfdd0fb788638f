"""A LoRA policy's frozen base stored in bf16 (RolloutPlan.store_frozen_base_bf16) when the update is
bf16 and the sampler is the fast path's bf16 copy.

What must hold: the update's forward and backward under bf16 autocast are bit-identical to the fp32-
stored base's (autocast casts those weights to the same bf16 values on every call); the reference
(adapters off) too; the sampler's copy merges the adapters in fp32 over the stored base; a forward
without autocast (HF's fp32 sampler) turns the base back to fp32 rather than failing; and the loop
converts exactly when the three conditions hold.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from rlvr.models import matmul_weights_to_bf16, matmul_weights_to_fp32
from rlvr.rollout.fast_decode import DecodeWeights
from rlvr.rollout.generator import SamplingParams
from rlvr.rollout.hf import HFGenerator

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20]])


def base_linear_dtypes(model: Any) -> set[torch.dtype]:
    return {
        p.dtype
        for n, p in model.named_parameters()
        if "base_layer" in n or n.endswith("lm_head.weight")
    }


def adapter_dtypes(model: Any) -> set[torch.dtype]:
    return {p.dtype for n, p in model.named_parameters() if "lora_" in n}


def autocast_loss_and_grads(model: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=IDS).logits
    loss = torch.log_softmax(logits.float(), dim=-1)[:, :-1].gather(2, IDS[:, 1:, None]).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def test_the_bf16_update_is_bit_identical_over_a_bf16_stored_base(lora_policy: Any) -> None:
    model = lora_policy.model
    stored = copy.deepcopy(model)
    matmul_weights_to_bf16(stored)
    assert base_linear_dtypes(stored) == {torch.bfloat16}
    assert adapter_dtypes(stored) == {torch.float32}  # the trained weights stay fp32
    assert stored.get_input_embeddings().weight.dtype == torch.float32  # the lookup stays fp32
    assert stored.get_output_embeddings().weight is not stored.get_input_embeddings().weight
    logits, grads = autocast_loss_and_grads(model)
    logits_s, grads_s = autocast_loss_and_grads(stored)
    assert torch.equal(logits, logits_s)
    assert grads.keys() == grads_s.keys() and grads  # the adapters' gradients, and only those
    assert all("lora_" in n for n in grads)
    for name in grads:
        assert torch.equal(grads[name], grads_s[name]), name
    reference = (model.disable_adapter(), stored.disable_adapter())  # adapters off
    with torch.no_grad(), reference[0], reference[1], torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(input_ids=IDS).logits, stored(input_ids=IDS).logits)


def test_the_sampling_copy_merges_the_adapters_in_fp32(lora_policy: Any) -> None:
    """The copy of a bf16-stored base is bf16(bf16(W) + s B A) with the sum in fp32: exactly, so a
    merge that rounded the delta on its own first would fail; the stored bf16 head is read in
    place, not copied."""
    stored = copy.deepcopy(lora_policy.model)
    matmul_weights_to_bf16(stored)
    got = DecodeWeights.build(stored, torch.bfloat16)
    attn = stored.base_model.model.model.layers[0].self_attn
    parts = []
    for module in (attn.q_proj, attn.k_proj, attn.v_proj):
        base = module.get_base_layer().weight
        assert base.dtype == torch.bfloat16
        parts.append((base.float() + module.get_delta_weight("default").float()).bfloat16())
    assert got.layers[0].qkv[0].dtype == torch.bfloat16
    assert torch.equal(got.layers[0].qkv[0], torch.cat(parts))
    assert got.head.data_ptr() == stored.get_output_embeddings().weight.data_ptr()


def test_an_fp32_forward_turns_the_base_back_to_fp32(lora_policy: Any) -> None:
    """HF's fp32 sampler (here asked directly; in a run, when a hook makes the fast path decline)
    gets fp32 weights back, with a warning, instead of a dtype error; the head is tied to the
    embedding again."""
    model = lora_policy.model
    tok = lora_policy.tokenizer
    matmul_weights_to_bf16(model)
    gen = HFGenerator(model, tok, {int(tok.eos_token_id)}, seed=0, decode="hf", autocast_bf16=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = gen.generate([[5, 6, 7, 8]], SamplingParams(n=2, temperature=1.0, max_new_tokens=4))
    assert len(out[0]) == 2 and all(c.token_ids for c in out[0])
    assert any("are fp32 again" in str(w.message) for w in caught)
    assert base_linear_dtypes(model) == {torch.float32}
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.config.tie_word_embeddings
    assert not matmul_weights_to_fp32(model)  # nothing left to undo


@pytest.mark.parametrize(
    ("overrides", "converted"),
    [
        (["model.bf16=on", "generator.decode=fast", "generator.decode_dtype=bfloat16"], True),
        (["model.bf16=on", "generator.decode=auto", "generator.decode_dtype=auto"], True),
        (["model.bf16=off", "generator.decode=fast", "generator.decode_dtype=bfloat16"], False),
        (["model.bf16=on", "generator.decode=hf"], False),
        (["model.bf16=on", "generator.decode=fast", "generator.decode_dtype=float32"], False),
        (["model.bf16=on", "model.lora.enabled=false"], False),
    ],
)
def test_the_loop_stores_the_base_in_bf16_exactly_when_it_pays(
    tiny_config_dir: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    overrides: list[str],
    converted: bool,
) -> None:
    import rlvr.train.loop as loop
    from rlvr.config import load_config

    seen: list[tuple[set[torch.dtype], set[torch.dtype]]] = []
    real_update = loop.policy_update

    def update(policy: Any, *args: Any, **kwargs: Any) -> Any:
        model = policy.model
        linear = {
            m.weight.dtype
            for m in model.modules()
            if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad
        }
        seen.append((linear, {p.dtype for p in policy.trainable_parameters()}))
        return real_update(policy, *args, **kwargs)

    monkeypatch.setattr(loop, "policy_update", update)
    cfg = load_config(
        tiny_config_dir / "tiny.yaml",
        [
            f"model.name={tiny_model_dir}",
            f"output_dir={tmp_path / 'run'}",
            "model.lora.enabled=true",
            "train.steps=2",
            "eval.at_start=false",
            "eval.at_end=false",
            "tracking.progress=false",
            *overrides,
        ],
    )
    loop.train(cfg, config_dir=tiny_config_dir)
    assert len(seen) == 2
    for frozen, trained in seen:
        assert trained == {torch.float32}
        if converted:
            assert frozen == {torch.bfloat16}
        elif cfg.model.lora.enabled:
            assert frozen == {torch.float32}
