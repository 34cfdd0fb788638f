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
