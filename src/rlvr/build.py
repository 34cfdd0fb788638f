"""Turn a config into the objects the loop uses: rubric, policy, generator, optimizer, scheduler."""

from __future__ import annotations

import math
import os
from functools import cache
from pathlib import Path
from typing import Any

import torch

from rlvr.config import ModelConfig, RewardSpec, RunConfig
from rlvr.errors import ConfigError
from rlvr.models import LoraSettings, Policy, eos_token_ids, load_policy
from rlvr.optim import adamw
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


# `model.bf16: auto` asks the CPU; this environment variable answers instead ("on" or "off"), so a
# test run on one CPU kind can take the path `auto` takes on the other (make test runs the
# precision-sensitive tests both ways: an AVX2 host cannot land a change that breaks bf16 hosts).
AUTO_BF16_ENV = "RLVR_AUTO_BF16"


def native_bf16() -> bool:
    """Whether `model.bf16: auto` turns bf16 autocast on here: off on every CPU unless
    `RLVR_AUTO_BF16=on|off` says otherwise (`model.bf16: on` still forces it).

    Measured: on an AVX2-only EPYC bf16 matmuls ran at 15 GFLOP/s against 120 in fp32; on CPUs with
    native bf16 (avx512_bf16) autocast made the step slower than fp32 (issue 18), and the demo
    (examples/quickstart.yaml, seed 0) barely learned under it: train reward 0.03-0.2 over its first
    9 steps against 0.0 -> 0.69 in fp32, held-out 9.5% -> 24% after 30 steps against ~60% in fp32
    (2-core AMD EPYC with avx512_bf16; docs/performance.md). `cpu_has_bf16()` still reports the
    hardware.
    """
    forced = os.environ.get(AUTO_BF16_ENV, "").strip().lower()
    if forced in ("on", "off"):
        return forced == "on"
    if forced:
        raise ConfigError(f"{AUTO_BF16_ENV}={forced!r}: expected 'on' or 'off' (or unset)")
    return False


@cache
def cpu_has_bf16() -> bool:
    """Whether this CPU has native bf16 matmuls (avx512_bf16 / AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_setting_on(setting: str) -> bool:
    """Whether a `bf16: auto | on | off` setting means bf16 autocast on this host."""
    return setting == "on" or (setting == "auto" and native_bf16())


def use_bf16(cfg: ModelConfig) -> bool:
    return bf16_setting_on(cfg.bf16)


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
        gradient_checkpointing=cfg.model.gradient_checkpointing,
    )


def decode_options(cfg: RunConfig) -> dict[str, Any]:
    """HFGenerator's `decode` and `decode_dtype` from `generator.decode` / `generator.decode_dtype`
    (dtype auto: None, which HFGenerator resolves as its bf16 autocast setting). Whether that is a
    bf16 copy of the weights: `rlvr.config.bf16_sampling_copy` (truncated IS and the mismatch monitor
    follow it)."""
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    return {
        "decode": cfg.generator.decode,
        "decode_dtype": dtypes.get(cfg.generator.decode_dtype),
    }


def build_generator(policy: Policy, cfg: RunConfig) -> HFGenerator:
    return HFGenerator(
        policy.model,
        policy.tokenizer,
        eos_token_ids(policy.model, policy.tokenizer),
        seed=cfg.train.seed,
        autocast_bf16=use_bf16(cfg.model),
        turn_cache=cfg.generator.turn_cache,
        turn_cache_mb=cfg.generator.turn_cache_mb,
        **decode_options(cfg),
    )


def build_optimizer(policy: Policy, cfg: RunConfig) -> tuple[torch.optim.Optimizer, Any]:
    tc = cfg.train
    optimizer = adamw(
        policy.trainable_parameters(),
        lr=tc.learning_rate,
        betas=tc.adam_betas,
        weight_decay=tc.weight_decay,
    )

    def lr_factor(step: int) -> float:
        if step < tc.warmup_steps:
            return (step + 1) / (tc.warmup_steps + 1)
        progress = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
        if tc.lr_schedule == "linear":
            return max(0.0, 1.0 - progress)
        if tc.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    return optimizer, scheduler


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
    )
