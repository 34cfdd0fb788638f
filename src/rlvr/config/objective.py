"""`objective:`, `critic:` and `distill:`: the loss and its guard rails."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    model_validator,
)

from rlvr.config.base import _Section
from rlvr.config.model import LoraConfig


class ObjectiveConfig(_Section):
    """The objective and its guard rails. Defaults follow DeepSeekMath's GRPO except where a comment says otherwise."""

    epsilon: float = Field(0.2, gt=0.0, description="PPO clip range, lower side.")
    epsilon_high: float | None = Field(
        None, description="Upper clip (DAPO 'clip-higher' uses 0.28); None = epsilon."
    )
    beta: float = Field(
        0.0,
        ge=0.0,
        description="KL penalty weight. 0 (no reference model) as in DAPO/Dr.GRPO and TRL's default.",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="What the centred reward is divided by, as TRL spells it: group, the group's "
        "std (GRPO); batch, the std of the whole batch's rewards (Hu 2025; trajectory credit "
        "only); none, nothing: the mean-only advantage of Dr.GRPO (Liu et al. 2025) and GiGPO's "
        "mean_norm, so a near-constant group (one -0.1 move among 8 failures) stays as quiet as "
        "its reward spread instead of as loud as a success. true / false mean group / none.",
    )
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        Field(
            "token-mean",
            description="token-mean is DAPO's (TRL's default); GRPO's paper used seq-mean-token-mean.",
        )
    )
    num_iterations: int = Field(
        1, ge=1, description="Policy updates per generated batch (mu in GRPO)."
    )
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus weight.")
    credit: Literal["trajectory", "turn", "bi-level", "gigpo"] = Field(
        "trajectory",
        description="trajectory: every policy token gets the trajectory's group advantage; turn: "
        "each turn gets the group advantage of its discounted return; bi-level: both, summed; "
        "gigpo: the trajectory's advantage plus turn_weight x the turn's return normalised among "
        "the group's turns that acted from the same state (GiGPO anchor states).",
    )
    gamma: float = Field(
        1.0, ge=0.0, le=1.0, description="Discount across turns (turn, bi-level, gigpo credit)."
    )
    turn_weight: float = Field(
        1.0,
        ge=0.0,
        description="Weight of the turn advantage in bi-level credit (omega of the step "
        "advantage in gigpo).",
    )
    kl_in_reward: bool = Field(
        False,
        description="Put the KL penalty in the reward (per token, InstructGPT/REINFORCE++/PPO) "
        "instead of in the loss (GRPO).",
    )
    tis_cap: float | None = Field(
        None,
        gt=0.0,
        description="Truncated importance sampling: weight each token by min(pi_old / "
        "pi_behaviour, cap) when another engine generates (Yao et al. 2025; 2.0 is usual). "
        "Unless set (null turns it off), 2.0 with a server backend, async rollouts, or decode: "
        "fast from a bf16 weight copy (generator.decode_dtype).",
    )
    off_policy_correction: (
        Literal[
            "tis_token", "tis_sequence", "mis_token", "mis_sequence", "icepop", "geo_mask", "none"
        ]
        | None
    ) = Field(
        None,
        description="How tokens another policy sampled count (rlvr/algorithms/off_policy.py): "
        "tis_ truncates the ratio pi_old / pi_behaviour at tis_cap, mis_ drops tokens (sequences) "
        "above it, per token or per sequence (product of ratios); icepop drops tokens whose ratio "
        "leaves off_policy_bounds; geo_mask drops sequences whose geometric-mean ratio leaves them. "
        "Unset: tis_token when tis_cap is set, else none (GSPO weighs tis_token per sequence).",
    )
    off_policy_bounds: tuple[float, float] | None = Field(
        None,
        description="[lo, hi] of icepop and geo_mask; None = [0.5, 5] for icepop (IcePop's), "
        "[0.999, 1.001] for geo_mask.",
    )
    overlong_buffer_fraction: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="DAPO soft overlong punishment: completions in the last fraction of the "
        "length limit lose up to overlong_penalty (linear), past it the full penalty.",
    )
    overlong_penalty: float = Field(1.0, ge=0.0, description="Size of the overlong punishment.")
    mask_truncated: bool = Field(
        False, description="DAPO overlong filtering: truncated completions get no loss."
    )
    placebo: Literal["none", "shuffle_within_group"] = Field(
        "none",
        description="A control, never a training mode: shuffle_within_group gives each trajectory "
        "the reward of a random member of its own group before credit (rlvr.algorithms.placebo), "
        "so the update has a real step's size and no information. Train one run so beside a real "
        "one from the same checkpoint and seed: the real run's gain over it is the reward's.",
    )
    gae_lambda: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda (ppo).")
    whiten_advantages: bool = Field(
        True, description="ppo / token-level REINFORCE++: normalise advantages over the batch."
    )

    @model_validator(mode="before")
    @classmethod
    def _scale_rewards_as_trl_takes_it(cls, data: Any) -> Any:
        # TRL took a bool before "group" / "batch" / "none": True is "group", False is "none".
        if isinstance(data, dict) and isinstance(data.get("scale_rewards"), bool):
            data = {**data, "scale_rewards": "group" if data["scale_rewards"] else "none"}
        return data

    @model_validator(mode="after")
    def _check_off_policy(self) -> ObjectiveConfig:
        if self.scale_rewards == "batch" and self.credit != "trajectory":
            raise ValueError(
                f"scale_rewards 'batch' divides trajectory advantages by the batch std; credit "
                f"{self.credit!r} normalises within groups: use 'group' or 'none'"
            )
        capped = ("tis_token", "tis_sequence", "mis_token", "mis_sequence")
        if self.off_policy_correction in capped and self.tis_cap is None:
            raise ValueError(f"off_policy_correction {self.off_policy_correction} needs tis_cap")
        lo, hi = self.off_policy_bounds or (0.5, 5.0)
        if not 0.0 < lo < hi:
            raise ValueError(f"off_policy_bounds must satisfy 0 < lo < hi, got [{lo}, {hi}]")
        return self


class CriticConfig(_Section):
    """The value model of `algorithm: ppo` (a transformer with a scalar head)."""

    model: str | None = Field(
        None, description="Model to start the critic from; None = the policy's."
    )
    learning_rate: float = Field(1e-5, gt=0.0, description="The critic's own learning rate.")
    value_clip: float | None = Field(
        0.2, gt=0.0, description="Clip value updates to old +- this (PPO2); None = no clipping."
    )
    warmup_steps: int = Field(
        0, ge=0, description="Steps that train only the critic before the policy moves."
    )
    lora: LoraConfig = LoraConfig()


class DistillConfig(_Section):
    """On-policy distillation (`algorithm: distill`): the student samples, the teacher grades every token."""

    teacher: str | None = Field(None, description="Teacher model: alias, directory or hub id.")
    reward_weight: float = Field(
        0.0,
        ge=0.0,
        description="Also follow the verifiable reward: loss = KL + reward_weight * GRPO loss.",
    )
