"""Turn a config into the objects the loop uses: rubric, policy, generator, optimizer, scheduler."""

from __future__ import annotations

import math
import os
from functools import cache
from pathlib import Path
from typing import Any

import torch

from rlvr.config import ModelConfig, RewardSpec, RunConfig, bf16_sampling_copy, decode_path
from rlvr.devices import resolve_device, supports_bf16
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
    """What `model.bf16: auto` resolves to where nothing was measured: `RLVR_AUTO_BF16=on|off` when
    set, else fp32 (`model.bf16: on` still forces bf16).

    The RL loop measures instead (rlvr.train.precision_choice: bf16 for the update only where it is
    faster on this host) and records the answer per model name (`record_auto_bf16`). Unmeasured,
    `auto` stays fp32: on an AVX2-only EPYC bf16 matmuls ran at 15 GFLOP/s against 120 in fp32, and on
    an Intel Xeon with avx512_bf16 autocast made the step slower (issue 18). `cpu_has_bf16()`
    reports the hardware.
    """
    return bool(forced_auto_bf16())


def forced_auto_bf16() -> bool | None:
    """RLVR_AUTO_BF16=on|off as a bool, None when unset."""
    forced = os.environ.get(AUTO_BF16_ENV, "").strip().lower()
    if forced in ("on", "off"):
        return forced == "on"
    if forced:
        raise ConfigError(f"{AUTO_BF16_ENV}={forced!r}: expected 'on' or 'off' (or unset)")
    return None


@cache
def cpu_has_bf16() -> bool:
    """Whether this CPU has native bf16 matmuls (avx512_bf16 / AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def device_or_cpu(setting: str) -> torch.device:
    """`model.device` resolved, or the CPU where it cannot be (a config read on a machine without
    the GPU it names: loading the model says so, in one line)."""
    try:
        return resolve_device(setting)
    except ConfigError:
        return torch.device("cpu")


def bf16_sampler_on(setting: str, device: str = "auto") -> bool:
    """Whether `generator.decode_dtype: auto` samples from a bf16 weight copy under a `model.bf16`
    setting: `on` yes, `off` no, `auto` where the device has native bf16 (a CUDA device of compute
    capability 8.0+, a CPU with avx512_bf16 / AMX: `cpu_has_bf16`), or as RLVR_AUTO_BF16=on|off says
    when set (so a test run on one CPU kind can take the other's path). A fixed rule, not the
    update's timing (rlvr.train.precision_choice): sampling reads weights, and a bf16 copy halves
    the bytes wherever bf16 matmuls are native (docs/performance.md)."""
    if setting != "auto":
        return setting == "on"
    forced = forced_auto_bf16()
    if forced is not None:
        return forced
    target = device_or_cpu(device)
    return supports_bf16(target) if target.type == "cuda" else cpu_has_bf16()


# `model.bf16: auto` as measured by the RL loop for a model name (rlvr.train.precision_choice).
_MEASURED_AUTO_BF16: dict[str, bool] = {}


def record_auto_bf16(model_name: str, bf16: bool) -> None:
    """Make `auto` mean `bf16` for `model_name` in this process (RLVR_AUTO_BF16 still wins)."""
    _MEASURED_AUTO_BF16[model_name] = bf16


def bf16_setting_on(setting: str, model_name: str | None = None, device: str = "auto") -> bool:
    """Whether a `bf16: auto | on | off` setting means bf16 autocast. `auto` is what was measured
    for `model_name` in this process when it was, else RLVR_AUTO_BF16 when set, else bf16 on a CUDA
    device with native bf16 (`model.device`), else fp32 (an unmeasured CPU: `native_bf16`)."""
    if setting != "auto":
        return setting == "on"
    if model_name in _MEASURED_AUTO_BF16 and not os.environ.get(AUTO_BF16_ENV, "").strip():
        return _MEASURED_AUTO_BF16[model_name]
    if forced_auto_bf16() is not None:
        return native_bf16()
    target = device_or_cpu(device)
    return supports_bf16(target) if target.type == "cuda" else False


def use_bf16(cfg: ModelConfig) -> bool:
    """Whether the trainer's matmuls run under bf16 autocast for this model config."""
    return bf16_setting_on(cfg.bf16, cfg.name, cfg.device)


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
