"""The built-in algorithms, one `Algorithm` each: the names `algorithm:` accepts without a path.

Each entry is the whole algorithm: its advantage function, policy loss, the defaults of its paper
(applied under the user's config; anything absent keeps the field's default) and its flags. The
objective and paper of each are in docs/algorithms.md. A new algorithm is not added here but written
as one file of its own (docs/extending.md); rlvr.registry finds both the same way.
"""

from __future__ import annotations

from typing import Any

import torch

from rlvr.algorithms.advantages import (
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from rlvr.algorithms.algorithm import AdvantageBatch, Algorithm
from rlvr.algorithms.losses import cispo_loss, gspo_loss, ppo_clip_loss
from rlvr.errors import ConfigError

__all__ = ["BUILTIN_ALGORITHMS", "as_algorithm"]


def grpo_advantage(batch: AdvantageBatch) -> torch.Tensor:
    """GRPO's group-relative advantage (rlvr.algorithms.advantages.grpo_advantages); without std
    scaling (`objective.scale_rewards: none`) Dr.GRPO's; `batch`, TRL's batch std."""
    return grpo_advantages(
        batch.rewards_B, batch.valid_B, batch.group_size, scale_rewards=batch.scale_rewards
    )


def rloo_advantage(batch: AdvantageBatch) -> torch.Tensor:
    """The leave-one-out baseline (rlvr.algorithms.advantages.rloo_advantages)."""
    return rloo_advantages(batch.rewards_B, batch.valid_B, batch.group_size)


def reinforce_pp_advantage(batch: AdvantageBatch) -> torch.Tensor:
    """REINFORCE++'s batch-whitened reward (its outcome form; per token when the KL is in the
    reward, `token_credit="reward_to_go"`)."""
    return reinforce_pp_advantages(batch.rewards_B, batch.valid_B, batch.group_size)


def reinforce_pp_baseline_advantage(batch: AdvantageBatch) -> torch.Tensor:
    """REINFORCE++-baseline: the group mean subtracted, then the batch std divided out."""
    return reinforce_pp_baseline_advantages(batch.rewards_B, batch.valid_B, batch.group_size)


# Hu 2025: KL in the reward (k1 per token), batch-level normalisation.
_KL_IN_REWARD_K1: dict[str, dict[str, Any]] = {
    "objective": {"kl_in_reward": True, "kl_estimator": "k1"}
}

_ALL = (
    Algorithm(
        "grpo",
        "GRPO: group-relative advantages, PPO-clip token loss (Shao et al. 2024)",
        grpo_advantage,
        ppo_clip_loss,
        group_relative=True,
    ),
    Algorithm(
        "dr_grpo",
        "Dr.GRPO: no std scaling, constant normaliser (Liu et al. 2025)",
        grpo_advantage,
        ppo_clip_loss,
        # No std scaling, a constant normaliser instead of per-sequence length.
        {"objective": {"scale_rewards": "none", "loss_aggregation": "seq-mean-token-sum-norm"}},
        group_relative=True,
    ),
    Algorithm(
        "dapo",
        "DAPO: clip-higher, token-mean, overlong shaping, dynamic sampling (Yu et al. 2025)",
        grpo_advantage,
        ppo_clip_loss,
        {
            "objective": {
                "epsilon": 0.2,
                "epsilon_high": 0.28,
                "loss_aggregation": "token-mean",
                "overlong_buffer_fraction": 0.2,
            },
            "filter": {"drop_zero_std": True, "dynamic_sampling": True},
        },
        group_relative=True,
    ),
    Algorithm(
        "gspo",
        "GSPO: sequence-level ratio and clipping (Zheng et al. 2025)",
        grpo_advantage,
        gspo_loss,
        # A sequence-level ratio with a tiny clip range, sequence-mean loss.
        {
            "objective": {
                "epsilon": 3e-4,
                "epsilon_high": 4e-4,
                "loss_aggregation": "seq-mean-token-mean",
            }
        },
        group_relative=True,
    ),
    Algorithm(
        "cispo",
        "CISPO: clipped IS weight on a REINFORCE loss (MiniMax-M1, Chen et al. 2025)",
        grpo_advantage,
        cispo_loss,
        # No lower bound on the IS weight, only an upper one.
        {"objective": {"epsilon": 1.0, "epsilon_high": 0.28, "loss_aggregation": "token-mean"}},
        group_relative=True,
    ),
    Algorithm(
        "rloo",
        "RLOO: leave-one-out baseline (Ahmadian et al. 2024)",
        rloo_advantage,
        ppo_clip_loss,
        # No std scaling, sequence-level REINFORCE.
        {"objective": {"scale_rewards": "none", "loss_aggregation": "seq-mean-token-sum-norm"}},
    ),
    Algorithm(
        "reinforce_pp",
        "REINFORCE++: KL in the reward, batch-normalised advantages (Hu 2025)",
        reinforce_pp_advantage,
        ppo_clip_loss,
        _KL_IN_REWARD_K1,
        token_credit="reward_to_go",
    ),
    Algorithm(
        "reinforce_pp_baseline",
        "REINFORCE++-baseline: group mean baseline, batch std scaling (Hu 2025)",
        reinforce_pp_baseline_advantage,
        ppo_clip_loss,
        _KL_IN_REWARD_K1,
    ),
    Algorithm(
        "ppo",
        "PPO: learned critic, GAE per token, clipped value loss (Schulman et al. 2017)",
        None,
        ppo_clip_loss,
        # GAE (2016) with gamma 1 for LM episodes. The KL per token in the reward, k1, as
        # InstructGPT (Ouyang et al. 2022): as a loss term k1's expected gradient is 0, so with the
        # KL in the loss beta would pull nothing.
        {
            "objective": {
                "gae_lambda": 0.95,
                "gamma": 1.0,
                "kl_estimator": "k1",
                "kl_in_reward": True,
            }
        },
        token_credit="gae",
        needs_critic=True,
    ),
    Algorithm(
        "distill",
        "On-policy distillation: reverse KL to a teacher on the student's samples "
        "(Agarwal et al. 2024)",
        grpo_advantage,
        ppo_clip_loss,
        {"objective": {"loss_aggregation": "token-mean"}},
        group_relative=True,
        needs_teacher=True,
    ),
)

BUILTIN_ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in _ALL}


def as_algorithm(obj: Any, ref: str) -> Algorithm:
    """`obj` if it is an `Algorithm` (rlvr.registry's check for `algorithm:` names)."""
    if not isinstance(obj, Algorithm):
        raise ConfigError(
            f"algorithm {ref!r} is a {type(obj).__name__}, not an rlvr.algorithms.Algorithm"
        )
    return obj
