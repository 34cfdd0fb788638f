"""Policy losses, KL estimators and loss aggregation: pure tensor functions, registered by name.

Per-token tensors are (B, T) over the *target* positions: `logprobs_B_T[b, t]` is the log-prob of token
t+1 of row b given tokens <= t. `mask_B_T` is 1 exactly where the policy sampled that token (prompt,
padding and tool observations are 0), so nothing outside it can receive gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

POLICY_LOSSES: dict[str, Callable[..., PolicyLossOutput]] = {}
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class PolicyLossOutput:
    """Per-token loss (B, T) and per-token indicator tensors (B, T) for the clip metrics."""

    loss_B_T: torch.Tensor
    clipped_low_B_T: torch.Tensor
    clipped_high_B_T: torch.Tensor


def register_policy_loss(
    name: str,
) -> Callable[[Callable[..., PolicyLossOutput]], Callable[..., PolicyLossOutput]]:
    def wrap(fn: Callable[..., PolicyLossOutput]) -> Callable[..., PolicyLossOutput]:
        POLICY_LOSSES[name] = fn
        return fn

    return wrap


@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    advantages_B_T: torch.Tensor,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate per token (Schulman et al. 2017), with DAPO's decoupled upper bound.

        ratio = exp(logp - logp_old)
        loss  = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)

    `epsilon_high` defaults to `epsilon` (symmetric PPO); DAPO (Yu et al. 2025) raises it to 0.28 so
    low-probability tokens with positive advantage can grow ("clip-higher"). With on-policy data
    (one update per batch) ratio == 1 and this is exactly the REINFORCE gradient -A * grad(logp).
    A token is "clipped low" when ratio < 1 - epsilon with A < 0 and "clipped high" when
    ratio > 1 + epsilon_high with A > 0: there the gradient is zero.
    """
    high = epsilon if epsilon_high is None else epsilon_high
    ratio_B_T = torch.exp(logprobs_B_T - old_logprobs_B_T)
    unclipped_B_T = ratio_B_T * advantages_B_T
    clipped_B_T = torch.clamp(ratio_B_T, 1.0 - epsilon, 1.0 + high) * advantages_B_T
    loss_B_T = -torch.min(unclipped_B_T, clipped_B_T)
    with torch.no_grad():
        clipped_low_B_T = ((ratio_B_T < 1.0 - epsilon) & (advantages_B_T < 0)).float()
        clipped_high_B_T = ((ratio_B_T > 1.0 + high) & (advantages_B_T > 0)).float()
    return PolicyLossOutput(loss_B_T, clipped_low_B_T, clipped_high_B_T)


def _register_kl(
    name: str,
) -> Callable[
    [Callable[[torch.Tensor, torch.Tensor], torch.Tensor]],
    Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
]:
    def wrap(
        fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        KL_ESTIMATORS[name] = fn
        return fn

    return wrap


# Schulman's estimators of KL(pi || ref) from samples of pi ("Approximating KL divergence", 2020).
# With log_r = logp_ref - logp for a token sampled from pi:
@_register_kl("k1")
def kl_k1(logprobs_B_T: torch.Tensor, ref_logprobs_B_T: torch.Tensor) -> torch.Tensor:
    """k1 = -log_r: unbiased, high variance, can be negative per token."""
    return logprobs_B_T - ref_logprobs_B_T


@_register_kl("k2")
def kl_k2(logprobs_B_T: torch.Tensor, ref_logprobs_B_T: torch.Tensor) -> torch.Tensor:
    """k2 = (log_r)^2 / 2: biased, low variance, >= 0; its gradient is that of the true KL to first order."""
    return 0.5 * (ref_logprobs_B_T - logprobs_B_T) ** 2


@_register_kl("k3")
def kl_k3(logprobs_B_T: torch.Tensor, ref_logprobs_B_T: torch.Tensor) -> torch.Tensor:
    """k3 = exp(log_r) - 1 - log_r: unbiased, >= 0, low variance; GRPO's choice (DeepSeekMath eq. 4)."""
    log_r = ref_logprobs_B_T - logprobs_B_T
    return torch.exp(log_r) - 1.0 - log_r


def aggregate(
    loss_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    mode: str,
    *,
    total_tokens: float | None = None,
    total_sequences: float | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    - "token-mean": sum over all policy tokens / number of policy tokens (DAPO; long answers weigh more).
    - "seq-mean-token-mean": mean per sequence, then over sequences (the original GRPO objective).
    - "seq-mean-token-sum-norm": token sum / (sequences * norm_length), a constant normaliser with no
      length bias (Dr.GRPO, Liu et al. 2025); `norm_length` defaults to T.

    `total_tokens` / `total_sequences` are the counts over the *whole* batch when this is one of several
    micro-batches, so that accumulating micro-batch losses gives exactly the full-batch loss.
    """
    mask = mask_B_T.to(loss_B_T.dtype)
    if mode == "token-mean":
        denom = total_tokens if total_tokens is not None else mask.sum().clamp(min=1.0)
        return (loss_B_T * mask).sum() / denom
    n_seq = total_sequences if total_sequences is not None else float(loss_B_T.shape[0])
    if mode == "seq-mean-token-mean":
        per_seq_B = (loss_B_T * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return per_seq_B.sum() / n_seq
    if mode == "seq-mean-token-sum-norm":
        length = norm_length if norm_length is not None else float(loss_B_T.shape[1])
        return (loss_B_T * mask).sum() / (n_seq * length)
    raise ValueError(f"unknown loss aggregation {mode!r}; one of {', '.join(AGGREGATIONS)}")
