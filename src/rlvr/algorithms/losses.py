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
    mask_B_T: torch.Tensor | None = None,
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
    ratio > 1 + epsilon_high with A > 0: there the gradient is zero. `mask_B_T` is not needed (the
    loss is per token); it is accepted so every policy loss has one signature.
    """
    del mask_B_T
    high = epsilon if epsilon_high is None else epsilon_high
    ratio_B_T = torch.exp(logprobs_B_T - old_logprobs_B_T)
    unclipped_B_T = ratio_B_T * advantages_B_T
    clipped_B_T = torch.clamp(ratio_B_T, 1.0 - epsilon, 1.0 + high) * advantages_B_T
    loss_B_T = -torch.min(unclipped_B_T, clipped_B_T)
    with torch.no_grad():
        clipped_low_B_T = ((ratio_B_T < 1.0 - epsilon) & (advantages_B_T < 0)).float()
        clipped_high_B_T = ((ratio_B_T > 1.0 + high) & (advantages_B_T > 0)).float()
    return PolicyLossOutput(loss_B_T, clipped_low_B_T, clipped_high_B_T)


@register_policy_loss("gspo")
def gspo_loss(
    logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    advantages_B_T: torch.Tensor,
    mask_B_T: torch.Tensor | None = None,
    epsilon: float = 3e-4,
    epsilon_high: float | None = 4e-4,
) -> PolicyLossOutput:
    """GSPO: the importance ratio and its clipping at the *sequence* level (Zheng et al. 2025, Qwen).

        s_i     = exp( mean_{t in y_i} (logp_t - logp_old_t) )         (length-normalised ratio)
        s_i,t   = sg(s_i) * exp(logp_t - sg(logp_t))                   (GSPO-token: same value as s_i,
                                                                        gradient through each token)
        loss_t  = -min(s_i,t * A_i,t, clip(s_i,t, 1 - eps, 1 + eps_high) * A_i,t)

    With one advantage per sequence this is exactly GSPO; with per-token advantages (turn credit) it
    is the paper's GSPO-token. A whole sequence is clipped or not, so one noisy token cannot veto its
    sequence's update (the paper's argument for MoE stability). The paper's clip range is tiny
    (3e-4 / 4e-4) because a length-normalised ratio stays near 1; use seq-mean-token-mean aggregation.
    Shapes: (B, T) everywhere; `mask_B_T` marks the policy tokens the mean runs over.
    """
    if mask_B_T is None:
        mask_B_T = torch.ones_like(logprobs_B_T)
    mask = mask_B_T.to(logprobs_B_T.dtype)
    high = epsilon if epsilon_high is None else epsilon_high
    log_ratio_B = ((logprobs_B_T - old_logprobs_B_T) * mask).sum(dim=1) / mask.sum(dim=1).clamp(
        min=1.0
    )
    seq_ratio_B_T = torch.exp(log_ratio_B.detach()[:, None] + logprobs_B_T - logprobs_B_T.detach())
    unclipped_B_T = seq_ratio_B_T * advantages_B_T
    clipped_B_T = torch.clamp(seq_ratio_B_T, 1.0 - epsilon, 1.0 + high) * advantages_B_T
    loss_B_T = -torch.min(unclipped_B_T, clipped_B_T)
    with torch.no_grad():
        ratio_B1 = torch.exp(log_ratio_B)[:, None]
        clipped_low_B_T = ((ratio_B1 < 1.0 - epsilon) & (advantages_B_T < 0)).float()
        clipped_high_B_T = ((ratio_B1 > 1.0 + high) & (advantages_B_T > 0)).float()
    return PolicyLossOutput(loss_B_T, clipped_low_B_T, clipped_high_B_T)


@register_policy_loss("cispo")
def cispo_loss(
    logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    advantages_B_T: torch.Tensor,
    mask_B_T: torch.Tensor | None = None,
    epsilon: float = 1.0,
    epsilon_high: float | None = 0.28,
) -> PolicyLossOutput:
    """CISPO: clip the importance-sampling *weight*, never the token (MiniMax-M1, Chen et al. 2025).

        w_t    = sg( clip(exp(logp_t - logp_old_t), 1 - eps, 1 + eps_high) )
        loss_t = -w_t * A_t * logp_t

    PPO's min() zeroes the gradient of a clipped token; rare "fork" tokens (however, wait, ...) are
    exactly the ones whose ratio leaves the range, so PPO stops learning them after the first
    update. CISPO keeps every token's REINFORCE gradient and only bounds its weight. The paper sets
    no lower bound (eps = 1 makes it 0) and tunes only eps_high; 0.28 follows verl/Trinity.
    "Clipped" here means the weight was truncated (ratio outside the range, whatever A's sign).
    """
    del mask_B_T
    high = epsilon if epsilon_high is None else epsilon_high
    ratio_B_T = torch.exp(logprobs_B_T - old_logprobs_B_T).detach()
    weight_B_T = torch.clamp(ratio_B_T, 1.0 - epsilon, 1.0 + high)
    loss_B_T = -weight_B_T * advantages_B_T * logprobs_B_T
    with torch.no_grad():
        clipped_low_B_T = (ratio_B_T < 1.0 - epsilon).float()
        clipped_high_B_T = (ratio_B_T > 1.0 + high).float()
    return PolicyLossOutput(loss_B_T, clipped_low_B_T, clipped_high_B_T)


def truncated_importance_weights(
    old_logprobs_B_T: torch.Tensor, behaviour_logprobs_B_T: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance sampling for a generator that is not the trainer (Yao et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training").

        w_t = min( exp(logp_old_t - logp_behaviour_t), cap )          (detached)

    The tokens were sampled by the generator (vLLM, another precision, a stale copy) whose
    probabilities differ from the trainer's pi_old; multiplying each token's loss by w_t corrects the
    mismatch, and the cap bounds the variance. Shapes (B, T); returns (B, T), no gradient.
    """
    return torch.exp(old_logprobs_B_T - behaviour_logprobs_B_T).clamp(max=cap).detach()


def full_reverse_kl(
    student_logprobs_B_T_V: torch.Tensor, teacher_logprobs_B_T_V: torch.Tensor
) -> torch.Tensor:
    """Per-position reverse KL(student || teacher) over the whole vocabulary, (B, T).

        KL_t = sum_v p_s(v | y_<t) * (log p_s(v | y_<t) - log p_t(v | y_<t))

    On-policy distillation (Agarwal et al. 2024, GKD; Lu et al. 2025, Thinking Machines): the student
    samples y, the teacher grades every position, and minimising this dense, mode-seeking divergence
    on the student's own states needs no reward. Summing over the vocabulary (rather than using the
    sampled token's log-ratio) removes the sampling variance at each position.
    """
    student_probs = student_logprobs_B_T_V.exp()
    return (student_probs * (student_logprobs_B_T_V - teacher_logprobs_B_T_V)).sum(dim=-1)


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
