"""PPO with a learned critic: token-level rewards, GAE, whitening, the clipped value loss, and
REINFORCE++ returns. Pure tensor functions; nothing is registered.

The time axis is the policy's own tokens. A row of the completion region (B, T) interleaves sampled
tokens (mask 1) with tool observations and template glue (mask 0) and ends in padding (mask 0). The
masked positions are not time steps: the state after policy token t is the next *policy* token of the
same row, and the step after the row's last policy token is terminal (V = 0). So a row
[p p o o p] gives exactly the numbers of the row [p p p]. Rewards therefore sit on policy tokens only;
one found on a masked position is an error (it would silently vanish), never moved.

How this departs from the papers, on purpose:
- One episode per row and gamma/lambda per *token* (as InstructGPT, TRL and verl do for LLMs), where
  Schulman et al. 2016 step per environment action; a multi-turn row is one episode over its turns.
- The KL to the reference may sit in the reward (`kl_coef`, InstructGPT / verl `use_kl_in_reward`)
  rather than in the loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlvr.algorithms.losses import zero_outside
from rlvr.records import Trajectory

TurnRewards = Sequence[Sequence[tuple[int, float]]]


def token_level_rewards(
    mask_B_T: torch.Tensor,
    outcome_B: torch.Tensor,
    turn_rewards: TurnRewards | None = None,
    kl_B_T: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards (B, T) over the completion region.

        r_t = outcome_b * [t is the last policy token of row b]
            + sum_k value_k * [t == position_k]                 (turn rewards)
            - kl_coef * kl_t * mask_t                           (KL in the reward)

    `turn_rewards[b]` lists (position, value) pairs for row b, position a completion index (token
    index - prompt_length) that must be a policy token; `turn_reward_positions` builds them from a
    `Trajectory`. `Trajectory.turn_rewards` already sum to `Trajectory.reward`, so pass the reward
    either as `outcome_B` or split over turns with `outcome_B` zero, not both. A row without policy
    tokens (padding) must have outcome 0. `kl_B_T` is any per-token estimate of KL(pi || pi_ref)
    (e.g. rlvr.algorithms.KL_ESTIMATORS["k1"], as InstructGPT), (B, T); it is detached here.
    Shapes: mask_B_T (B, T) 0/1, outcome_B (B,). Returns float32 (B, T), 0 where mask is 0.
    """
    mask = mask_B_T.float()
    B, T = mask.shape
    rewards_B_T = torch.zeros(B, T, dtype=torch.float32, device=mask.device)
    has_policy_B = mask.sum(dim=1) > 0
    outcome = outcome_B.detach().float().reshape(B)
    if bool(((outcome != 0) & ~has_policy_B).any()):
        raise ValueError("an outcome reward on a row without policy tokens would be lost")
    # The last policy token: argmax of position * mask (0 for an empty row, whose outcome is 0).
    last_B = (mask * torch.arange(1, T + 1, dtype=torch.float32, device=mask.device)).argmax(dim=1)
    rewards_B_T[torch.arange(B, device=mask.device), last_B] += outcome
    if turn_rewards is not None:
        if len(turn_rewards) != B:
            raise ValueError(f"turn_rewards has {len(turn_rewards)} rows, the batch {B}")
        for b, pairs in enumerate(turn_rewards):
            for position, value in pairs:
                if not 0 <= position < T or mask[b, position] == 0:
                    raise ValueError(
                        f"turn reward at row {b}, position {position}: not a policy token"
                    )
                rewards_B_T[b, position] += value
    if kl_B_T is not None:
        rewards_B_T -= kl_coef * zero_outside(kl_B_T.detach().float(), mask)
    return rewards_B_T


def turn_reward_positions(trajectory: Trajectory) -> list[tuple[int, float]]:
    """(completion position, reward) of each turn: its last policy token, for `token_level_rewards`.

    A turn with no policy token of its own (an empty turn) hands its reward to the last policy token
    before it: the last action taken before that reward arrived.
    """
    if len(trajectory.turn_rewards) != len(trajectory.turns):
        raise ValueError(
            f"trajectory {trajectory.task_id}: {len(trajectory.turns)} turns but "
            f"{len(trajectory.turn_rewards)} turn rewards"
        )
    n_p = trajectory.prompt_length
    out = []
    for span, value in zip(trajectory.turns, trajectory.turn_rewards, strict=True):
        position = next(
            (t for t in range(span.end - 1, n_p - 1, -1) if trajectory.policy_mask[t]), None
        )
        if position is None:
            raise ValueError(f"trajectory {trajectory.task_id}: turn {span} has no policy token")
        out.append((position - n_p, value))
    return out


