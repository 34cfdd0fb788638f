"""Algorithms as pure tensor functions, each registered by name; `ALGORITHMS` maps the config's
`algorithm:` key to the advantage estimator and policy loss it uses."""

from __future__ import annotations

from dataclasses import dataclass

from rlvr.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    group_reward_std,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
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


@dataclass(frozen=True)
class AlgorithmSpec:
    """What one `algorithm:` name means: its advantage estimator, policy loss, and what it needs.

    `advantage` names an entry of ADVANTAGE_ESTIMATORS (one scalar per trajectory), or "gae" (per
    token, from a critic). `policy_loss` names an entry of POLICY_LOSSES. Config defaults per name
    live in rlvr.config.ALGORITHM_DEFAULTS; the objective and paper of each in docs/algorithms.md.
    """

    advantage: str
    policy_loss: str
    description: str
    needs_critic: bool = False
    needs_teacher: bool = False


ALGORITHMS: dict[str, AlgorithmSpec] = {
    "grpo": AlgorithmSpec(
        "grpo",
        "ppo_clip",
        "GRPO: group-relative advantages, PPO-clip token loss (Shao et al. 2024)",
    ),
    "dr_grpo": AlgorithmSpec(
        "grpo", "ppo_clip", "Dr.GRPO: no std scaling, constant normaliser (Liu et al. 2025)"
    ),
    "dapo": AlgorithmSpec(
        "grpo",
        "ppo_clip",
        "DAPO: clip-higher, token-mean, overlong shaping, dynamic sampling (Yu et al. 2025)",
    ),
    "gspo": AlgorithmSpec(
        "grpo", "gspo", "GSPO: sequence-level ratio and clipping (Zheng et al. 2025)"
    ),
    "cispo": AlgorithmSpec(
        "grpo",
        "cispo",
        "CISPO: clipped IS weight on a REINFORCE loss (MiniMax-M1, Chen et al. 2025)",
    ),
    "rloo": AlgorithmSpec(
        "rloo", "ppo_clip", "RLOO: leave-one-out baseline (Ahmadian et al. 2024)"
    ),
    "reinforce_pp": AlgorithmSpec(
        "reinforce_pp",
        "ppo_clip",
        "REINFORCE++: KL in the reward, batch-normalised advantages (Hu 2025)",
    ),
    "reinforce_pp_baseline": AlgorithmSpec(
        "reinforce_pp_baseline",
        "ppo_clip",
        "REINFORCE++-baseline: group mean baseline, batch std scaling (Hu 2025)",
    ),
    "ppo": AlgorithmSpec(
        "gae",
        "ppo_clip",
        "PPO: learned critic, GAE per token, clipped value loss (Schulman et al. 2017)",
        needs_critic=True,
    ),
    "distill": AlgorithmSpec(
        "grpo",
        "ppo_clip",
        "On-policy distillation: reverse KL to a teacher on the student's samples (Agarwal et al. 2024)",
        needs_teacher=True,
    ),
}

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "ALGORITHMS",
    "DPO_LOSS_TYPES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AlgorithmSpec",
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
