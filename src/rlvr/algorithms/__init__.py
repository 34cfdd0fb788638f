"""Algorithms as pure tensor functions; an `Algorithm` (algorithm.py) bundles the advantage function,
policy loss and defaults one `algorithm:` name stands for, and `ALGORITHMS` holds the built-ins."""

from __future__ import annotations

from rlvr.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    group_reward_std,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from rlvr.algorithms.algorithm import AdvantageBatch, AdvantageFn, Algorithm, PolicyLossFn
from rlvr.algorithms.builtin import BUILTIN_ALGORITHMS
from rlvr.algorithms.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PolicyLossOutput,
    aggregate,
    cispo_loss,
    full_reverse_kl,
    gspo_loss,
    ppo_clip_loss,
    truncated_importance_weights,
    zero_outside,
)
from rlvr.algorithms.preference import (
    DPO_LOSS_TYPES,
    bradley_terry_loss,
    dpo_loss,
    sft_loss,
)

# The built-in algorithms by name; rlvr.registry.ALGORITHMS also finds files and plug-ins.
ALGORITHMS = BUILTIN_ALGORITHMS

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "ALGORITHMS",
    "BUILTIN_ALGORITHMS",
    "DPO_LOSS_TYPES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdvantageBatch",
    "AdvantageFn",
    "Algorithm",
    "PolicyLossFn",
    "PolicyLossOutput",
    "aggregate",
    "bradley_terry_loss",
    "cispo_loss",
    "dpo_loss",
    "full_reverse_kl",
    "group_reward_std",
    "grpo_advantages",
    "gspo_loss",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "sft_loss",
    "truncated_importance_weights",
    "zero_outside",
]
