"""Advantage estimators: pure tensor functions, registered by name, vectorised over groups.

Every estimator takes the scalar rewards of a batch laid out group-major (`rewards_B` with B = P * G,
members of one group adjacent, the order `records.flatten` produces) and a `valid_B` mask (0 where a
reward function raised: such a trajectory neither gets an advantage nor shifts its group's baseline).
It returns `advantages_B`, one scalar per trajectory; credit per token is the loop's job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class AdvantageEstimator(Protocol):
    def __call__(
        self, rewards_B: torch.Tensor, valid_B: torch.Tensor, group_size: int, **options: object
    ) -> torch.Tensor: ...


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {}


def register_advantage(
    name: str,
) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    def wrap(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return wrap


def _group_spread(rewards_P_G: torch.Tensor, valid_P_G: torch.Tensor) -> torch.Tensor:
    """max - min of the valid rewards of each group, (P, 1); 0 for a group with no valid member.

    This is the one test of "no signal" every estimator and filter uses: a group whose valid rewards
    are all equal has spread exactly 0, whereas its float32 std is the rounding of its mean (eight
    rewards of 0.7 have std 6.4e-8, above any fixed tolerance one might pick for "zero")."""
    valid = valid_P_G != 0
    big = torch.finfo(rewards_P_G.dtype).max
    highest_P1 = rewards_P_G.masked_fill(~valid, -big).amax(dim=1, keepdim=True)
    lowest_P1 = rewards_P_G.masked_fill(~valid, big).amin(dim=1, keepdim=True)
    has_any_P1 = valid.any(dim=1, keepdim=True)
    return torch.where(has_any_P1, highest_P1 - lowest_P1, torch.zeros_like(highest_P1))


def _masked_group_stats(
    rewards_P_G: torch.Tensor, valid_P_G: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased std over the valid members of each group; (P, 1) each."""
    count_P1 = valid_P_G.sum(dim=1, keepdim=True)
    mean_P1 = (rewards_P_G * valid_P_G).sum(dim=1, keepdim=True) / count_P1.clamp(min=1)
    sq_dev_P_G = ((rewards_P_G - mean_P1) * valid_P_G) ** 2
    # Bessel-corrected like torch.std and TRL, so numbers compare across tools.
    std_P1 = (sq_dev_P_G.sum(dim=1, keepdim=True) / (count_P1 - 1).clamp(min=1)).sqrt()
    return mean_P1, std_P1


@register_advantage("grpo")
def grpo_advantages(
    rewards_B: torch.Tensor,
    valid_B: torch.Tensor,
    group_size: int,
    scale_rewards: bool | str = True,
    eps: float = 1e-4,
) -> torch.Tensor:
    """GRPO group-relative advantage (Shao et al. 2024, DeepSeekMath, eq. 4 in its outcome form).

        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)   scale_rewards "group" (or True)
        A_i = (r_i - mean(r_group)) / (std(r_batch) + eps)   "batch" (TRL's; Hu 2025)
        A_i =  r_i - mean(r_group)                           "none" (or False; Dr.GRPO, Liu 2025)

    The std is Bessel-corrected (as torch.std and TRL), over the valid members; a group with equal
    rewards gets exactly A = 0. Invalid members get A = 0 and are left out of every mean and std.
    Shapes: rewards_B, valid_B (B,), B = P * group_size, group-major. Returns (B,).
    """
    if isinstance(scale_rewards, bool):  # TRL's older spelling
        scaling = "group" if scale_rewards else "none"
    else:
        scaling = scale_rewards
    if scaling not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards must be group, batch or none, got {scale_rewards!r}")
    if rewards_B.numel() % group_size:
        raise ValueError(f"{rewards_B.numel()} rewards do not split into groups of {group_size}")
    valid_P_G = valid_B.view(-1, group_size).to(rewards_B.dtype)
    rewards_P_G = rewards_B.view(-1, group_size)
    mean_P1, std_P1 = _masked_group_stats(rewards_P_G, valid_P_G)
    advantages_P_G = rewards_P_G - mean_P1
    if scaling == "group":
        advantages_P_G = advantages_P_G / (std_P1 + eps)
    elif scaling == "batch":
        _, batch_std_11 = _masked_group_stats(
            rewards_B.view(1, -1), valid_B.view(1, -1).to(rewards_B.dtype)
        )
        advantages_P_G = advantages_P_G / (batch_std_11 + eps)
    # A group whose valid rewards are all equal carries no signal: exactly 0, not the float32 rounding
    # of its mean divided by eps (0.7 * 8 / 8 != 0.7 in float32).
    spread_P1 = _group_spread(rewards_P_G, valid_P_G)
    advantages_P_G = torch.where(spread_P1 > 0, advantages_P_G, torch.zeros_like(advantages_P_G))
    return (advantages_P_G * valid_P_G).view(-1)


