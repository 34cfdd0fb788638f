"""Credit assignment for multi-turn trajectories: which advantage each policy token gets.

Three modes (`objective.credit`):
- trajectory: every policy token of trajectory i gets A_i, its group-relative advantage (GRPO's
  outcome supervision; RAGEN's StarPO default).
- turn: turn k of a trajectory gets the group-relative advantage of its discounted return
  R_k = sum_{j >= k} gamma^(j-k) r_j, normalised over all (trajectory, turn) returns of the group,
  so a turn that leads to reward later is credited and a wasted turn after the reward is not.
- bi-level: A_i + turn_weight * A_turn(i, k): the episode's outcome plus the turn's own share, the
  combination GiGPO (Feng et al. 2025) uses; RAGEN's bi-level GAE needs a critic, which comes with PPO.

Everything here is a pure function of rewards; tokens of turn k are found from `Trajectory.turns`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rlvr.records import Trajectory


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """R_k = r_k + gamma * R_{k+1}, computed backwards. Length = number of turns."""
    out = [0.0] * len(rewards)
    running = 0.0
    for k in range(len(rewards) - 1, -1, -1):
        running = rewards[k] + gamma * running
        out[k] = running
    return out


def turn_advantages(
    turn_rewards: Sequence[Sequence[float]],
    valid: Sequence[bool],
    group_size: int,
    gamma: float = 1.0,
    scale: bool = True,
    eps: float = 1e-4,
) -> list[list[float]]:
    """Group-relative advantages of discounted turn returns; one list (per turn) per trajectory.

    Within each group of `group_size` consecutive trajectories, the returns of every turn of every
    valid trajectory are pooled: A = (R - mean) / (std + eps) (Bessel std; no division when
    `scale` is False). A group whose pooled returns are all equal gets 0; invalid trajectories get 0.
    """
    if len(turn_rewards) % group_size:
        raise ValueError(
            f"{len(turn_rewards)} trajectories do not split into groups of {group_size}"
        )
    returns = [discounted_returns(r, gamma) for r in turn_rewards]
    out: list[list[float]] = [[0.0] * len(r) for r in returns]
    for start in range(0, len(returns), group_size):
        members = [i for i in range(start, start + group_size) if valid[i]]
        pool = [value for i in members for value in returns[i]]
        if len(pool) < 2 or max(pool) == min(pool):
            continue
        mean = sum(pool) / len(pool)
        std = math.sqrt(sum((v - mean) ** 2 for v in pool) / (len(pool) - 1))
        for i in members:
            out[i] = [(v - mean) / (std + eps) if scale else v - mean for v in returns[i]]
    return out


def token_advantages(
    trajectory: Trajectory,
    trajectory_advantage: float,
    turn_advantage: Sequence[float] | None,
    turn_weight: float = 1.0,
) -> list[float]:
    """One advantage per completion token (after the prompt); 0 outside the assistant turns.

    `turn_advantage` None: trajectory credit. Else turn k's tokens get
    trajectory_advantage + turn_weight * turn_advantage[k] (pass trajectory_advantage 0 for pure
    turn credit).
    """
    n = len(trajectory.token_ids) - trajectory.prompt_length
    if turn_advantage is None:
        mask = trajectory.policy_mask[trajectory.prompt_length :]
        return [trajectory_advantage if m else 0.0 for m in mask]
    out = [0.0] * n
    for span, adv in zip(trajectory.turns, turn_advantage, strict=True):
        value = trajectory_advantage + turn_weight * adv
        for t in range(span.start, span.end):
            out[t - trajectory.prompt_length] = value
    return out
