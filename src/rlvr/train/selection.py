"""Between rollout and update: which groups are learned from, and the advantage of every token.

`collect_groups` applies the group filter (StarPO-S variance filtering, DAPO zero-variance drop and
dynamic sampling; rlvr.algorithms.filtering) and `assign_credit` turns rewards into per-token
advantages as `objective.credit` says (rlvr.algorithms.credit). Both are thin: the rules themselves
are pure functions with hand-worked tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rlvr.algorithms import ADVANTAGE_ESTIMATORS, group_reward_std
from rlvr.algorithms.credit import token_advantages, turn_advantages
from rlvr.algorithms.filtering import select_groups
from rlvr.config import RunConfig
from rlvr.records import Group, Trajectory, flatten


def collect_groups(
    cfg: RunConfig, sample_round: Callable[[], list[Group]]
) -> tuple[list[Group], list[Group], dict[str, float]]:
    """Sample rounds of groups and keep those the filter selects; returns (sampled, kept, metrics).

    Without dynamic sampling one round is drawn and filtered. With it (DAPO), rounds continue until
    prompts_per_step groups were kept or max_sampling_rounds is reached; at most prompts_per_step
    groups are kept. Metrics describe every sampled group, so the filter cannot hide a collapse.
    """
    f, group_size = cfg.filter, cfg.sampling.group_size
    sampled: list[Group] = []
    kept: list[Group] = []
    stds: list[float] = []  # in-group reward std of every sampled group
    rounds = 0
    while True:
        rounds += 1
        groups = sample_round()
        sampled.extend(groups)
        trajs = flatten(groups)
        std_P = group_reward_std(
            torch.tensor([t.reward for t in trajs]),
            torch.tensor([t.usable for t in trajs]),
            group_size,
        ).tolist()
        stds.extend(std_P)
        keep = select_groups(std_P, f.group_filter, f.top_p, f.top_k_fraction, f.drop_zero_std)
        kept.extend(groups[i] for i in keep)
        if not f.dynamic_sampling or len(kept) >= cfg.sampling.prompts_per_step:
            break
        if rounds >= f.max_sampling_rounds:
            break
    if f.dynamic_sampling:
        kept = kept[: cfg.sampling.prompts_per_step]
    metrics = {
        "rollout/in_group_std": sum(stds) / len(stds),
        "rollout/filter_kept_ratio": len(kept) / len(sampled),
        "rollout/sampling_rounds": float(rounds),
    }
    return sampled, kept, metrics


def assign_credit(
    trajectories: Sequence[Trajectory], cfg: RunConfig, estimator: str
) -> list[list[float]]:
    """Per-token advantages for each trajectory (completion tokens), as `objective.credit` says."""
    if not trajectories:
        return []
    obj, group_size = cfg.objective, cfg.sampling.group_size
    rewards_B = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    valid_B = torch.tensor([t.usable for t in trajectories])
    advantages_B = ADVANTAGE_ESTIMATORS[estimator](
        rewards_B, valid_B, group_size, scale_rewards=obj.scale_rewards
    ).tolist()
    if obj.credit == "trajectory":
        return [
            token_advantages(t, a, None) for t, a in zip(trajectories, advantages_B, strict=True)
        ]
    per_turn = turn_advantages(
        [list(t.turn_rewards) for t in trajectories],
        valid_B.tolist(),
        group_size,
        gamma=obj.gamma,
        scale=obj.scale_rewards,
    )
    outcome = advantages_B if obj.credit == "bi-level" else [0.0] * len(trajectories)
    return [
        token_advantages(t, a, turns, obj.turn_weight if obj.credit == "bi-level" else 1.0)
        for t, a, turns in zip(trajectories, outcome, per_turn, strict=True)
    ]