def _check_rewards_on_policy_tokens(rewards_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> None:
    if bool(((rewards_B_T != 0) & (mask_B_T == 0)).any()):
        raise ValueError(
            "a reward sits on a masked position (observation, glue or padding); "
            "place rewards on policy tokens (token_level_rewards does)"
        )


@torch.no_grad()
def gae_advantages(
    rewards_B_T: torch.Tensor,
    values_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, eq. 16) over the policy tokens.

        delta_t = r_t + gamma * V(t') - V(t)          t' = next policy token of the row; V(end) = 0
        A_t     = delta_t + gamma * lam * A_t'
        R_t     = A_t + V(t)                          (the critic's regression target)

    lam = 1 gives Monte-Carlo returns minus V; lam = 0 gives the one-step TD error. Values on masked
    positions are ignored; rewards there raise. No gradient flows (targets are constants).
    Shapes: all (B, T); mask 1 on policy tokens. Returns (advantages_B_T, returns_B_T), float32,
    0 where mask is 0.
    """
    _check_rewards_on_policy_tokens(rewards_B_T, mask_B_T)
    rewards = rewards_B_T.float()
    values = values_B_T.float()
    on_B_T = mask_B_T != 0
    B, T = rewards.shape
    advantages_B_T = torch.zeros_like(rewards)
    next_value_B = rewards.new_zeros(B)
    running_B = rewards.new_zeros(B)
    # Reverse sweep; at a masked position the carried state (next value, running A) passes through
    # untouched, which is what skipping the position means.
    for t in range(T - 1, -1, -1):
        on_B = on_B_T[:, t]
        delta_B = rewards[:, t] + gamma * next_value_B - values[:, t]
        candidate_B = delta_B + gamma * lam * running_B
        running_B = torch.where(on_B, candidate_B, running_B)
        next_value_B = torch.where(on_B, values[:, t], next_value_B)
        advantages_B_T[:, t] = torch.where(on_B, candidate_B, 0.0)
    returns_B_T = torch.where(on_B_T, advantages_B_T + values, 0.0)
    return advantages_B_T, returns_B_T


def reinforce_pp_returns(
    rewards_B_T: torch.Tensor, mask_B_T: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Discounted reward-to-go per policy token, REINFORCE++ (Hu 2025) before its global whitening.

        G_t = r_t + gamma * G_t'        t' = next policy token of the row; G(end) = 0

    This is GAE with V = 0 and lam = 1. REINFORCE++ then whitens G over the whole batch
    (`whiten(G, mask)`) to get the advantages. Shapes (B, T); returns float32 (B, T), 0 where masked.
    """
    returns_B_T, _ = gae_advantages(
        rewards_B_T, torch.zeros_like(rewards_B_T, dtype=torch.float32), mask_B_T, gamma, 1.0
    )
    return returns_B_T


def whiten(
    x_B_T: torch.Tensor, mask_B_T: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Masked whitening (PPO's advantage normalisation; TRL / verl `masked_whiten`).

        y = (x - mean) / sqrt(var + eps)              mean, var over the positions where mask is 1
        y = y + mean                                  if not shift_mean (rescale, keep the mean)

    var is Bessel-corrected as in TRL and verl. Statistics are over every masked-in element of the
    tensor, so whiten the whole batch at once (flatten and concatenate micro-batches of different
    widths), not micro-batch by micro-batch. Any shape; returns float32, 0 where mask is 0.

    Values that are all equal give y = 0 exactly (x - mean is then float32 rounding, ~6e-8 for 0.7,
    and dividing it by sqrt(var + eps) with var of the same order would make it O(1)).
    """
    on = mask_B_T != 0
    x = torch.where(on, x_B_T.float(), 0.0)
    mask = on.float()
    count = mask.sum()
    mean = x.sum() / count.clamp(min=1.0)
    values = x[on]
    varies = values.numel() > 1 and bool(values.max() > values.min())
    deviation = torch.where(on, x - mean, 0.0) if varies else torch.zeros_like(x)
    var = (deviation**2).sum() / (count - 1).clamp(min=1.0)
    y = deviation * torch.rsqrt(var + eps)
    if not shift_mean:
        y = y + mean
    return torch.where(on, y, 0.0)


def value_loss(
    values_B_T: torch.Tensor,
    old_values_B_T: torch.Tensor,
    returns_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    clip_range: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss per token (PPO, Schulman et al. 2017; as in OpenAI baselines, TRL, verl).

        V_clip = V_old + clip(V - V_old, -c, c)
        loss_t = 0.5 * max((V - R)^2, (V_clip - R)^2)           clip_range c; 0.5 * (V - R)^2 if None
        clipped_t = [(V_clip - R)^2 > (V - R)^2]                there the gradient is zero

    Shapes: all (B, T). Returns (loss_B_T, clipped_B_T), both 0 where mask is 0; reduce the loss with
    rlvr.algorithms.aggregate and the indicator as a masked mean (`vf_clipfrac`).
    """
    mask = mask_B_T.to(values_B_T.dtype)
    unclipped_B_T = (values_B_T - returns_B_T) ** 2
    if clip_range is None:
        return 0.5 * zero_outside(unclipped_B_T, mask), torch.zeros_like(unclipped_B_T)
    v_clip_B_T = old_values_B_T + torch.clamp(values_B_T - old_values_B_T, -clip_range, clip_range)
    clipped_loss_B_T = (v_clip_B_T - returns_B_T) ** 2
    loss_B_T = 0.5 * zero_outside(torch.max(unclipped_B_T, clipped_loss_B_T), mask)
    with torch.no_grad():
        clipped_B_T = zero_outside((clipped_loss_B_T > unclipped_B_T).float(), mask)
    return loss_B_T, clipped_B_T
