"""`monitors:`: the detectors for collapse, reward hacking, the Echo Trap, KL blow-up, non-finite values and sampler mismatch."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
)

from rlvr.config.base import _Section

MonitorAction = Literal["warn", "stop", "mitigate"]


class _Monitor(_Section):
    enabled: bool = Field(True, description="Evaluate this monitor's rules every step.")
    action: MonitorAction = Field(
        "warn",
        description="warn: log and print; stop: finish the step, save a checkpoint, end the run; "
        "mitigate: change the config from the next step (docs/monitors.md says how).",
    )


class EntropyCollapseMonitor(_Monitor):
    """Policy entropy falls below a fraction of its early mean and stays there. Mitigation: StarPO-S."""

    metric: str = Field(
        "completions/neg_logprob_mean",
        description="Entropy metric watched. The default, -log p of the sampled tokens, exists for "
        "every rollout; `entropy` is null when the update skipped every row (all groups equal), "
        "which is exactly when a run has collapsed.",
    )
    early_steps: int = Field(
        5, ge=1, description="Steps (with a value) whose mean is the baseline."
    )
    fraction: float = Field(
        0.1,
        gt=0.0,
        lt=1.0,
        description="Fires below this share of the baseline. 0.1 (a 10x fall) stays quiet on the "
        "SmolLM2 demo, whose entropy falls ~5x while held-out accuracy climbs 9% -> 67%.",
    )
    patience: int = Field(5, ge=1, description="Consecutive steps below the threshold needed.")


class RewardHackingMonitor(_Monitor):
    """Train reward rising while what it should measure does not. Mitigation: raise objective.beta."""

    window: int = Field(5, ge=1, description="Steps averaged at each end of a comparison.")
    reward_rise: float = Field(
        0.2,
        gt=0.0,
        description="heldout: fires when train reward (mean over `window` steps) rose at least this "
        "since the best earlier held-out eval while eval/accuracy is not above that best + "
        "accuracy_tolerance (and that best is below 1 - accuracy_tolerance).",
    )
    accuracy_tolerance: float = Field(
        0.03,
        ge=0.0,
        description="heldout, length: an accuracy gain up to this counts as flat.",
    )
    component_rise: float = Field(
        0.2,
        gt=0.0,
        description="component: fires when a weighted reward component rose at least this since "
        "the accuracy component's best `window`-step mean while that fell by accuracy_fall.",
    )
    accuracy_fall: float = Field(
        0.1,
        gt=0.0,
        description="component: how far the accuracy component must fall below its best window.",
    )
    length_rise: float = Field(
        0.5,
        gt=0.0,
        description="length: fires when mean completion length rose by this share of its first "
        "`window` steps while the train accuracy component did not rise (accuracy_tolerance).",
    )


class EchoTrapMonitor(_Monitor):
    """RAGEN's Echo Trap (Wang et al. 2025): rewards stop varying within groups, samples repeat,
    gradients spike. Each sign is its own alert (echo_trap/...). Mitigation: StarPO-S filtering."""

    window: int = Field(5, ge=1, description="Steps averaged for the current level.")
    early_steps: int = Field(
        5, ge=1, description="Steps (with a value) whose mean is the baseline."
    )
    zero_std_frac: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="zero_variance: fires when frac_reward_zero_std averaged over `window` steps "
        "is at or above this.",
    )
    std_fraction: float = Field(
        0.25,
        gt=0.0,
        lt=1.0,
        description="std_collapse: fires when rollout/in_group_std averaged over `window` steps is "
        "below this share of its early mean (the demo's lowest is ~0.5 as groups become all-right).",
    )
    duplicate_frac: float = Field(
        0.8,
        gt=0.0,
        le=1.0,
        description="duplicates: fires when rollout/duplicate_frac averaged over `window` steps is "
        "at or above this and at least duplicate_rise above its early mean.",
    )
    duplicate_rise: float = Field(
        0.5, ge=0.0, description="duplicates: the rise over the early mean also required."
    )
    grad_window: int = Field(
        20, ge=2, description="grad_spike: previous grad norms the z-score is measured against."
    )
    grad_min_history: int = Field(
        10, ge=2, description="grad_spike: no verdict before this many previous grad norms."
    )
    grad_z: float = Field(
        6.0,
        gt=0.0,
        description="grad_spike: robust z-score (median, 1.4826 MAD) at or above this fires.",
    )


class KLBlowupMonitor(_Monitor):
    """The KL to the reference runs away (only when there is one: beta > 0). Mitigation: raise beta."""

    max_kl: float = Field(
        1.0,
        gt=0.0,
        description="Fires when the per-token KL (nats, objective.kl_estimator) is above this on "
        "`patience` consecutive steps.",
    )
    patience: int = Field(2, ge=1, description="Consecutive steps above max_kl needed.")
    jump_factor: float = Field(
        10.0,
        gt=1.0,
        description="Also fires when one step's KL is this many times the median of the previous "
        "`jump_window` steps and above min_kl.",
    )
    jump_window: int = Field(
        5, ge=1, description="Previous steps whose median a jump is judged by."
    )
    min_kl: float = Field(
        0.1, ge=0.0, description="A jump below this is ignored (tiny KLs jump harmlessly)."
    )


class NonFiniteMonitor(_Section):
    """A step whose loss or gradient was not finite: the update skipped it (update/skipped_nonfinite)."""

    enabled: bool = Field(True, description="Alert on every skipped step.")
    action: Literal["warn", "stop"] = Field(
        "warn", description="The step is already skipped; 'stop' also ends the run."
    )


class SamplerMismatchMonitor(_Section):
    """The sampler's log-probs drift from the trainer's on the same tokens: a weight sync that did not
    take, another model on the server, or numerics (docs/monitors.md argues the thresholds)."""

    enabled: bool = Field(True, description="Watch the sampler/trainer log-prob gap.")
    action: Literal["warn", "stop"] = Field(
        "warn", description="Nothing to mitigate (a broken sync is not a hyper-parameter)."
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="Which threshold applies. auto: fp32 when the trainer and the sampler are both "
        "known fp32 (model.bf16 off and an in-process or `rlvr serve` sampler), else bf16 (a vLLM "
        "or hand-started server is assumed to serve bf16; decode: fast from a bf16 weight copy "
        "samples in bf16).",
    )
    max_abs_diff_fp32: float = Field(
        1e-3,
        gt=0.0,
        description="Mean |sampler - trainer| log-prob per token that fires when both sides are "
        "fp32. Measured noise: ~4e-6; one missed sync at lr 1e-6 (SmolLM2): ~0.016.",
    )
    max_abs_diff_bf16: float = Field(
        0.1,
        gt=0.0,
        description="The same with bf16 on either side. Measured noise (SmolLM2, T 0.7): ~0.03.",
    )
    canary: bool = Field(
        True,
        description="After each weight sync to a server, score a fixed short sequence on both "
        "sides and log the gap as sync/canary_logprob_abs_diff.",
    )


class MonitorsConfig(_Section):
    """Failure-mode monitors evaluated every step on the metric history (docs/monitors.md). Each alert
    is an event row in metrics.jsonl, an `alerts/<name>` metric and a console warning."""

    enabled: bool = Field(True, description="False turns every monitor off.")
    entropy_collapse: EntropyCollapseMonitor = EntropyCollapseMonitor()
    reward_hacking: RewardHackingMonitor = RewardHackingMonitor()
    echo_trap: EchoTrapMonitor = EchoTrapMonitor()
    kl_blowup: KLBlowupMonitor = KLBlowupMonitor()
    nonfinite: NonFiniteMonitor = NonFiniteMonitor()
    sampler_mismatch: SamplerMismatchMonitor = SamplerMismatchMonitor()
    beta_factor: float = Field(
        2.0,
        gt=1.0,
        description="Mitigation: objective.beta becomes max(beta * factor, beta_floor).",
    )
    beta_floor: float = Field(
        0.04,
        gt=0.0,
        description="Beta a beta-0 run gets (DeepSeekMath's GRPO value). A full fine-tuning run "
        "started with beta 0 then loads the base model as its reference.",
    )
