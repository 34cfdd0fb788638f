"""How closely two computations of the same model's log-probs agree at a given precision.

The sampler (HFGenerator's KV-cache decode, `rlvr serve`, vLLM) and the trainer (one forward over
prompt + completion, shared-prefix or fused head) compute the same log-probs by different code
paths: other matmul shapes, other reduction orders. Their gap on the same tokens,
`update/behaviour_logprob_abs_diff` (the mean over sampled tokens of |log p_trainer - log p_sampler|),
is rounding only when the weights are the same; anything larger is staleness (async rollouts, a
weight sync that did not happen) or a bug. This module says how large rounding can make it.

- fp32 on both sides: float32 keeps 24 significant bits and only the reduction order differs;
  measured ~1e-7 on the tiny test model and 2.4e-6 (max 3e-5) on SmolLM2-135M.
  `FP32_LOGPROB_GAP` = 1e-4.
- bf16 autocast on either side: bf16 keeps 8 significant bits (unit roundoff u = 2^-8 = 3.9e-3).
  Autocast rounds each matmul's inputs and its output to bf16, so a logit carries an error of a
  few u times its size, and so does the log-prob. A sampler and a trainer that both run bf16 round
  at different points (decode step by step vs. a full forward), so their errors do not cancel.
  The gap therefore scales with the model's logits: 2e-4 to 6e-4 on the tiny test model (logit std
  0.2), under `BF16_LOGPROB_GAP` = u; 3e-2 mean (p99 0.15) on SmolLM2-135M, whose largest logits reach
  25-40, std 8 (benchmarks/precision_gap.py, docs/performance.md).

The tests use these as their tolerances (tests/test_scale_loop.py); the mismatch monitor
(docs/monitors.md) alarms at a multiple of them.

Below them: what `model.bf16: auto` and `generator.decode_dtype: auto` mean on this host. The rule
lives here, at the bottom of the layers, so that rlvr.config's validators (the truncated-IS default)
and the mismatch monitor ask it without importing rlvr.build, which imports them.
"""

from __future__ import annotations

import os

from rlvr import devices
from rlvr.errors import ConfigError

FP32_LOGPROB_GAP = 1e-4
BF16_LOGPROB_GAP = 2.0**-8


def logprob_gap_tolerance(bf16: bool) -> float:
    """The mean |log p_trainer - log p_sampler| that rounding alone can explain at this precision
    (bf16: either side computes under bf16 autocast)."""
    return BF16_LOGPROB_GAP if bf16 else FP32_LOGPROB_GAP


# ------------------------------------------------------- which precision `model.bf16: auto` means
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
    an Intel Xeon with avx512_bf16 autocast made the step slower (issue 18).
    `rlvr.devices.cpu_has_bf16()` reports the hardware.
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
    target = devices.device_or_cpu(device)
    return devices.supports_bf16(target) if target.type == "cuda" else devices.cpu_has_bf16()


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
    target = devices.device_or_cpu(device)
    return devices.supports_bf16(target) if target.type == "cuda" else False