def group_reward_std(
    rewards_B: torch.Tensor, valid_B: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Std of the valid rewards within each group, (P,): the in-group signal GRPO learns from.

    Exactly 0 when the group's valid rewards are all equal (their max - min spread is 0, the test
    `grpo_advantages` uses) and > 0 otherwise, so `std == 0` is the one "no signal" rule for the
    zero-std filter, DAPO's dynamic sampling and `frac_reward_zero_std`. Computed in float64: the
    float32 rounding of a constant group's mean is not 0 (eight rewards of 0.7: 6.4e-8).
    """
    valid_P_G = valid_B.view(-1, group_size).to(torch.float64)
    rewards_P_G = rewards_B.view(-1, group_size).to(torch.float64)
    _, std_P1 = _masked_group_stats(rewards_P_G, valid_P_G)
    spread_P1 = _group_spread(rewards_P_G, valid_P_G)
    return torch.where(spread_P1 > 0, std_P1, torch.zeros_like(std_P1)).view(-1)


@register_advantage("rloo")
def rloo_advantages(
    rewards_B: torch.Tensor, valid_B: torch.Tensor, group_size: int, **_: object
) -> torch.Tensor:
    """REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics").

        A_i = r_i - mean_{j != i} r_j  =  n / (n - 1) * (r_i - mean(r_group))

    with n the number of valid members of the group: each sample's baseline is the mean of the
    *others*, so it is independent of the sample and the estimate unbiased. No std scaling. A group
    with fewer than two valid members gets A = 0 (there is no other sample to compare with), and so
    does a group whose valid rewards are all equal (exactly, not up to float32 rounding).
    Shapes: (B,) in, (B,) out, group-major.
    """
    if rewards_B.numel() % group_size:
        raise ValueError(f"{rewards_B.numel()} rewards do not split into groups of {group_size}")
    valid_P_G = valid_B.view(-1, group_size).to(rewards_B.dtype)
    rewards_P_G = rewards_B.view(-1, group_size) * valid_P_G
    count_P1 = valid_P_G.sum(dim=1, keepdim=True)
    others_mean_P_G = (rewards_P_G.sum(dim=1, keepdim=True) - rewards_P_G) / (count_P1 - 1).clamp(
        min=1
    )
    # Two or more valid members, and not all equal: in float32 the others' mean of eight 0.7s is not
    # exactly 0.7, which would give every member of a signal-free group the same small push.
    informative_P1 = (count_P1 > 1) & (_group_spread(rewards_P_G, valid_P_G) > 0)
    advantages_P_G = torch.where(
        informative_P1, rewards_P_G - others_mean_P_G, torch.zeros_like(rewards_P_G)
    )
    return (advantages_P_G * valid_P_G).view(-1)


def _batch_whiten(
    values_B: torch.Tensor, valid_B: torch.Tensor, eps: float, shift: bool = True
) -> torch.Tensor:
    """(x - mean) / (std + eps) over the valid entries of the whole batch (x / (std + eps) when not
    `shift`); invalid entries -> 0. The std is Bessel-corrected like the group std. A batch whose
    valid values are all equal gives exactly 0 when shifting: its float32 deviations from the mean
    are rounding, which (std + eps) would blow up to a same-sign advantage (+0.056 for all-0.7)."""
    if shift and float(_group_spread(values_B[None, :], valid_B[None, :]).item()) == 0.0:
        return torch.zeros_like(values_B)
    valid = valid_B.to(values_B.dtype)
    count = valid.sum().clamp(min=1)
    mean = (values_B * valid).sum() / count
    std = ((((values_B - mean) * valid) ** 2).sum() / (count - 1).clamp(min=1)).sqrt()
    return (values_B - (mean if shift else 0.0)) / (std + eps) * valid


@register_advantage("reinforce_pp")
def reinforce_pp_advantages(
    rewards_B: torch.Tensor,
    valid_B: torch.Tensor,
    group_size: int,
    eps: float = 1e-6,
    **_: object,
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025), outcome form: the reward whitened over the whole *batch*.

        A_i = (r_i - mean_batch(r)) / (std_batch(r) + eps)

    No per-prompt baseline: the global normalisation is REINFORCE++'s answer to GRPO's per-group std
    (which over-weights nearly-solved prompts). With `objective.kl_in_reward` the loop uses the
    token-level form instead (per-token KL penalty, reward-to-go, then the same batch whitening).
    A batch whose valid rewards are all equal gets exactly A = 0.
    """
    del group_size
    return _batch_whiten(rewards_B, valid_B, eps)


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(
    rewards_B: torch.Tensor,
    valid_B: torch.Tensor,
    group_size: int,
    eps: float = 1e-6,
    **_: object,
) -> torch.Tensor:
    """REINFORCE++ with a group baseline (Hu 2025, "REINFORCE++-baseline"): subtract the mean of the
    prompt's group, then whiten over the batch.

        A_i = (r_i - mean(r_group)) / (std_batch(r - mean(r_group)) + eps)

    The centred values already have mean 0 over the batch, so only the scale is normalised: a group
    with equal rewards keeps exactly A = 0 (its rows can then be skipped in the update), also when
    every group of the batch is constant.
    """
    valid_P_G = valid_B.view(-1, group_size).to(rewards_B.dtype)
    rewards_P_G = rewards_B.view(-1, group_size)
    mean_P1, _std = _masked_group_stats(rewards_P_G, valid_P_G)
    # A constant group's float32 deviations from its mean are rounding (~6e-8); were they kept, a
    # batch of such groups would have a batch std of the same size, and the division would turn the
    # rounding into advantages of ~0.06. They are exactly 0.
    informative_P1 = _group_spread(rewards_P_G, valid_P_G) > 0
    centred_P_G = torch.where(informative_P1, rewards_P_G - mean_P1, torch.zeros_like(rewards_P_G))
    centred_B = (centred_P_G * valid_P_G).view(-1)
    return _batch_whiten(centred_B, valid_B, eps, shift=False)
