"""Offline objectives: supervised fine-tuning, DPO and its variants, Bradley-Terry reward models.

Pure tensor functions, no model in sight. Shape suffixes as everywhere in rlvr: `_B` one value per
example (or pair), `_B_T` per target position, `_B_T_V` per position and vocabulary entry. Per-token
tensors are over *target* positions: `logprobs_B_T[b, t]` is log p(token t+1 | tokens <= t) of row b,
and `mask_B_T` is 1 exactly where that target token is trained on.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from rlvr.algorithms.losses import zero_outside

DPOLossType = Literal["sigmoid", "ipo", "hinge"]
DPO_LOSS_TYPES: tuple[DPOLossType, ...] = ("sigmoid", "ipo", "hinge")


def target_logprobs(logits_B_T_V: torch.Tensor, targets_B_T: torch.Tensor) -> torch.Tensor:
    """log p(target) at each position, (B, T); the softmax is taken in fp32 whatever the logits' dtype."""
    logprobs_B_T_V = torch.log_softmax(logits_B_T_V.float(), dim=-1)
    return logprobs_B_T_V.gather(2, targets_B_T[:, :, None]).squeeze(2)


def sequence_logps(
    logprobs_B_T: torch.Tensor, mask_B_T: torch.Tensor, average: bool = False
) -> torch.Tensor:
    """Sum (or, with `average`, mean) of the masked token log-probs of each row, (B,).

    DPO scores a completion by its summed log-likelihood; IPO by the mean (see `dpo_loss`).
    """
    total_B = zero_outside(logprobs_B_T, mask_B_T).sum(dim=1)
    if average:
        return total_B / mask_B_T.sum(dim=1).clamp(min=1)
    return total_B


def sft_loss(
    logprobs_B_T: torch.Tensor, mask_B_T: torch.Tensor, num_tokens: float | None = None
) -> torch.Tensor:
    """Negative log-likelihood of the trained tokens, averaged per token:

        L = -sum_{b,t} mask[b,t] * logp[b,t] / N,   N = num_tokens or sum(mask)

    `num_tokens` lets gradient accumulation divide every micro-batch by the whole step's token count,
    so the step's gradient is the token mean over the step whatever the micro-batch split (and
    packed or not). Tokens with mask 0 (prompt, system, user turns, padding) carry no gradient.
    """
    denominator = float(mask_B_T.sum()) if num_tokens is None else num_tokens
    return -zero_outside(logprobs_B_T, mask_B_T).sum() / max(denominator, 1.0)


def dpo_loss(
    policy_chosen_logps_B: torch.Tensor,
    policy_rejected_logps_B: torch.Tensor,
    ref_chosen_logps_B: torch.Tensor,
    ref_rejected_logps_B: torch.Tensor,
    beta: float = 0.1,
    loss_type: DPOLossType = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Direct preference losses on (chosen, rejected) completions; returns (loss, chosen_rewards_B,
    rejected_rewards_B).

    With the implicit reward r(y) = beta * (log pi(y|x) - log pi_ref(y|x)) and the margin
    h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)):

    - sigmoid (DPO, Rafailov et al. 2023): L = -log sigmoid(beta * h). With label_smoothing eps
      (conservative DPO, Mitchell 2023: labels flipped with probability eps):
      L = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h).
    - ipo (IPO, Azar et al. 2023, eq. 17): L = (h - 1 / (2 beta))^2; beta plays the paper's tau.
      The paper's log-likelihoods are per-token means: pass averaged log-probs
      (`sequence_logps(..., average=True)`), as the DPO trainer does for this loss type.
    - hinge (SLiC-HF, Zhao et al. 2023): L = max(0, 1 - beta * h); 1/beta is the margin delta.

    The loss is the mean over the B pairs. The returned rewards are beta * (log pi - log pi_ref),
    detached (metrics). beta = 0.1 is the DPO paper's and TRL's default.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r} is not one of {', '.join(DPO_LOSS_TYPES)}")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError("label_smoothing applies to the sigmoid loss only")
    chosen_logratios_B = policy_chosen_logps_B - ref_chosen_logps_B
    rejected_logratios_B = policy_rejected_logps_B - ref_rejected_logps_B
    h_B = chosen_logratios_B - rejected_logratios_B
    if loss_type == "sigmoid":
        losses_B = -(1.0 - label_smoothing) * F.logsigmoid(beta * h_B) - (
            label_smoothing * F.logsigmoid(-beta * h_B)
        )
    elif loss_type == "ipo":
        losses_B = (h_B - 1.0 / (2.0 * beta)) ** 2
    else:
        losses_B = torch.relu(1.0 - beta * h_B)
    chosen_rewards_B = beta * chosen_logratios_B.detach()
    rejected_rewards_B = beta * rejected_logratios_B.detach()
    return losses_B.mean(), chosen_rewards_B, rejected_rewards_B


def bradley_terry_loss(
    chosen_scores_B: torch.Tensor,
    rejected_scores_B: torch.Tensor,
    margin_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pairwise reward-model loss (Bradley-Terry, as in InstructGPT, Ouyang et al. 2022):

        L = -mean_b log sigmoid(r(x, y_w) - r(x, y_l) - m_b)

    The optional per-pair margin m (Llama 2, Touvron et al. 2023) asks for a wider gap on pairs
    rated far apart; None means m = 0.
    """
    diff_B = chosen_scores_B - rejected_scores_B
    if margin_B is not None:
        diff_B = diff_B - margin_B
    return -F.logsigmoid(diff_B).mean()
