"""Policy losses, KL estimators and loss aggregation: pure tensor functions, registered by name.

Per-token tensors are (B, T) over the *target* positions: `logprobs_B_T[b, t]` is the log-prob of token
t+1 of row b given tokens <= t. `mask_B_T` is 1 exactly where the policy sampled that token (prompt,
padding and tool observations are 0), so nothing outside it can receive gradient. Masks select with
`torch.where` (`zero_outside`), never by multiplying: inf * 0 and nan * 0 are nan, so a non-finite
value at a masked position (a padding token's log-prob, an unscored row's reference) would
otherwise poison the whole loss.
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


def zero_outside(values_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
    """values * mask where mask != 0, exactly 0 elsewhere (whatever the value there: inf, nan).

    The backward sends exactly 0 to masked positions too. It cannot undo a non-finite *local*
    derivative further up (0 * inf is still nan there), so callers that differentiate through
    masked positions also keep their inputs finite (rlvr.train.update does)."""
    return torch.where(mask_B_T != 0, values_B_T * mask_B_T.to(values_B_T.dtype), 0.0)


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
    log_ratio_B = zero_outside(logprobs_B_T - old_logprobs_B_T, mask).sum(dim=1) / mask.sum(
        dim=1
    ).clamp(min=1.0)
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
# With log_r = logp_ref - logp for a token sampled from pi. Two different questions: what each
# estimates as a *value* (what the KL in the reward uses, no gradient taken), and what its gradient
# follows as a *loss* term on on-policy samples (tokens from pi, no gradient through the sampling):
#
#   name  value (E_pi)        expected gradient of the loss term
#   k1    KL(pi||ref), exact   E_pi[grad log pi] = 0: pulls nothing (refused in the loss by the config)
#   k2    biased, >= 0         E_pi[(log pi - log ref) grad log pi] = grad KL(pi||ref), exactly
#   k3    KL(pi||ref), exact   E_pi[(1 - ref/pi) grad log pi] = -E_ref[grad log pi] = grad KL(ref||pi)
#
# So in the loss k2 follows the reverse KL(pi || ref) and k3 the forward KL(ref || pi) (GRPO's choice,
# mass-covering); both vanish at pi = ref and pull towards it. tests/test_algorithm_defects.py checks
# the table on an exact categorical distribution.
K3_CLAMP = 10.0  # |k3| per token, as verl bounds it; see kl_k3
_K3_LOG_RATIO_CLAMP = 20.0  # exp(20) = 4.9e8: finite, with a finite derivative


@_register_kl("k1")
def kl_k1(logprobs_B_T: torch.Tensor, ref_logprobs_B_T: torch.Tensor) -> torch.Tensor:
    """k1 = -log_r = log pi - log ref: an unbiased estimate of KL(pi || ref), high variance, negative
    for some tokens. Use it in the reward (`objective.kl_in_reward`, InstructGPT / REINFORCE++ / PPO):
    as a loss term its expected gradient is E_pi[grad log pi] = 0, so it never pulls pi to ref."""
    return logprobs_B_T - ref_logprobs_B_T


@_register_kl("k2")
def kl_k2(logprobs_B_T: torch.Tensor, ref_logprobs_B_T: torch.Tensor) -> torch.Tensor:
    """k2 = (log_r)^2 / 2: a biased estimate of KL(pi || ref), low variance, >= 0. As a loss term on
    on-policy samples its expected gradient E_pi[(log pi - log ref) grad log pi] is exactly
    grad KL(pi || ref), the reverse KL (not an approximation)."""
    return 0.5 * (ref_logprobs_B_T - logprobs_B_T) ** 2


@_register_kl("k3")
def kl_k3(logprobs_B_T: torch.Tensor, ref_logprobs_B_T: torch.Tensor) -> torch.Tensor:
    """k3 = exp(log_r) - 1 - log_r: an unbiased estimate of KL(pi || ref), >= 0, low variance; GRPO's
    choice (DeepSeekMath eq. 4). As a loss term its expected gradient is grad KL(ref || pi), the
    *forward* KL (see the table above), not the reverse KL it estimates.

    Clamped, as verl does: the value to [-K3_CLAMP, K3_CLAMP] = [-10, 10] (k3 >= 0, so in effect at
    most 10), and log_r to [-20, 20] before the exp, so a token far from the reference (log_r = 89
    overflows float32's exp) gives 10 with a zero, finite gradient instead of inf or nan. Such a token
    then adds no KL gradient: the policy loss, not the penalty, moves it."""
    log_r = (ref_logprobs_B_T - logprobs_B_T).clamp(-_K3_LOG_RATIO_CLAMP, _K3_LOG_RATIO_CLAMP)
    return (torch.exp(log_r) - 1.0 - log_r).clamp(-K3_CLAMP, K3_CLAMP)


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
    micro-batches, so that accumulating micro-batch losses gives exactly the full-batch loss. Every
    normaliser is at least 1: a batch with no policy token (or a count of 0) gives 0, not 0 / 0 = nan.
    Masked positions count as exactly 0 whatever they hold (`zero_outside`).
    """
    mask = mask_B_T.to(loss_B_T.dtype)
    masked_B_T = zero_outside(loss_B_T, mask)
    if mode == "token-mean":
        if total_tokens is None:
            return masked_B_T.sum() / mask.sum().clamp(min=1.0)
        return masked_B_T.sum() / max(float(total_tokens), 1.0)
    n_seq = max(float(loss_B_T.shape[0] if total_sequences is None else total_sequences), 1.0)
    if mode == "seq-mean-token-mean":
        per_seq_B = masked_B_T.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return per_seq_B.sum() / n_seq
    if mode == "seq-mean-token-sum-norm":
        length = max(float(loss_B_T.shape[1] if norm_length is None else norm_length), 1.0)
        return masked_B_T.sum() / (n_seq * length)
    raise ValueError(f"unknown loss aggregation {mode!r}; one of {', '.join(AGGREGATIONS)}")
