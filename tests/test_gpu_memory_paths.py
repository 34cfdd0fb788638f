"""What a first GPU run needs from the update and the sampler (issue 61), checked on the CPU:
gradients freed after each optimizer step, the fast sampler kept under gradient checkpointing,
and the decode speed reported per step."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from rlvr.config import load_config
from rlvr.models import LoraSettings, load_policy
from rlvr.optim import adamw
from rlvr.records import Trajectory
from rlvr.rollout.fast_decode import decline_reason

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _row(prompt: list[int], completion: list[int]) -> Trajectory:
    n_p, n_c = len(prompt), len(completion)
    return Trajectory(
        task_id="t",
        token_ids=tuple(prompt + completion),
        policy_mask=(0,) * n_p + (1,) * n_c,
        logprobs=(0.0,) * (n_p + n_c),
        prompt_length=n_p,
        completion_text="",
        finish_reason="length",
    )


def test_gradients_are_freed_after_the_step_and_the_weights_moved(tiny_model_dir: Path) -> None:
    from rlvr.train.update import policy_update

    cfg = load_config(None, [f"model.name={tiny_model_dir}", "model.bf16=off"])
    policy = load_policy(str(tiny_model_dir))
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    opt = adamw(policy.trainable_parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0)
    rows = [_row([5, 6, 7], [8, 9]), _row([5, 6, 7], [10, 11, 12])]
    metrics = policy_update(policy, opt, rows, [[1.0, 1.0], [-1.0, -1.0, -1.0]], cfg)
    assert metrics["grad_norm"] > 0 and metrics["loss"] == metrics["loss"]
    # held through a rollout they would cost 4 bytes a trained parameter (28 GiB at 7B)
    assert all(p.grad is None for p in policy.trainable_parameters())
    moved = [n for n, p in policy.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) >= len(before) - 1  # every tensor that got a gradient moved


@pytest.mark.parametrize("lora", [False, True])
def test_checkpointing_keeps_the_fast_sampler_and_the_same_gradients(
    tiny_model_dir: Path, lora: bool
) -> None:
    """HF's checkpointing hooks the input embedding, which made the fast sampler fall back to HF's
    forward; rlvr's non-reentrant checkpointing needs no hook, and its gradients equal the plain
    model's (LoRA's too: its adapters' B made non-zero, so every adapter gets a gradient)."""
    settings = LoraSettings(r=4) if lora else None
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        policy = load_policy(
            str(tiny_model_dir), lora=settings, gradient_checkpointing=checkpointing
        )
        if checkpointing:
            assert decline_reason(policy.model) is None
        with torch.no_grad():
            for name, p in policy.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        policy.model.train()
        ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
        policy.model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
        grads.append({n: p.grad for n, p in policy.model.named_parameters() if p.requires_grad})
    plain, checkpointed = grads
    assert plain.keys() == checkpointed.keys() and plain
    for name in plain:
        assert checkpointed[name] is not None, name
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6)


def test_a_checkpointed_run_samples_on_the_fast_path_and_reports_decode_speed(
    tmp_path: Path,
) -> None:
    import json

    from rlvr.train.loop import train

    cfg = load_config(
        EXAMPLES / "tiny.yaml",
        [
            f"output_dir={tmp_path / 'run'}",
            "model.bf16=off",
            "model.gradient_checkpointing=true",
            "generator.decode=fast",
            "train.steps=2",
            "eval.at_start=false",
            "eval.at_end=false",
            "tracking.progress=false",
            "tracking.report_to=none",
        ],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = train(cfg, config_dir=EXAMPLES)
    warnings_seen = [str(w.message) for w in caught]
    assert not [w for w in warnings_seen if "falls back to HF's forward" in w], warnings_seen
    rows = [json.loads(x) for x in (summary.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    # 4 prompts x 8, up to 16 new tokens: up to 15 decode forwards after the prefill per step
    assert all(0 < r["perf/decode_steps"] <= 15 for r in steps)
    assert all(r["perf/decode_ms_per_step"] > 0 for r in steps)


def test_bf16_weights_are_read_in_place_by_the_fast_sampler() -> None:
    """A model whose matmul weights are bf16 already (model.precision: lean, fsdp's bf16 sampling
    copy) is decoded from its own tensors, not a second bf16 copy, with the logits of the fused
    copy made from an fp32 model holding the same values."""
    import copy

    from rlvr.models import TINY_ALIAS, matmul_weights_to_bf16
    from rlvr.rollout.fast_decode import DecodeWeights, StaticDecode

    fp32 = load_policy(TINY_ALIAS, device="cpu").model.eval().requires_grad_(False)
    bf16 = copy.deepcopy(fp32)
    matmul_weights_to_bf16(bf16)
    with torch.no_grad():  # the fp32 model gets the bf16-rounded values, so both hold the same
        pairs = zip(fp32.model.layers.modules(), bf16.model.layers.modules(), strict=True)
        for module, twin in pairs:
            if isinstance(module, torch.nn.Linear):  # not the head: it is the fp32 embedding
                module.weight.copy_(twin.weight.float())
    in_place = DecodeWeights.build(bf16, torch.bfloat16)
    fused = DecodeWeights.build(fp32, torch.bfloat16)
    layer, attn = in_place.layers[0], bf16.model.layers[0].self_attn
    assert layer.qkv[0].data_ptr() == attn.q_proj.weight.data_ptr()  # no copy
    assert len(fused.layers[0].qkv) == 1 and fused.layers[0].qkv[0].data_ptr() != 0
    ids = torch.tensor([[5, 6, 7, 8]])
    mask, positions = torch.ones(1, 4, dtype=torch.long), torch.arange(4)[None]
    a = StaticDecode(in_place, reserve=1).forward(ids, mask, positions)
    b = StaticDecode(fused, reserve=1).forward(ids, mask, positions)
    # the same bf16 products, three matmuls or one fused: equal here (AMD EPYC, avx512_bf16, both
    # RLVR_AUTO_BF16 ways); a kernel that blocks the fused matmul differently may differ in the
    # last bf16 bit of a product, hence the tolerance
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_the_fsdp_sampling_copy_fills_its_own_bf16_head(tiny_model_dir: Path) -> None:
    """fsdp samples from an unsharded copy refreshed after each update; in bf16 its head is a
    tensor of its own (untied from the fp32 embedding), which the refresh must fill too."""
    import copy

    from rlvr.models import matmul_weights_to_bf16
    from rlvr.scale.torch_dist import DistContext

    source = load_policy(str(tiny_model_dir)).model
    target = copy.deepcopy(source).eval().requires_grad_(False)
    matmul_weights_to_bf16(target)
    assert target.lm_head.weight is not target.model.embed_tokens.weight
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.5)  # an update
    context = DistContext(0, 1, 0, "fsdp", torch.device("cpu"))
    context.copy_full_weights(source, target)
    head = target.lm_head.weight
    assert head.dtype == torch.bfloat16
    assert torch.equal(head, source.model.embed_tokens.weight.detach().bfloat16())
    assert torch.equal(target.model.embed_tokens.weight, source.model.embed_tokens.weight)
