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
    scale_rewards: bool = True,
    eps: float = 1e-4,
) -> torch.Tensor:
    """GRPO group-relative advantage (Shao et al. 2024, DeepSeekMath, eq. 4 in its outcome form).

        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)      if scale_rewards
        A_i =  r_i - mean(r_group)                              otherwise (Dr.GRPO, Liu et al. 2025)

    The std is Bessel-corrected (as torch.std and TRL); a group with equal rewards gets exactly A = 0.
    Invalid members get A = 0 and are left out of their group's mean and std.
    Shapes: rewards_B, valid_B (B,), B = P * group_size, group-major. Returns (B,).
    """
    if rewards_B.numel() % group_size:
        raise ValueError(f"{rewards_B.numel()} rewards do not split into groups of {group_size}")
    valid_P_G = valid_B.view(-1, group_size).to(rewards_B.dtype)
    rewards_P_G = rewards_B.view(-1, group_size)
    mean_P1, std_P1 = _masked_group_stats(rewards_P_G, valid_P_G)
    advantages_P_G = rewards_P_G - mean_P1
    if scale_rewards:
        advantages_P_G = advantages_P_G / (std_P1 + eps)
    # A group whose valid rewards are all equal carries no signal: exactly 0, not the float32 rounding
    # of its mean divided by eps (0.7 * 8 / 8 != 0.7 in float32).
    big = torch.finfo(rewards_P_G.dtype).max
    spread_P1 = rewards_P_G.masked_fill(valid_P_G == 0, -big).amax(
        dim=1, keepdim=True
    ) - rewards_P_G.masked_fill(valid_P_G == 0, big).amin(dim=1, keepdim=True)
    advantages_P_G = torch.where(spread_P1 > 0, advantages_P_G, torch.zeros_like(advantages_P_G))
    return (advantages_P_G * valid_P_G).view(-1)


def group_reward_std(
    rewards_B: torch.Tensor, valid_B: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Std of the valid rewards within each group, (P,): the in-group signal GRPO learns from."""
    valid_P_G = valid_B.view(-1, group_size).to(rewards_B.dtype)
    _, std_P1 = _masked_group_stats(rewards_B.view(-1, group_size), valid_P_G)
    return std_P1.view(-1)
