"""`model.precision: lean`: bf16 weights and AdamW moments, every write stochastically rounded
(rlvr.optim.StochasticRoundingAdamW), and a run that trains in it end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlvr.config import load_config
from rlvr.errors import ConfigError
from rlvr.optim import StochasticRoundingAdamW, round_stochastically_

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour() -> None:
    # 1 + 2^-10 lies a quarter of the way from 1.0 to the next bf16 value up, 1 + 2^-7:
    # rounded to nearest it is always 1.0; at random, 1 + 2^-7 a quarter of the time.
    value = torch.full((1 << 20,), 1.0 + 2**-9, dtype=torch.float32)
    out = torch.empty_like(value, dtype=torch.bfloat16)
    round_stochastically_(out, value, torch.Generator().manual_seed(0))
    seen = set(out.float().unique().tolist())
    assert seen == {1.0, 1.0 + 2**-7}
    share_up = float((out.float() > 1.0).double().mean())
    assert abs(share_up - 0.25) < 0.005  # sd of the share: sqrt(.25 * .75 / 2^20) = 0.0004
    # negative values: the magnitude is rounded the same way
    round_stochastically_(out, -value, torch.Generator().manual_seed(1))
    assert abs(float(out.double().mean()) + (1.0 + 2**-9)) < 1e-4
    # a value bf16 holds exactly is kept exactly
    exact = torch.tensor([0.5, -3.0, 0.0, 1024.0])
    kept = torch.empty(4, dtype=torch.bfloat16)
    round_stochastically_(kept, exact, torch.Generator().manual_seed(2))
    assert kept.float().tolist() == exact.tolist()


def _descend(optimizer_of: object, dtype: torch.dtype, steps: int = 100) -> torch.Tensor:
    """`steps` AdamW steps at lr 1e-6 with a constant gradient of 1: Adam moves each weight by
    lr * m_hat / sqrt(v_hat) = 1e-6 a step, 1e-6 of a weight of 1.0, 1e-4 in all."""
    weight = torch.nn.Parameter(torch.ones(1 << 20, dtype=dtype))
    optimizer = optimizer_of([weight])  # type: ignore[operator]
    for _ in range(steps):
        weight.grad = torch.ones_like(weight)
        optimizer.step()
    return weight.detach().double()


def test_updates_of_1e_6_of_a_weight_are_not_lost_over_100_steps() -> None:
    exact = _descend(lambda p: torch.optim.AdamW(p, lr=1e-6, weight_decay=0.0), torch.float32)
    # fp32 masters, the reference: off by fp32's own rounding (6e-8 a step near 1.0)
    exact_moved = 1.0 - float(exact.mean())
    assert abs(exact_moved - 1e-4) < 3e-6
    # bf16 weights rounded to nearest: each 1e-6 step is below half a bf16 step (2^-9 below
    # 1.0), so it is rounded away every time: the weights never move.
    nearest = _descend(lambda p: torch.optim.AdamW(p, lr=1e-6, weight_decay=0.0), torch.bfloat16)
    assert float((nearest - 1.0).abs().max()) == 0.0
    lean = _descend(lambda p: StochasticRoundingAdamW(p, lr=1e-6, seed=0), torch.bfloat16)
    moved = 1.0 - float(lean.mean())
    # Each weight moves by whole bf16 steps (2^-8 below 1.0) with the probabilities that make the
    # mean move 1e-4; over 2^20 weights the mean's sd is ~6e-7 (0.6%): 5% is 8 sd.
    assert abs(moved - exact_moved) < 5e-6, (moved, exact_moved)


def test_three_steps_match_fp32_adamw_within_bf16_rounding() -> None:
    torch.manual_seed(0)
    # the same bf16 start and bf16 gradients for both: only the optimizer's storage differs
    start = (torch.randn(1 << 16) * 0.02).to(torch.bfloat16)
    grads = [torch.randn(1 << 16).to(torch.bfloat16) for _ in range(3)]
    fp32 = torch.nn.Parameter(start.float())
    lean = torch.nn.Parameter(start.clone())
    ref = torch.optim.AdamW([fp32], lr=1e-3, weight_decay=0.1)
    ours = StochasticRoundingAdamW([lean], lr=1e-3, weight_decay=0.1, seed=0)
    for g in grads:
        fp32.grad, lean.grad = g.float(), g.clone()
        ref.step()
        ours.step()
    gap = (lean.detach().float() - fp32.detach()).abs()
    # Each step the weight is rounded (under one bf16 step, 2^-7 of it) and so are the moments,
    # whose rounding moves Adam's step (~lr) by up to ~2^-7 of itself: three steps of both.
    bound = 3 * (fp32.detach().abs() * 2**-7 + 1e-3 * 2**-7)
    assert bool((gap <= bound).all()), float((gap / bound).max())
    # and unbiased: the mean gap is far below one rounding
    assert abs(float((lean.detach().float() - fp32.detach()).mean())) < 1e-6


def test_state_round_trips_and_non_bf16_parameters_are_refused() -> None:
    weight = torch.nn.Parameter(torch.randn(64).to(torch.bfloat16))
    optimizer = StochasticRoundingAdamW([weight], lr=1e-2, seed=3)
    weight.grad = torch.randn(64).to(torch.bfloat16)
    optimizer.step()
    saved = optimizer.state_dict()
    other = StochasticRoundingAdamW([weight], lr=1e-2, seed=3)
    other.load_state_dict(saved)
    state = other.state[weight]
    assert state["step"] == 1 and state["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(state["exp_avg_sq"], optimizer.state[weight]["exp_avg_sq"])
    with pytest.raises(ValueError, match="not bf16"):
        StochasticRoundingAdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (["model.lora.enabled=true"], "full fine-tuning"),
        (["model.bf16=off"], "model.bf16: off contradicts"),
        (["distributed.strategy=fsdp"], "one device"),
    ],
)
def test_lean_refuses_what_it_cannot_do(sets: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        load_config(EXAMPLES / "tiny.yaml", ["model.precision=lean", *sets])


@pytest.mark.precision  # the sampler's path (bf16 copy or HF's forward) follows the CPU's bf16
def test_a_lean_run_trains_bf16_weights(tmp_path: Path) -> None:
    from rlvr.models import TINY_ALIAS, load_policy
    from rlvr.train.loop import train

    base = load_policy(TINY_ALIAS, device="cpu").model
    cfg = load_config(
        EXAMPLES / "tiny.yaml",
        [
            f"output_dir={tmp_path / 'run'}",
            "model.precision=lean",
            "objective.beta=0.04",  # the reference is bf16 too
            "train.steps=3",
            "train.learning_rate=1e-3",
            "eval.at_start=false",
            "eval.at_end=false",
            "tracking.progress=false",
            "tracking.report_to=none",
            "train.skip_zero_advantage_rows=false",
        ],
    )
    summary = train(cfg, config_dir=EXAMPLES)
    rows = [json.loads(x) for x in (summary.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 3 and all(r["perf/precision"] == 16 for r in steps)
    assert all(abs(r["loss"]) < 1e6 and r["kl"] == r["kl"] for r in steps)  # finite, KL scored
    from safetensors.torch import load_file

    checkpoint = sorted((summary.run_dir / "checkpoints").glob("step-*"))[-1] / "model"
    saved = load_file(str(next(checkpoint.glob("*.safetensors"))))
    assert {t.dtype for t in saved.values() if t.is_floating_point()} == {torch.bfloat16}
    trained = saved
    changed = [
        n for n, p in base.named_parameters() if n in trained and not torch.equal(
            trained[n].float(), p.detach().to(torch.bfloat16).float()
        )
    ]  # fmt: skip
    assert len(changed) >= len(trained) // 2, changed  # the update reached most tensors
