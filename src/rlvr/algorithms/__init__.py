"""Algorithms as pure tensor functions, each registered by name; `ALGORITHMS` maps the config's
`algorithm:` key to the advantage estimator and policy loss it uses."""

from __future__ import annotations

from dataclasses import dataclass

from rlvr.algorithms.advantages import ADVANTAGE_ESTIMATORS, group_reward_std, grpo_advantages
from rlvr.algorithms.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PolicyLossOutput,
    aggregate,
    ppo_clip_loss,
)


@dataclass(frozen=True)
class AlgorithmSpec:
    """What one `algorithm:` name means: which estimator and loss, and its extra estimator options."""

    advantage: str
    policy_loss: str
    description: str


ALGORITHMS: dict[str, AlgorithmSpec] = {
    "grpo": AlgorithmSpec(
        advantage="grpo",
        policy_loss="ppo_clip",
        description="GRPO: group-relative advantages, PPO-clip token loss, optional KL to the reference",
    ),
}

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "ALGORITHMS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AlgorithmSpec",
    "PolicyLossOutput",
    "aggregate",
    "group_reward_std",
    "grpo_advantages",
    "ppo_clip_loss",
]
