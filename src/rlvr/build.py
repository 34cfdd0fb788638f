"""Turn a config into the objects the loop uses: rubric, policy, generator, optimizer, scheduler."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from rlvr.config import ModelConfig, RewardSpec, RunConfig, bf16_sampling_copy, decode_path
from rlvr.devices import device_or_cpu as device_or_cpu  # re-exported: the trainer imports it here
from rlvr.models import LoraSettings, Policy, eos_token_ids, load_policy
from rlvr.optim import StochasticRoundingAdamW, adamw
from rlvr.precision import bf16_setting_on
from rlvr.rollout.engine import RolloutLimits
from rlvr.rollout.hf import HFGenerator
from rlvr.verifiers import RewardFunction, Rubric, resolve_reward_fn
from rlvr.verifiers.trl_style import detect_style


def build_rubric(specs: list[RewardSpec], base_dir: Path | None = None) -> Rubric:
    functions = []
    for spec in specs:
        fn = resolve_reward_fn(spec.fn, base_dir=base_dir)
        functions.append(
            RewardFunction(
                name=spec.name or spec.fn.rsplit(":", 1)[-1],
                fn=fn,
                weight=spec.weight,
                options=spec.options,
                style=detect_style(fn) if spec.style == "auto" else spec.style,
            )
        )
    return Rubric(functions)


def use_bf16(cfg: ModelConfig) -> bool:
    """Whether the trainer's matmuls run in bf16 for this model config (autocast; the lean mode's
    weights are bf16 themselves)."""
    return cfg.precision == "lean" or bf16_setting_on(cfg.bf16, cfg.name, cfg.device)


def weights_dtype(cfg: ModelConfig) -> torch.dtype:
    """The dtype the policy's (and its reference's) weights are loaded in: bf16 in the lean mode."""
    return torch.bfloat16 if cfg.precision == "lean" else torch.float32


def build_policy(cfg: RunConfig) -> Policy:
    lora = None
    if cfg.model.lora.enabled:
        lo = cfg.model.lora
        lora = LoraSettings(
            r=lo.r, alpha=lo.alpha, dropout=lo.dropout, target_modules=lo.target_modules
        )
    return load_policy(
        cfg.model.name,
        lora=lora,
        need_reference=cfg.objective.beta > 0,
        dtype=weights_dtype(cfg.model),
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        device=cfg.model.device,
        attn_implementation=cfg.model.attn_implementation,
    )


def decode_options(cfg: RunConfig) -> dict[str, Any]:
    """HFGenerator's `decode` and `decode_dtype` from `generator.decode` / `generator.decode_dtype`.
    Both `auto`s resolve through `rlvr.config.bf16_sampling_copy` (`bf16_sampler_on`: native bf16
    CPUs; the update's measured choice does not reach the sampler), so truncated IS and the
    mismatch monitor follow the same answer."""
    g = cfg.generator
    device = cfg.model.device
    copy_bf16 = bf16_sampling_copy(g.backend, g.decode, g.decode_dtype, cfg.model.bf16, device)
    return {
        "decode": decode_path(g.backend, g.decode, g.decode_dtype, cfg.model.bf16, device),
        "decode_dtype": torch.bfloat16 if copy_bf16 else torch.float32,
    }


def build_generator(policy: Policy, cfg: RunConfig) -> HFGenerator:
    return HFGenerator(
        policy.model,
        policy.tokenizer,
        eos_token_ids(policy.model, policy.tokenizer),
        seed=cfg.train.seed,
        # Never autocast while sampling: the demo did not learn from an autocast sampler (see
        # rlvr.train.precision_choice); a bf16 sampler is the fast path's weight copy.
        autocast_bf16=False,
        turn_cache=cfg.generator.turn_cache,
        turn_cache_mb=cfg.generator.turn_cache_mb,
        cuda_graphs=cfg.generator.cuda_graphs,
        **decode_options(cfg),
    )


def build_optimizer(policy: Policy, cfg: RunConfig) -> tuple[torch.optim.Optimizer, Any]:
    tc = cfg.train
    optimizer: torch.optim.Optimizer
    if cfg.model.precision == "lean":  # bf16 weights and moments, stochastically rounded
        optimizer = StochasticRoundingAdamW(
            policy.trainable_parameters(),
            lr=tc.learning_rate,
            betas=tc.adam_betas,
            weight_decay=tc.weight_decay,
            seed=tc.seed,
        )
    else:
        optimizer = adamw(
            policy.trainable_parameters(),
            lr=tc.learning_rate,
            betas=tc.adam_betas,
            weight_decay=tc.weight_decay,
        )

    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, LrSchedule(tc.lr_schedule, tc.warmup_steps, tc.steps)
    )
    return optimizer, scheduler


class LrSchedule:
    """The learning-rate factor of scheduler step k: a linear warm-up over `warmup_steps`, then
    constant, or linear / cosine to 0 at `horizon` steps.

    `horizon` starts at train.steps; a time-limited run moves it to the steps that fit in the limit
    (rlvr.train.loop.fit_schedule_to_time_limit), or the decay would span steps the run never
    takes and the lr would never anneal. An object rather than a closure so LambdaLR's state_dict
    carries the horizon into a checkpoint and a resume continues the same curve."""

    def __init__(self, kind: str, warmup_steps: int, horizon: int) -> None:
        self.kind, self.warmup_steps, self.horizon = kind, warmup_steps, horizon

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        progress = (step - self.warmup_steps) / max(1, self.horizon - self.warmup_steps)
        if self.kind == "linear":
            return max(0.0, 1.0 - progress)
        if self.kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0


def rollout_limits(cfg: RunConfig) -> RolloutLimits:
    r = cfg.rollout
    return RolloutLimits(
        max_turns=r.max_turns,
        # Never below one full turn: a single-turn run keeps sampling.max_new_tokens as its limit.
        max_total_tokens=max(r.max_total_tokens, cfg.sampling.max_new_tokens),
        max_observation_tokens=r.max_observation_tokens,
        observation_truncation=r.observation_truncation,
        tool_timeout_s=r.tool_timeout_s,
        max_tool_calls_per_turn=r.max_tool_calls_per_turn,
        env_workers=r.env_workers,
        tool_format=r.tool_format,
        history=r.history,
        history_turns=r.history_turns,
    )
