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
"""

from __future__ import annotations

FP32_LOGPROB_GAP = 1e-4
BF16_LOGPROB_GAP = 2.0**-8


def logprob_gap_tolerance(bf16: bool) -> float:
    """The mean |log p_trainer - log p_sampler| that rounding alone can explain at this precision
    (bf16: either side computes under bf16 autocast)."""
    return BF16_LOGPROB_GAP if bf16 else FP32_LOGPROB_GAP
