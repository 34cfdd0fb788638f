"""How closely two computations of the same model's log-probs agree at a given precision.

The sampler (HFGenerator's KV-cache decode, `rlvr serve`, vLLM) and the trainer (one forward over
prompt + completion, shared-prefix or fused head) compute the same log-probs by different code
paths: other matmul shapes, other reduction orders. Their gap on the same tokens,
`update/behaviour_logprob_abs_diff` (the mean over sampled tokens of |log p_trainer - log p_sampler|),
is rounding only when the weights are the same; anything larger is staleness (async rollouts, a
weight sync that did not happen) or a bug. This module says how large rounding can make it.

- fp32 on both sides: float32 keeps 24 significant bits (unit roundoff 2^-24 = 6e-8); a log-prob
  goes through ~100 accumulated matmuls and a log-softmax over the vocabulary, and different
  reduction orders leave ~1e-6 per token on the tiny test model, ~1e-5 on SmolLM2-135M.
  `FP32_LOGPROB_GAP` = 1e-4 leaves room for both.
- bf16 autocast on either side: bf16 keeps 8 significant bits (unit roundoff u = 2^-8 = 3.9e-3).
  Autocast rounds each matmul's inputs and its output to bf16, so every logit carries a relative
  error of a few u and a log-prob an absolute error of about u times the logits' scale. A sampler
  and trainer that both run bf16 round at different points (decode step by step vs. a full forward),
  so their errors do not cancel. `BF16_LOGPROB_GAP` = u (one bf16 rounding of a unit-scale logit)
  bounds the mean gap on the tiny test model (measured 1.3e-4 to 5.4e-4); on SmolLM2-135M, whose
  logits reach 20-30, docs/performance.md gives the measured gap.

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
