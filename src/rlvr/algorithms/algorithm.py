"""What an `algorithm:` name stands for: one `Algorithm` object, built-in or your own.

An algorithm is an advantage function, a policy loss, the config defaults of its paper and two facts
the loop needs (is the advantage group-relative; does it assign credit per token itself). The
built-ins are in builtin.py; a new one is one file holding an `Algorithm`, named in a config as
`algorithm: my_algo.py:MY_ALGO` (docs/extending.md). Nothing else lists algorithms.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rlvr.algorithms.losses import PolicyLossOutput
from rlvr.records import Trajectory

__all__ = ["AdvantageBatch", "AdvantageFn", "Algorithm", "PolicyLossFn", "TokenCredit"]


@dataclass(frozen=True)
class AdvantageBatch:
    """Everything an advantage function may use about one step's trajectories, group-major.

    B = P * group_size, the G members of a group adjacent (the order `records.flatten` gives).
    `rewards_B` (float32) is each trajectory's reward as the objective sees it: the rubric's total,
    plus DAPO's overlong shaping, minus beta x its summed KL when the KL is in the reward. `valid_B`
    (bool) is False for a trajectory that did not score (a reward function raised): it must get
    advantage 0 and not move its group's baseline. `lengths_B` counts its sampled (policy) tokens,
    `turns_B` its assistant turns. `scale_rewards` is `objective.scale_rewards`: "group" (divide
    by the group std), "batch" (by the batch's) or "none"; `grpo_advantages` takes it as it is (and
    True / False as group / none). `trajectories` are the records themselves, for anything else (rewards by part,
    finish reasons, info).
    """

    rewards_B: torch.Tensor
    valid_B: torch.Tensor
    group_size: int
    lengths_B: torch.Tensor
    turns_B: torch.Tensor
    scale_rewards: bool | str
    trajectories: Sequence[Trajectory]


# One scalar advantage per trajectory, (B,); the loop spreads it over tokens (`objective.credit`).
AdvantageFn = Callable[[AdvantageBatch], torch.Tensor]
# (logprobs_B_T, old_logprobs_B_T, advantages_B_T, mask_B_T, *, epsilon, epsilon_high) -> per-token
# loss and clip indicators (rlvr.algorithms.losses): the loop weights, adds KL terms and aggregates.
PolicyLossFn = Callable[..., PolicyLossOutput]
# Per-token credit an algorithm does itself instead of one advantage per trajectory:
# "gae": from a critic's values (ppo); "reward_to_go": REINFORCE++'s per-token returns, used when the
# KL is in the reward (`objective.kl_in_reward`).
TokenCredit = Literal["gae", "reward_to_go"]


@dataclass(frozen=True)
class Algorithm:
    """One RL algorithm: what `algorithm: <name>` in a config selects.

    - `advantage`: an `AdvantageFn`; None only with `token_credit="gae"` (the critic does it).
    - `loss`: a `PolicyLossFn` (ppo_clip_loss, gspo_loss, cispo_loss or your own).
    - `defaults`: config values of its paper by section, e.g. `{"objective": {"epsilon_high": 0.28}}`,
      applied under the user's config (the user's value always wins; the saved config.yaml holds
      the effective values).
    - `group_relative`: the advantage is GRPO's (r - group mean) / group std. Turn and gigpo credit
      replace or add group-relative turn returns, so they are refused for an algorithm without it.
    - `token_credit`: see `TokenCredit`; such an algorithm accepts only `objective.credit: trajectory`.
    - `needs_critic` / `needs_teacher`: the loop builds ppo's value model / distill's teacher.
    """

    name: str
    description: str
    advantage: AdvantageFn | None
    loss: PolicyLossFn
    defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    group_relative: bool = False
    token_credit: TokenCredit | None = None
    needs_critic: bool = False
    needs_teacher: bool = False

    def __post_init__(self) -> None:
        if self.advantage is None and self.token_credit != "gae":
            raise ValueError(f"algorithm {self.name!r}: an advantage function is needed")
        if self.token_credit == "gae" and not self.needs_critic:
            raise ValueError(f"algorithm {self.name!r}: GAE credit needs a critic")
