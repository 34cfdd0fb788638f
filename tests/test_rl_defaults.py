"""The field's defaults for RL after a warm-up (issue 62): lr 1e-6 for full fine-tuning and LoRA's own
1e-5, no optimizer step on a step with no signal, an lr schedule whose horizon is what the time
limit lets the run reach, and TRL's `scale_rewards` spellings (group / batch / none)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlvr.algorithms import grpo_advantages
from rlvr.build import LrSchedule, build_optimizer
from rlvr.config import load_config
from rlvr.errors import ConfigError
from rlvr.models import load_policy
from rlvr.optim import adamw
from rlvr.records import Span, Trajectory
from rlvr.train.loop import fit_schedule_to_time_limit
from rlvr.train.update import policy_update


# ------------------------------------------------------------------------------ learning rate
def test_full_fine_tuning_defaults_to_trl_and_verl_lr_and_lora_to_ten_times_it() -> None:
    assert load_config(None, []).train.learning_rate == 1e-6
    assert load_config(None, ["model.lora.enabled=true"]).train.learning_rate == 1e-5
    # A value the user gives wins either way.
    lora = load_config(None, ["model.lora.enabled=true", "train.learning_rate=3e-4"])
    assert lora.train.learning_rate == 3e-4
    assert load_config(None, ["train.learning_rate=2e-6"]).train.learning_rate == 2e-6


# ------------------------------------------------------------------------------ no signal, no step
def _rows() -> list[Trajectory]:
    out = []
    for ids in ([40, 41, 42], [50, 51, 52]):
        tokens = [5, 17, 9, *ids]
        mask = [0, 0, 0, 1, 1, 1]
        out.append(
            Trajectory(
                task_id="t", token_ids=tuple(tokens), policy_mask=tuple(mask),
                logprobs=tuple(-1.0 * m for m in mask), prompt_length=3, completion_text="",
                finish_reason="stop", turns=(Span(3, 6),), reward=1.0, turn_rewards=(1.0,),
            )
        )  # fmt: skip
    return out


def _update(tiny_model_dir: Path, advantages: list[list[float]], *extra: str) -> tuple:
    cfg = load_config(None, [f"model.name={tiny_model_dir}", "model.bf16='off'", *extra])
    policy = load_policy(str(tiny_model_dir), need_reference=cfg.objective.beta > 0)
    opt = adamw(policy.trainable_parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0)
    # One real step first, so Adam has momentum that a zero-gradient step would still apply.
    policy_update(policy, opt, _rows(), [[1.0] * 3, [-1.0] * 3], cfg)
    before = [p.detach().clone() for p in policy.trainable_parameters()]
    metrics = policy_update(policy, opt, _rows(), advantages, cfg)
    moved = any(
        not torch.equal(a, b) for a, b in zip(policy.trainable_parameters(), before, strict=True)
    )
    return metrics, moved


def test_a_step_with_no_signal_takes_no_optimizer_step(tiny_model_dir: Path) -> None:
    metrics, moved = _update(tiny_model_dir, [[0.0] * 3, [0.0] * 3])
    assert metrics["update/no_signal"] == 1.0 and not moved
    # Opting back in: Adam's momentum moves the weights on a zero gradient.
    metrics, moved = _update(
        tiny_model_dir, [[0.0] * 3, [0.0] * 3], "train.step_without_signal=true"
    )
    assert metrics.get("update/no_signal", 0.0) == 0.0 and moved
    # A KL term has a gradient of its own: that step is taken.
    metrics, moved = _update(tiny_model_dir, [[0.0] * 3, [0.0] * 3], "objective.beta=0.1")
    assert metrics["update/no_signal"] == 0.0 and moved
    # Any signal: a step.
    metrics, moved = _update(tiny_model_dir, [[0.0] * 3, [0.5] * 3])
    assert metrics["update/no_signal"] == 0.0 and moved


# ------------------------------------------------------------------------------ schedule horizon
def test_lr_schedule_by_hand() -> None:
    cosine = LrSchedule("cosine", warmup_steps=2, horizon=10)
    assert [cosine(0), cosine(1)] == pytest.approx([1 / 3, 2 / 3])
    assert cosine(2) == 1.0
    assert cosine(6) == pytest.approx(0.5)  # halfway through 8 decay steps: (1 + cos(pi/2)) / 2
    cosine.horizon = 6  # a time limit that fits 6 steps: the same curve over 4 decay steps
    assert cosine(4) == pytest.approx(0.5)
    assert cosine(6) == 0.0
    linear = LrSchedule("linear", 0, 4)
    assert [linear(k) for k in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert LrSchedule("constant", 0, 4)(3) == 1.0


def _run(schedule: str, steps: int, limit: float | None, elapsed: float, done: int) -> Any:
    cfg = load_config(
        None,
        [f"train.lr_schedule={schedule}", f"train.steps={steps}"]
        + ([f"train.time_limit_minutes={limit}"] if limit else []),
    )
    param = torch.nn.Parameter(torch.zeros(1))
    policy = SimpleNamespace(trainable_parameters=lambda: [param])
    _, scheduler = build_optimizer(policy, cfg)  # type: ignore[arg-type]
    import time

    return SimpleNamespace(
        cfg=cfg,
        scheduler=scheduler,
        start_step=0,
        first_step_started=time.time() - elapsed,
        dist=None,
    ), done


def test_time_limit_sets_the_horizon_to_the_steps_that_fit() -> None:
    # 10-minute limit, 3 steps done in 120 s (40 s a step): 480 s left fit ceil(12) = 12 more.
    run, step = _run("cosine", 400, 10.0, 120.0, 3)
    fit_schedule_to_time_limit(run, step)
    assert run.scheduler.lr_lambdas[0].horizon == 15
    # Never past train.steps, never before the step already taken.
    run, step = _run("cosine", 8, 10.0, 120.0, 3)
    fit_schedule_to_time_limit(run, step)
    assert run.scheduler.lr_lambdas[0].horizon == 8
    run, step = _run("linear", 400, 1.0, 120.0, 3)  # already past the limit
    fit_schedule_to_time_limit(run, step)
    assert run.scheduler.lr_lambdas[0].horizon == 3
    # No limit, or a constant lr: train.steps stays the horizon.
    for schedule, limit in (("cosine", None), ("constant", 10.0)):
        run, step = _run(schedule, 400, limit, 120.0, 3)
        fit_schedule_to_time_limit(run, step)
        assert run.scheduler.lr_lambdas[0].horizon == 400


def test_the_horizon_travels_in_the_scheduler_state() -> None:
    run, step = _run("cosine", 400, 10.0, 120.0, 3)
    fit_schedule_to_time_limit(run, step)
    state = run.scheduler.state_dict()
    fresh, _ = _run("cosine", 400, 10.0, 0.0, 0)
    fresh.scheduler.load_state_dict(state)
    assert fresh.scheduler.lr_lambdas[0].horizon == 15


# ------------------------------------------------------------------------------ scale_rewards
def test_scale_rewards_spellings_and_the_batch_std_by_hand() -> None:
    assert load_config(None, ["objective.scale_rewards=true"]).objective.scale_rewards == "group"
    assert load_config(None, ["objective.scale_rewards=false"]).objective.scale_rewards == "none"
    assert load_config(None, []).objective.scale_rewards == "group"
    with pytest.raises(ConfigError, match="batch"):
        load_config(None, ["objective.scale_rewards=batch", "objective.credit=turn"])
    # Groups [1, 0] and [0.5, 0.5]: centred [0.5, -0.5, 0, 0]. Batch of [1, 0, 0.5, 0.5]: mean 0.5,
    # Bessel std sqrt((0.25 + 0.25 + 0 + 0) / 3) = 0.4082 -> A = [1.2244, -1.2244, 0, 0].
    rewards, valid = torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.ones(4, dtype=torch.bool)
    batch = grpo_advantages(rewards, valid, 2, scale_rewards="batch")
    s = math.sqrt(0.5 / 3)
    assert batch.tolist() == pytest.approx([0.5 / (s + 1e-4), -0.5 / (s + 1e-4), 0.0, 0.0])
    # group: std of [1, 0] = 0.7071 -> +-0.7070; none: +-0.5.
    assert grpo_advantages(rewards, valid, 2, scale_rewards="group")[0] == pytest.approx(
        0.5 / (math.sqrt(0.5) + 1e-4)
    )
    assert grpo_advantages(rewards, valid, 2, scale_rewards="none").tolist() == [0.5, -0.5, 0, 0]
    assert grpo_advantages(rewards, valid, 2, scale_rewards=False).tolist() == [0.5, -0.5, 0, 0]
    with pytest.raises(ValueError, match="group, batch or none"):
        grpo_advantages(rewards, valid, 2, scale_rewards="std")


# ------------------------------------------------------------------------------ per-step signal
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("lean", [False, True])
def test_update_norm_from_adam_state_equals_the_weights_moved(
    weight_decay: float, lean: bool
) -> None:
    from rlvr.optim import StochasticRoundingAdamW, adam_step_norms

    torch.manual_seed(0)
    dtype = torch.bfloat16 if lean else torch.float32
    # Weights ~0.01, whose bf16 spacing (~6e-5) is small beside the ~1e-2 steps: the lean
    # optimizer's stochastic rounding then adds little to the distance moved.
    params = [
        torch.nn.Parameter((0.01 * torch.randn(300)).to(dtype)),
        torch.nn.Parameter((0.01 * torch.randn(7, 5)).to(dtype)),
    ]
    frozen = torch.nn.Parameter(torch.randn(4, dtype=dtype))  # never stepped: weight norm only
    if lean:
        opt: torch.optim.Optimizer = StochasticRoundingAdamW(
            [*params, frozen], lr=1e-2, betas=(0.9, 0.99), weight_decay=weight_decay, seed=0
        )
    else:
        opt = adamw([*params, frozen], lr=1e-2, betas=(0.9, 0.99), weight_decay=weight_decay)
    for _ in range(3):
        before = [p.detach().float().clone() for p in params]
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        moved = math.sqrt(
            sum(
                float((p.detach().float() - b).square().sum())
                for p, b in zip(params, before, strict=True)
            )
        )
        update_sq, weight_sq = adam_step_norms(opt)
        assert math.sqrt(weight_sq) == pytest.approx(
            math.sqrt(sum(float(p.detach().float().square().sum()) for p in [*params, frozen])),
            rel=1e-5,
        )
        # bf16 weights and moments are rounded after the step: agreement to ~1%, not 1e-4.
        assert math.sqrt(update_sq) == pytest.approx(moved, rel=3e-2 if lean else 1e-4)
        opt.zero_grad(set_to_none=True)


def test_signal_metrics_by_hand() -> None:
    from rlvr.observe.metrics import signal_metrics
    from rlvr.records import Group, Task

    def t(reward: float, success: float) -> Trajectory:
        return Trajectory(
            task_id="t", token_ids=(1, 2), policy_mask=(0, 1), logprobs=(0.0, -1.0),
            prompt_length=1, completion_text="", finish_reason="stop", reward=reward,
            rewards={"success": success},
        )  # fmt: skip

    groups = [
        Group(Task("a", ()), (t(1.1, 1.0), t(0.1, 0.0))),  # success contrast
        Group(Task("b", ()), (t(0.1, 0.0), t(0.0, 0.0))),  # reward contrast, no success
        Group(Task("c", ()), (t(1.1, 1.0), t(1.1, 1.0))),  # all equal
    ]
    out = signal_metrics(groups, lambda x: x.rewards["success"] >= 1.0, 2)
    assert out == {
        "signal/episodes": 6.0,
        "signal/successes": 3.0,
        "signal/groups": 3.0,
        "signal/groups_reward_contrast": 2.0,
        "signal/groups_success_contrast": 1.0,
    }
