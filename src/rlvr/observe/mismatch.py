"""Sampler/trainer mismatch: the `sampler_mismatch` monitor and the weight-sync canary it reads.

Two measures of the same thing, the mean |sampler log-prob - trainer log-prob| per token on the same
tokens:
- `update/behaviour_logprob_abs_diff` (train/update.py): on the step's sampled tokens, as the update
  first scores them (before its optimizer step);
- `sync/canary_logprob_abs_diff` (rlvr.train.rollouts, after each weight sync to a server; scored
  by rlvr.train.canary, which needs the trainer's forward): a fixed short prompt (`CANARY_TEXT`) is
  sampled by the server at temperature 1 with a fixed seed, and the
  trainer scores the returned tokens. Temperature 1 makes vLLM's processed and raw log-probs the same
  numbers, and the fixed seed sits outside the run's request counter, so the run's own samples are
  unchanged.

A weight sync that silently did nothing, a server serving another model or revision, or a broken
kernel shows as a gap far above numerical noise. The threshold depends on precision (docs/monitors.md
has the measurements): fp32 on both sides agrees to ~4e-6 per token, bf16 on either side to ~0.03;
`mismatch_setup` below chooses it.

This module reads metrics and the config only (an observer, tests/test_layers.py); the canary's
scoring lives with the trainer in rlvr.train.canary.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlvr.config import RunConfig, bf16_sampling_copy
from rlvr.observe.monitors import Finding, History, Rule
from rlvr.precision import bf16_setting_on

CANARY_METRIC = "sync/canary_logprob_abs_diff"
BEHAVIOUR_METRIC = "update/behaviour_logprob_abs_diff"
# Plain text every tokenizer splits into a few dozen tokens; what matters is that it never changes.
CANARY_TEXT = "The quick brown fox jumps over the lazy dog. Water boils at 100 degrees, and 7 x 8 ="
CANARY_SEED = 20251129
CANARY_SAMPLES = 4  # x CANARY_TOKENS sampled tokens averaged: noise well below either threshold
CANARY_TOKENS = 8


@dataclass(frozen=True)
class MismatchSetup:
    """What the monitor reads and against which threshold, resolved from a run's config."""

    precision: str  # "fp32" | "bf16"
    threshold: float
    why: str  # why that precision, for the message
    keys: tuple[str, ...]  # metrics read, canary first
    not_read: str = ""  # why the behaviour metric is not read ("" when it is)


def mismatch_setup(cfg: RunConfig) -> MismatchSetup | None:
    """The monitor's settings for `cfg`; None when it is off.

    precision auto: fp32 only when both sides are known fp32 (model.bf16 off, and the sampler is
    in process without a bf16 weight copy to decode from (`bf16_sampling_copy`: decode fast with a
    bf16 decode_dtype), `rlvr serve`, which samples in fp32, or a vLLM launched with `--dtype
    float32` in generator.launch_args); a vLLM launched without it or a hand-started server is
    assumed to serve bf16 (vLLM's dtype auto takes the checkpoint's, bf16 for an fp32 one; set
    precision fp32 for an fp32 server at generator.url). The behaviour
    metric is not read with async rollouts (the sampler is one update behind by design) nor with
    top_p < 1 on a server other than rlvr serve (vLLM renormalises its log-probs over the nucleus,
    the trainer does not): the canary still is."""
    c = cfg.monitors.sampler_mismatch
    if not c.enabled:
        return None
    g = cfg.generator
    # What rlvr.build.use_bf16 answers for the trainer (this module sits below rlvr.build).
    trainer_bf16 = bf16_setting_on(cfg.model.bf16, cfg.model.name, cfg.model.device)
    rlvr_server = g.backend == "server" and g.launch == "rlvr"
    # The server's own dtype, as launched: a threshold for bf16 would hide an fp32 server's real
    # defects (a stale tied head after a sync: ~3e-3 per token, under 0.03, 400x fp32 noise).
    fp32_dtypes = ("float32", "float")  # vLLM's names for fp32
    served_dtype = g.served_dtype()  # launch_args win, as in argv
    vllm_launched = (g.backend == "server" and g.launch == "vllm") or g.backend == "vllm_colocate"
    vllm_fp32 = vllm_launched and served_dtype in fp32_dtypes
    # In process the sampler never autocasts (rlvr.build); a bf16 copy is asked below.
    sampler_bf16 = g.other_engine() and not (rlvr_server or vllm_fp32)
    if c.precision != "auto":
        precision, why = c.precision, "monitors.sampler_mismatch.precision"
    elif trainer_bf16:
        precision, why = "bf16", "the trainer runs under bf16 autocast (model.bf16)"
    elif bf16_sampling_copy(g.backend, g.decode, g.decode_dtype, cfg.model.bf16, cfg.model.device):
        precision = "bf16"
        why = "the sampler decodes from a bf16 copy of the weights (generator.decode_dtype)"
    elif sampler_bf16:
        precision = "bf16"
        why = (
            "a server other than rlvr serve, unless launched with --dtype float32 "
            "(generator.vllm.dtype), is assumed bf16"
        )
    else:
        precision, why = "fp32", "sampler and trainer both fp32"
    threshold = c.max_abs_diff_bf16 if precision == "bf16" else c.max_abs_diff_fp32
    not_read = ""
    if cfg.rollout.async_rollouts:
        not_read = "async rollouts sample from a copy up to max_staleness updates behind"
    elif g.other_engine() and cfg.sampling.top_p < 1.0 and not rlvr_server:
        not_read = "vLLM renormalises log-probs over the top-p nucleus"
    keys = (CANARY_METRIC,) if not_read else (CANARY_METRIC, BEHAVIOUR_METRIC)
    return MismatchSetup(precision, threshold, why, keys, not_read)


def sampler_mismatch(history: History, s: MismatchSetup) -> Finding | None:
    """This step's canary gap or behaviour gap above `s.threshold`."""
    if not history:
        return None
    row = history[-1]
    over = [(key, row[key]) for key in s.keys if key in row and row[key] > s.threshold]
    if not over:
        return None
    key, value = over[0]
    on = "a fixed canary after the weight sync" if key == CANARY_METRIC else "this step's samples"
    evidence = {k: row[k] for k in s.keys if k in row}
    return Finding(
        f"sampler and trainer log-probs differ by {value:.3g} per token on {on} ({key}), above "
        f"the {s.precision} threshold {s.threshold:g} ({s.why}): a weight sync that did not take, "
        "another model on the server, or broken numerics; the update learns from samples of "
        "other weights",
        {**evidence, "threshold": s.threshold},
    )


def mismatch_rule(cfg: RunConfig) -> Rule | None:
    """The monitor as a rule for `Monitors(extra=...)`; None when it is off."""
    s = mismatch_setup(cfg)
    if s is None:
        return None
    action = cfg.monitors.sampler_mismatch.action
    return Rule("sampler_mismatch", action, lambda h: sampler_mismatch(h, s), s.keys)
