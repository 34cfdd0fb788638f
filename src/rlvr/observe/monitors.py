"""Failure-mode monitors: rules over a run's metric history, evaluated after every step.
(At ~500 lines: new rules go in their own module and join through `Monitors(extra=...)`.)

A rule is a pure function of the history (one dict of finite metrics per step, oldest first) and its
config section: it returns a `Finding` (a one-line message and the numbers behind it) while it holds,
else None. `Monitors` keeps the history and turns a rule that *starts* to hold into an `Alert`; it
fires again only after the rule has stopped holding (`nonfinite` fires on every bad step). What an
alert does (warn, stop, mitigate) is the loop's business; `mitigation` and `apply_changes` are the
config change the `mitigate` action makes. docs/monitors.md argues every threshold and default.

Alert names (the `alerts/<name>` metric and the event row's "event" field):
    entropy_collapse       entropy below `fraction` x its early mean for `patience` steps
    reward_hacking/heldout train reward up since the best held-out eval, held-out accuracy not
    reward_hacking/component  an optimised reward component up while the accuracy component fell
    reward_hacking/length  completion length up by `length_rise` while train accuracy did not rise
    echo_trap/zero_variance   most groups' rewards all equal (frac_reward_zero_std) for `window` steps
    echo_trap/std_collapse    in-group reward std below `std_fraction` x its early mean
    echo_trap/duplicates   most samples repeat another in their group, and that share rose
    echo_trap/grad_spike   grad norm a robust z-score above the previous steps'
    kl_blowup              KL to the reference above `max_kl` for `patience` steps, or a 10x jump
    nonfinite              the update met a non-finite loss or gradient and skipped the step
    sampler_mismatch       sampler and trainer log-probs apart on the same tokens (observe/mismatch.py)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from rlvr.config import (
    EchoTrapMonitor,
    EntropyCollapseMonitor,
    KLBlowupMonitor,
    MonitorsConfig,
    RewardHackingMonitor,
    RunConfig,
)

Row = dict[str, float]  # one step: "step" and the monitored metrics that were finite
History = Sequence[Row]

# Metrics the rules read (besides the entropy metric and the reward components, set per run).
WATCHED = (
    "reward",
    "frac_reward_zero_std",
    "rollout/in_group_std",
    "rollout/duplicate_frac",
    "grad_norm",
    "kl",
    "completions/mean_length",
    "eval/accuracy",
)
# Which config change each alert's `mitigate` action makes; `nonfinite` has none (the skip is it).
MITIGATIONS = {
    "entropy_collapse": "filter",
    "reward_hacking/heldout": "beta",
    "reward_hacking/component": "beta",
    "reward_hacking/length": "beta",
    "echo_trap/zero_variance": "filter",
    "echo_trap/std_collapse": "filter",
    "echo_trap/duplicates": "filter",
    "echo_trap/grad_spike": "filter",
    "kl_blowup": "beta",
}


@dataclass(frozen=True)
class Finding:
    message: str
    evidence: dict[str, float]


@dataclass(frozen=True)
class Rule:
    """A rule defined outside this module (`Monitors(extra=...)`), with the metrics it reads."""

    name: str
    action: str
    check: Callable[[History], Finding | None]
    keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class Alert:
    """A monitor that fired at `step`; `event()` is its row in metrics.jsonl (the tracker adds step)."""

    name: str
    step: int
    message: str
    action: str
    evidence: dict[str, float] = field(default_factory=dict)

    def event(self) -> dict[str, Any]:
        evidence = {k: v for k, v in self.evidence.items() if math.isfinite(v)}
        return {
            "event": self.name,
            "action": self.action,
            "message": self.message,
            "evidence": evidence,
        }


# ------------------------------------------------------------------------------------------ helpers
def series(history: History, key: str) -> list[tuple[int, float]]:
    """(step, value) for every step that has `key`, oldest first."""
    return [(int(row["step"]), row[key]) for row in history if key in row]


def values(history: History, key: str) -> list[float]:
    return [row[key] for row in history if key in row]


def _mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


# ---------------------------------------------------------------------------------------------- rules
def entropy_collapse(history: History, c: EntropyCollapseMonitor) -> Finding | None:
    """`c.metric` on each of the last `patience` steps below `fraction` x its mean over the first
    `early_steps` steps that have it. The message says whether train reward rose meanwhile: a policy
    that converged on right answers also loses entropy (the SmolLM2 demo falls ~5x)."""
    vals = values(history, c.metric)
    if len(vals) < c.early_steps + c.patience:
        return None
    early, recent = _mean(vals[: c.early_steps]), vals[-c.patience :]
    if early <= 0 or max(recent) >= c.fraction * early:
        return None
    rewards = values(history, "reward")
    change = _mean(rewards[-c.patience :]) - _mean(rewards[: c.early_steps])
    why = (
        f"train reward rose {change:+.2f} meanwhile, so this may be convergence rather than collapse "
        "(check eval/accuracy)"
        if change > 0.05
        else "train reward did not rise: the policy is collapsing onto a few outputs"
    )
    return Finding(
        f"{c.metric} stayed below {c.fraction:.0%} of its early mean {early:.3g} for {c.patience} "
        f"steps (now {recent[-1]:.3g}); {why}",
        {
            "early_mean": early,
            "current": recent[-1],
            "ratio": recent[-1] / early,
            "reward_change": change,
        },
    )


def heldout_gap(history: History, c: RewardHackingMonitor) -> Finding | None:
    """Held-out accuracy at the latest eval not above the best earlier eval (+ accuracy_tolerance),
    that best below its ceiling 1 - accuracy_tolerance, while train reward, averaged over `window` steps, rose by at least `reward_rise` since that eval.
    The reward "at" an eval is the mean of the `window` steps up to it (the first `window` steps for
    an eval before training); the two windows must not overlap."""
    evals = series(history, "eval/accuracy")
    if len(evals) < 2:
        return None
    s1, a1 = evals[-1]
    best = max(range(len(evals) - 1), key=lambda i: (evals[i][1], -i))  # earliest of the best
    s0, a0 = evals[best]
    if a1 > a0 + c.accuracy_tolerance or a0 >= 1.0 - c.accuracy_tolerance:
        return None  # accuracy rose, or was already at its ceiling and cannot
    rewards = series(history, "reward")
    w = c.window
    n0 = sum(1 for s, _ in rewards if s <= s0)
    n1 = sum(1 for s, _ in rewards if s <= s1)
    then_end = max(n0, w)
    if n1 - w < then_end:
        return None  # not enough steps between the two evals for two separate windows
    r0 = _mean([v for _, v in rewards[then_end - w : then_end]])
    r1 = _mean([v for _, v in rewards[n1 - w : n1]])
    if r1 - r0 < c.reward_rise:
        return None
    return Finding(
        f"train reward rose {r0:.2f} -> {r1:.2f} since step {s0}, but held-out accuracy is "
        f"{a1:.1%} vs {a0:.1%} then: the reward may pay for something other than the task",
        {
            "reward_then": r0,
            "reward_now": r1,
            "accuracy_then": a0,
            "accuracy_now": a1,
            "since_step": s0,
        },
    )


def component_divergence(
    history: History, c: RewardHackingMonitor, accuracy: str, components: Sequence[str]
) -> Finding | None:
    """The train accuracy component (`rewards/<accuracy>/mean`), averaged over the last `window`
    steps, at least `accuracy_fall` below its best earlier `window`-step mean, while some optimised
    component rose by at least `component_rise` since that best window."""
    acc_key = f"rewards/{accuracy}/mean"
    rows = [row for row in history if acc_key in row]
    w = c.window
    if len(rows) < 2 * w:
        return None

    def window_mean(key: str, lo: int) -> float:
        return _mean([row[key] for row in rows[lo : lo + w] if key in row])

    now = len(rows) - w
    peak = max(range(now - w + 1), key=lambda lo: (window_mean(acc_key, lo), -lo))
    acc_then, acc_now = window_mean(acc_key, peak), window_mean(acc_key, now)
    if acc_now > acc_then - c.accuracy_fall:
        return None
    for name in components:
        key = f"rewards/{name}/mean"
        then, current = window_mean(key, peak), window_mean(key, now)
        if current - then >= c.component_rise:  # False when either is NaN (no values)
            return Finding(
                f"reward component '{name}' rose {then:.2f} -> {current:.2f} while the accuracy "
                f"component '{accuracy}' fell {acc_then:.2f} -> {acc_now:.2f}",
                {
                    "component_then": then,
                    "component_now": current,
                    "accuracy_then": acc_then,
                    "accuracy_now": acc_now,
                },
            )
    return None


def length_without_accuracy(
    history: History, c: RewardHackingMonitor, accuracy: str
) -> Finding | None:
    """completions/mean_length over the last `window` steps at least (1 + length_rise) x its mean
    over the first `window`, while the train accuracy component rose by no more than
    accuracy_tolerance between the same windows."""
    acc_key = f"rewards/{accuracy}/mean"
    rows = [row for row in history if "completions/mean_length" in row and acc_key in row]
    w = c.window
    if len(rows) < 2 * w:
        return None
    len0 = _mean([row["completions/mean_length"] for row in rows[:w]])
    len1 = _mean([row["completions/mean_length"] for row in rows[-w:]])
    acc0 = _mean([row[acc_key] for row in rows[:w]])
    acc1 = _mean([row[acc_key] for row in rows[-w:]])
    if len0 <= 0 or len1 < (1 + c.length_rise) * len0 or acc1 - acc0 > c.accuracy_tolerance:
        return None
    return Finding(
        f"completions grew {len0:.0f} -> {len1:.0f} tokens while '{accuracy}' went "
        f"{acc0:.2f} -> {acc1:.2f}: length is being rewarded, not accuracy",
        {"length_then": len0, "length_now": len1, "accuracy_then": acc0, "accuracy_now": acc1},
    )


def zero_variance(history: History, c: EchoTrapMonitor) -> Finding | None:
    """frac_reward_zero_std averaged over the last `window` steps at or above `zero_std_frac`."""
    vals = values(history, "frac_reward_zero_std")
    if len(vals) < c.window:
        return None
    frac = _mean(vals[-c.window :])
    if frac < c.zero_std_frac:
        return None
    reward = _mean(values(history, "reward")[-c.window :])
    return Finding(
        f"{frac:.0%} of groups had all-equal rewards over the last {c.window} steps (mean reward "
        f"{reward:.2f}): no learning signal; a constant or saturated reward, or an Echo Trap",
        {"frac_reward_zero_std": frac, "reward": reward},
    )


def std_collapse(history: History, c: EchoTrapMonitor) -> Finding | None:
    """rollout/in_group_std averaged over the last `window` steps below `std_fraction` x its mean
    over the first `early_steps` steps (quiet when that early mean is 0: zero_variance covers it)."""
    vals = values(history, "rollout/in_group_std")
    if len(vals) < c.early_steps + c.window:
        return None
    early, now = _mean(vals[: c.early_steps]), _mean(vals[-c.window :])
    if early <= 1e-8 or now >= c.std_fraction * early:
        return None
    return Finding(
        f"in-group reward std fell to {now:.3g} from an early {early:.3g} "
        f"({now / early:.0%}, threshold {c.std_fraction:.0%}): samples stopped disagreeing",
        {"early_mean": early, "current": now},
    )


def duplicates(history: History, c: EchoTrapMonitor) -> Finding | None:
    """rollout/duplicate_frac averaged over the last `window` steps at or above `duplicate_frac` and
    at least `duplicate_rise` above its mean over the first `early_steps` steps."""
    vals = values(history, "rollout/duplicate_frac")
    if len(vals) < c.early_steps + c.window:
        return None
    early, now = _mean(vals[: c.early_steps]), _mean(vals[-c.window :])
    if now < c.duplicate_frac or now - early < c.duplicate_rise:
        return None
    reward = _mean(values(history, "reward")[-c.window :])
    return Finding(
        f"{now:.0%} of samples repeat another in their group (early {early:.0%}; mean reward "
        f"{reward:.2f}): the policy echoes itself, which is fine only if those answers are right",
        {"early_mean": early, "current": now, "reward": reward},
    )


def grad_spike(history: History, c: EchoTrapMonitor) -> Finding | None:
    """This step's grad norm at least `grad_z` robust z-scores above the previous `grad_window`
    norms: z = (g - median) / (1.4826 MAD), the scale floored at 5% of the median so that nearly
    constant norms do not turn small moves into spikes. Zero norms (every row skipped: no gradient)
    are not measurements and are left out."""
    if not history or history[-1].get("grad_norm", 0.0) <= 0:
        return None
    norms = [v for v in values(history, "grad_norm") if v > 0]
    current, previous = norms[-1], norms[:-1][-c.grad_window :]
    if len(previous) < c.grad_min_history:
        return None
    median = statistics.median(previous)
    mad = statistics.median(abs(v - median) for v in previous)
    scale = max(1.4826 * mad, 0.05 * median)
    z = (current - median) / scale
    if z < c.grad_z:
        return None
    return Finding(
        f"grad norm {current:.3g} is {z:.1f} robust z-scores above the previous {len(previous)} "
        f"steps (median {median:.3g})",
        {"grad_norm": current, "median": median, "z": z},
    )


def kl_blowup(history: History, c: KLBlowupMonitor) -> Finding | None:
    """KL above `max_kl` on each of the last `patience` steps, or this step's KL above `min_kl` and
    at least `jump_factor` x the median of the previous `jump_window` steps. Quiet without a KL
    (beta = 0 has no reference)."""
    if not history or "kl" not in history[-1]:
        return None
    kls = values(history, "kl")
    current = kls[-1]
    if len(kls) >= c.patience and min(kls[-c.patience :]) > c.max_kl:
        return Finding(
            f"KL to the reference {current:.3g} above {c.max_kl:g} for {c.patience} steps: the "
            "policy is running away from its reference",
            {"kl": current, "threshold": c.max_kl},
        )
    previous = kls[:-1][-c.jump_window :]
    if len(previous) == c.jump_window and current > c.min_kl:
        median = statistics.median(previous)
        if current >= c.jump_factor * median:
            return Finding(
                f"KL to the reference jumped to {current:.3g} from a median {median:.3g} over the "
                f"previous {c.jump_window} steps",
                {"kl": current, "median": median},
            )
    return None


def nonfinite(history: History) -> Finding | None:
    """The update of this step met a non-finite loss or gradient and skipped it."""
    if not history or history[-1].get("nonfinite", 0.0) <= 0:
        return None
    skipped = history[-1]["nonfinite"]
    return Finding(
        f"non-finite loss or gradient: {skipped:.0f} optimizer step(s) skipped, weights unchanged",
        {"skipped": skipped},
    )


# ------------------------------------------------------------------------------------------- monitors
class Monitors:
    """The history of a run and which rules hold; `observe(step, metrics)` after every step.

    `accuracy` names the reward component read as accuracy (eval.metric; None when a mixture's sources
    disagree, which turns off the component and length rules) and `optimised` the other components
    with a nonzero weight. The history is rebuilt from metrics.jsonl on resume (`replay`); the config
    changes made by mitigations travel in the checkpoint (`state_dict`).
    """

    def __init__(
        self,
        cfg: MonitorsConfig,
        *,
        accuracy: str | None = None,
        optimised: Sequence[str] = (),
        extra: Sequence[Rule | None] = (),
    ) -> None:
        self.cfg = cfg
        self.accuracy = accuracy
        self.optimised = [n for n in optimised if n != accuracy]
        self.history: list[Row] = []
        self.active: set[str] = set()
        self.changes: dict[str, Any] = {}  # every mitigation so far, {"objective.beta": 0.04, ...}
        names = [*self.optimised, *([accuracy] if accuracy else [])]
        self.keys = {*WATCHED, cfg.entropy_collapse.metric, *(f"rewards/{n}/mean" for n in names)}
        self.extra = [r for r in extra if r is not None]
        self.keys.update(k for r in self.extra for k in r.keys)

    def rules(self) -> list[tuple[str, str, Callable[[History], Finding | None]]]:
        """(alert name, action, rule) for every enabled rule."""
        c, acc = self.cfg, self.accuracy
        ec, rh, et, kl = c.entropy_collapse, c.reward_hacking, c.echo_trap, c.kl_blowup
        out: list[tuple[str, str, Callable[[History], Finding | None]]] = []
        if ec.enabled:
            out.append(("entropy_collapse", ec.action, lambda h: entropy_collapse(h, ec)))
        if rh.enabled:
            out.append(("reward_hacking/heldout", rh.action, lambda h: heldout_gap(h, rh)))
            if acc is not None:
                out.append(
                    (
                        "reward_hacking/component",
                        rh.action,
                        lambda h: component_divergence(h, rh, acc, self.optimised),
                    )
                )
                out.append(
                    (
                        "reward_hacking/length",
                        rh.action,
                        lambda h: length_without_accuracy(h, rh, acc),
                    )
                )
        if et.enabled:
            out += [
                ("echo_trap/zero_variance", et.action, lambda h: zero_variance(h, et)),
                ("echo_trap/std_collapse", et.action, lambda h: std_collapse(h, et)),
                ("echo_trap/duplicates", et.action, lambda h: duplicates(h, et)),
                ("echo_trap/grad_spike", et.action, lambda h: grad_spike(h, et)),
            ]
        if kl.enabled:
            out.append(("kl_blowup", kl.action, lambda h: kl_blowup(h, kl)))
        if c.nonfinite.enabled:
            out.append(("nonfinite", c.nonfinite.action, nonfinite))
        return out + [(r.name, r.action, r.check) for r in self.extra]

    def observe(self, step: int, metrics: Mapping[str, Any]) -> list[Alert]:
        """Add this step's metrics (merged into the last row when it is the same step, e.g. the final
        eval) and return the alerts that fire now."""
        self._record(step, metrics)
        if not self.cfg.enabled:
            return []
        alerts = []
        for name, action, rule in self.rules():
            finding = rule(self.history)
            if finding is None:
                self.active.discard(name)
                continue
            if name in self.active and name != "nonfinite":
                continue  # still holding since it fired: one alert per episode
            self.active.add(name)
            alerts.append(Alert(name, step, finding.message, action, finding.evidence))
        return alerts

    def replay(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Rebuild history and rule states from metrics.jsonl rows (a resumed run); events ignored."""
        for row in rows:
            if "event" not in row and "step" in row:
                self.observe(int(row["step"]), row)

    def state_dict(self) -> dict[str, Any]:
        return {"changes": dict(self.changes)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.changes = dict(state.get("changes", {}))

    def _record(self, step: int, metrics: Mapping[str, Any]) -> None:
        row: Row = {
            k: float(v)
            for k, v in metrics.items()
            if k in self.keys and _is_number(v) and math.isfinite(v)
        }
        # The update skips a step with a non-finite loss or gradient and counts it; a NaN loss is
        # checked too, in case an update path did not count it.
        loss, skipped = metrics.get("loss"), metrics.get("update/skipped_nonfinite")
        count = float(skipped) if _is_number(skipped) and math.isfinite(skipped) else 0.0
        if count > 0 or (_is_number(loss) and not math.isfinite(loss)):
            row["nonfinite"] = max(count, 1.0)
        if self.history and self.history[-1]["step"] == step:
            self.history[-1].update(row)
        else:
            self.history.append({"step": float(step), **row})


def _is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


# ----------------------------------------------------------------------------------------- mitigation
def mitigation(cfg: RunConfig, name: str) -> dict[str, Any]:
    """The config change the `mitigate` action of alert `name` makes, as {"section.field": value};
    empty when there is nothing left to change.

    filter: StarPO-S (RAGEN, Wang et al. 2025): keep the groups holding top_p of the reward std
    (`filter.group_filter: std-top-p`), which RAGEN found delays the Echo Trap and entropy collapse.
    beta: objective.beta becomes max(beta * monitors.beta_factor, monitors.beta_floor): a stronger
    pull towards the reference. A full fine-tuning run started with beta 0 has no reference; the loop
    then loads the base model as one (as a run started with beta > 0 would have)."""
    kind = MITIGATIONS.get(name)
    if kind == "filter":
        return {} if cfg.filter.group_filter != "none" else {"filter.group_filter": "std-top-p"}
    if kind == "beta":
        m = cfg.monitors
        return {"objective.beta": max(cfg.objective.beta * m.beta_factor, m.beta_floor)}
    return {}


def apply_changes(cfg: RunConfig, changes: Mapping[str, Any]) -> RunConfig:
    """`cfg` with {"section.field": value} changes applied (a new frozen config)."""
    for key, value in changes.items():
        section, name = key.split(".")
        part = getattr(cfg, section).model_copy(update={name: value})
        cfg = cfg.model_copy(update={section: part})
    return cfg
