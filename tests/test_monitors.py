"""Failure-mode monitors: each rule on hand-built histories (fires at its threshold, not below it,
quiet in warm-up), then each failure provoked on the tiny model with the matching alert asserted."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from rlvr.config import (
    EchoTrapMonitor,
    EntropyCollapseMonitor,
    KLBlowupMonitor,
    MonitorsConfig,
    RewardHackingMonitor,
    RunConfig,
    load_config,
)
from rlvr.errors import ConfigError
from rlvr.observe import monitors as mon
from rlvr.observe.metrics import WALL_CLOCK_METRICS, duplicate_fraction
from rlvr.observe.monitors import Monitors, apply_changes, mitigation
from rlvr.observe.tracking import read_metrics
from rlvr.records import Group, Task, Trajectory
from rlvr.train.loop import train

# --------------------------------------------------------------------------- hand-built histories


def history(**columns: list[float | None]) -> list[dict[str, float]]:
    """Rows for steps 1..n; keyword names use '__' for '/' (rollout__in_group_std); None = missing."""
    n = max(len(v) for v in columns.values())
    rows = []
    for i in range(n):
        row = {"step": float(i + 1)}
        for name, col in columns.items():
            if i < len(col) and col[i] is not None:
                row[name.replace("__", "/")] = float(col[i])  # type: ignore[arg-type]
        rows.append(row)
    return rows


EC = EntropyCollapseMonitor(metric="entropy")  # early_steps 5, fraction 0.1, patience 5
RH = RewardHackingMonitor()  # window 5, reward_rise 0.2, tolerance 0.03, fall 0.1, length 0.5
ET = EchoTrapMonitor()  # window 5, early 5, zero_std 0.9, std 0.25, dup 0.8 / +0.5, grad z 6
KL = KLBlowupMonitor()  # max_kl 1 for 2 steps, or 10x the median of 5 and > 0.1


def test_entropy_collapse_fires_below_a_tenth_of_the_early_mean_for_five_steps() -> None:
    # early mean 1.0; threshold 0.1 x 1.0 = 0.1, strictly below
    assert mon.entropy_collapse(history(entropy=[1.0] * 5 + [0.09] * 5), EC) is not None
    assert mon.entropy_collapse(history(entropy=[1.0] * 5 + [0.1] * 5), EC) is None
    # patience: 4 low steps, or one step back above, is not yet a collapse
    assert mon.entropy_collapse(history(entropy=[1.0] * 5 + [0.05] * 4), EC) is None
    assert mon.entropy_collapse(history(entropy=[1.0] * 5 + [0.05] * 4 + [0.2]), EC) is None
    # warm-up: 9 values cannot fill early_steps + patience, however low
    assert mon.entropy_collapse(history(entropy=[1.0] * 4 + [0.0] * 5), EC) is None


def test_entropy_collapse_skips_missing_steps_and_says_whether_reward_rose() -> None:
    ent = [1.0] * 5 + [None, 0.05, None, 0.05, 0.05, 0.05, 0.05]
    rising = mon.entropy_collapse(history(entropy=ent, reward=[0.1] * 5 + [0.8] * 7), EC)
    flat = mon.entropy_collapse(history(entropy=ent, reward=[0.1] * 12), EC)
    assert rising is not None and "convergence" in rising.message
    assert flat is not None and "collapsing" in flat.message
    assert flat.evidence["early_mean"] == 1.0 and flat.evidence["current"] == 0.05


def evals_and_rewards(evals: dict[int, float], rewards: list[float]) -> list[dict[str, float]]:
    rows = [{"step": 0.0, "eval/accuracy": evals[0]}] if 0 in evals else []
    for i, r in enumerate(rewards, start=1):
        rows.append(
            {"step": float(i), "reward": r, **({"eval/accuracy": evals[i]} if i in evals else {})}
        )
    return rows


def test_heldout_rule_reward_up_accuracy_flat() -> None:
    # reward at the step-0 eval = first 5 steps (0.1), at step 10 = steps 6-10: rise 0.25 >= 0.2
    fires = evals_and_rewards({0: 0.3, 10: 0.3}, [0.1] * 5 + [0.35] * 5)
    found = mon.heldout_gap(fires, RH)
    assert found is not None and found.evidence["since_step"] == 0
    assert mon.heldout_gap(evals_and_rewards({0: 0.3, 10: 0.3}, [0.1] * 5 + [0.29] * 5), RH) is None
    # accuracy rose more than the tolerance (0.03): the reward is doing its job
    assert (
        mon.heldout_gap(evals_and_rewards({0: 0.3, 10: 0.34}, [0.1] * 5 + [0.35] * 5), RH) is None
    )
    # falling accuracy is flat or worse
    assert mon.heldout_gap(evals_and_rewards({0: 0.3, 10: 0.1}, [0.1] * 5 + [0.35] * 5), RH)
    # at its ceiling accuracy cannot rise: no verdict
    assert mon.heldout_gap(evals_and_rewards({0: 1.0, 10: 1.0}, [0.1] * 5 + [0.35] * 5), RH) is None


def test_heldout_rule_needs_two_evals_and_two_separate_windows() -> None:
    assert mon.heldout_gap(evals_and_rewards({0: 0.3}, [0.1] * 5 + [0.9] * 5), RH) is None
    # evals at 0 and 8: windows steps 1-5 and 4-8 overlap
    assert mon.heldout_gap(evals_and_rewards({0: 0.3, 8: 0.3}, [0.1] * 3 + [0.9] * 5), RH) is None


def test_heldout_rule_compares_with_the_best_earlier_eval() -> None:
    # accuracy 0.2 -> 0.5 (step 10) -> 0.5 (step 20): judged from step 10, where reward was 0.4
    rows = evals_and_rewards({0: 0.2, 10: 0.5, 20: 0.5}, [0.1] * 5 + [0.4] * 10 + [0.7] * 5)
    found = mon.heldout_gap(rows, RH)
    assert found is not None and found.evidence["since_step"] == 10
    assert found.evidence["reward_then"] == pytest.approx(0.4)


def test_component_rule_format_up_accuracy_down_from_its_peak() -> None:
    # correct peaked at 0.6 (steps 6-10) and is 0.4 now (fell 0.2 >= 0.1); format rose 0.2 -> 0.45
    rows = history(
        rewards__correct__mean=[0.2] * 5 + [0.6] * 5 + [0.4] * 5,
        rewards__format__mean=[0.1] * 5 + [0.2] * 5 + [0.45] * 5,
    )
    found = mon.component_divergence(rows, RH, "correct", ["format"])
    assert found is not None and "'format'" in found.message
    assert found.evidence["accuracy_then"] == pytest.approx(0.6)
    # format rose only 0.15, or accuracy fell only 0.05: quiet
    less = history(
        rewards__correct__mean=[0.6] * 5 + [0.4] * 5, rewards__format__mean=[0.2] * 5 + [0.35] * 5
    )
    assert mon.component_divergence(less, RH, "correct", ["format"]) is None
    small = history(
        rewards__correct__mean=[0.6] * 5 + [0.55] * 5, rewards__format__mean=[0.2] * 5 + [0.9] * 5
    )
    assert mon.component_divergence(small, RH, "correct", ["format"]) is None
    # warm-up: fewer than 2 windows
    short = history(
        rewards__correct__mean=[0.6] * 5 + [0.0] * 4, rewards__format__mean=[0.0] * 5 + [1.0] * 4
    )
    assert mon.component_divergence(short, RH, "correct", ["format"]) is None


def test_length_rule_longer_without_accuracy() -> None:
    def rows(length_now: float, acc_now: float) -> list[dict[str, float]]:
        return history(
            completions__mean_length=[10.0] * 5 + [length_now] * 5,
            rewards__correct__mean=[0.3] * 5 + [acc_now] * 5,
        )

    assert mon.length_without_accuracy(rows(15.0, 0.3), RH, "correct") is not None  # +50%
    assert mon.length_without_accuracy(rows(14.0, 0.3), RH, "correct") is None  # +40%
    assert mon.length_without_accuracy(rows(15.0, 0.4), RH, "correct") is None  # accuracy rose
    assert mon.length_without_accuracy(rows(15.0, 0.3)[:9], RH, "correct") is None


def test_zero_variance_rule() -> None:
    assert mon.zero_variance(history(frac_reward_zero_std=[1.0] * 5), ET) is not None
    assert mon.zero_variance(history(frac_reward_zero_std=[0.9] * 5), ET) is not None
    assert mon.zero_variance(history(frac_reward_zero_std=[0.85] * 5), ET) is None
    assert mon.zero_variance(history(frac_reward_zero_std=[1.0] * 4), ET) is None  # warm-up


def test_std_collapse_rule() -> None:
    # early mean 0.4; threshold 0.25 x 0.4 = 0.1
    assert mon.std_collapse(history(rollout__in_group_std=[0.4] * 5 + [0.09] * 5), ET)
    assert mon.std_collapse(history(rollout__in_group_std=[0.4] * 5 + [0.1] * 5), ET) is None
    # zero from the start has no early mean to fall from (zero_variance covers it)
    assert mon.std_collapse(history(rollout__in_group_std=[0.0] * 10), ET) is None
    assert mon.std_collapse(history(rollout__in_group_std=[0.4] * 5 + [0.0] * 4), ET) is None


def test_duplicates_rule() -> None:
    assert mon.duplicates(history(rollout__duplicate_frac=[0.0] * 5 + [0.8] * 5), ET)
    assert mon.duplicates(history(rollout__duplicate_frac=[0.0] * 5 + [0.75] * 5), ET) is None
    # high but always so: rose only 0.45 < 0.5
    assert mon.duplicates(history(rollout__duplicate_frac=[0.4] * 5 + [0.85] * 5), ET) is None


def test_grad_spike_rule() -> None:
    base = [1.0, 1.1, 0.9, 1.0, 1.1, 0.9, 1.0, 1.1, 0.9, 1.0]  # median 1.0, MAD 0.1 -> scale 0.148
    assert mon.grad_spike(history(grad_norm=[*base, 1.9]), ET) is not None  # z = 6.07
    assert mon.grad_spike(history(grad_norm=[*base, 1.8]), ET) is None  # z = 5.4
    assert mon.grad_spike(history(grad_norm=[*base[:9], 5.0]), ET) is None  # 9 previous: warm-up
    # nearly constant norms: the scale is floored at 5% of the median (0.05): 1.2 is z = 4
    flat = [1.0] * 10
    assert mon.grad_spike(history(grad_norm=[*flat, 1.2]), ET) is None
    assert mon.grad_spike(history(grad_norm=[*flat, 1.31]), ET) is not None
    # zeros (no gradient) are not measurements; a step without a norm is no spike
    assert mon.grad_spike(history(grad_norm=[*base, 0.0, 0.0]), ET) is None
    assert mon.grad_spike(history(grad_norm=[*base, 0.0, 1.9]), ET) is not None
    assert mon.grad_spike(history(grad_norm=[*base, 5.0, None]), ET) is None


def test_kl_blowup_rule() -> None:
    assert mon.kl_blowup(history(kl=[0.5, 0.8, 1.2, 1.3]), KL) is not None  # > 1 twice
    assert mon.kl_blowup(history(kl=[0.5, 0.8, 0.9, 1.3]), KL) is None  # once
    assert mon.kl_blowup(history(kl=[0.02] * 5 + [0.25]), KL) is not None  # 12.5x the median
    assert mon.kl_blowup(history(kl=[0.02] * 5 + [0.15]), KL) is None  # 7.5x
    assert mon.kl_blowup(history(kl=[0.001] * 5 + [0.05]), KL) is None  # 50x but below min_kl
    assert mon.kl_blowup(history(reward=[0.5] * 6), KL) is None  # beta 0: no KL at all


def test_nonfinite_fires_on_every_skipped_step_and_on_a_nan_loss() -> None:
    m = Monitors(MonitorsConfig())
    assert m.observe(1, {"loss": 0.1, "update/skipped_nonfinite": 0.0}) == []
    first = m.observe(2, {"loss": math.nan, "update/skipped_nonfinite": 1.0})
    second = m.observe(3, {"loss": 0.2, "update/skipped_nonfinite": 1.0})
    uncounted = m.observe(4, {"loss": math.inf, "update/skipped_nonfinite": 0.0})
    assert [a.name for a in first + second + uncounted] == ["nonfinite"] * 3
    assert first[0].step == 2 and first[0].evidence == {"skipped": 1.0}


# ------------------------------------------------------------------------------- the Monitors class


def feed(m: Monitors, rows: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [(a.step, a.name) for row in rows for a in m.observe(int(row["step"]), row)]


def test_an_alert_fires_once_per_episode_and_again_after_it_clears() -> None:
    rows = history(frac_reward_zero_std=[1.0] * 7 + [0.0] * 5 + [1.0] * 5)
    assert feed(Monitors(MonitorsConfig()), rows) == [
        (5, "echo_trap/zero_variance"),
        (17, "echo_trap/zero_variance"),
    ]


def test_disabled_monitors_stay_quiet() -> None:
    rows = history(frac_reward_zero_std=[1.0] * 6, update__skipped_nonfinite=[1.0] * 6)
    assert feed(Monitors(MonitorsConfig(enabled=False)), rows) == []
    only_nonfinite = MonitorsConfig(echo_trap=EchoTrapMonitor(enabled=False))
    assert {name for _, name in feed(Monitors(only_nonfinite), rows)} == {"nonfinite"}


def test_the_final_eval_merges_into_the_last_step_and_can_fire() -> None:
    m = Monitors(MonitorsConfig(), accuracy="correct")
    rows = evals_and_rewards({0: 0.3}, [0.1] * 5 + [0.5] * 5)
    assert feed(m, rows) == []
    alerts = m.observe(10, {"eval/accuracy": 0.3})
    assert [a.name for a in alerts] == ["reward_hacking/heldout"]
    assert len(m.history) == 11 and m.history[-1]["reward"] == 0.5


def test_replay_rebuilds_the_history_and_what_already_fired() -> None:
    rows: list[dict[str, Any]] = history(frac_reward_zero_std=[1.0] * 7, reward=[0.5] * 7)
    live = Monitors(MonitorsConfig())
    feed(live, rows)
    resumed = Monitors(MonitorsConfig())
    resumed.replay([*rows[:5], {"step": 5, "event": "echo_trap/zero_variance"}, *rows[5:]])
    assert resumed.history == live.history and resumed.active == live.active
    assert resumed.observe(8, {"frac_reward_zero_std": 1.0}) == []  # still the same episode


def test_event_row_format() -> None:
    alert = mon.Alert("kl_blowup", 7, "KL ran away", "warn", {"kl": 2.0, "median": math.nan})
    assert alert.event() == {
        "event": "kl_blowup",
        "action": "warn",
        "message": "KL ran away",
        "evidence": {"kl": 2.0},  # non-finite evidence is dropped (metrics.jsonl is strict JSON)
    }


# -------------------------------------------------------------------------------------- mitigation


def test_mitigations_are_pure_config_changes() -> None:
    cfg = RunConfig()
    assert mitigation(cfg, "echo_trap/zero_variance") == {"filter.group_filter": "std-top-p"}
    assert mitigation(cfg, "entropy_collapse") == {"filter.group_filter": "std-top-p"}
    assert mitigation(cfg, "reward_hacking/heldout") == {"objective.beta": 0.04}  # the floor
    assert mitigation(cfg, "nonfinite") == {}
    raised = apply_changes(cfg, {"objective.beta": 0.05, "filter.group_filter": "std-top-k"})
    assert raised.objective.beta == 0.05 and raised.filter.group_filter == "std-top-k"
    assert cfg.objective.beta == 0.0 and cfg.filter.group_filter == "none"  # unchanged
    assert mitigation(raised, "kl_blowup") == {"objective.beta": 0.1}  # x beta_factor 2
    assert mitigation(raised, "echo_trap/duplicates") == {}  # a filter is on already


def test_config_section_and_its_checks(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("monitors: {echo_trap: {action: stop, window: 3}}\n")
    cfg = load_config(path)
    assert cfg.monitors.echo_trap.action == "stop" and cfg.monitors.echo_trap.window == 3
    with pytest.raises(ConfigError, match=r"nonfinite\.action"):
        load_config(path, ["monitors.nonfinite.action=mitigate"])
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(path, ["monitors.entropy_collapse.fracton=0.2"])


def test_duplicate_fraction() -> None:
    task = Task(id="t", messages=({"role": "user", "content": "q"},))

    def group(*completions: tuple[int, ...]) -> Group:
        def traj(ids: tuple[int, ...]) -> Trajectory:
            tokens = (1, *ids)
            n = len(tokens)
            return Trajectory("t", tokens, (0,) + (1,) * (n - 1), (0.0,) * n, 1, "", "stop")

        return Group(task, tuple(traj(c) for c in completions))

    assert duplicate_fraction([group((5,), (6,), (7,), (8,))]) == 0.0
    assert duplicate_fraction([group((5,), (5,), (6,), (7,))]) == 0.5
    assert duplicate_fraction([group((5,), (5,), (6,), (6,))]) == 1.0
    # only within a group: the same completion in two groups is no duplicate
    assert duplicate_fraction([group((5,), (6,)), group((5,), (7,))]) == 0.0


# ------------------------------------------------------------------------ provoked on the tiny model


def tiny_run(
    config_dir: Path, model_dir: Path, out: Path, *overrides: str, **kwargs: Any
) -> tuple[Any, list[dict[str, Any]], list[dict[str, Any]]]:
    """Train; returns (summary, step rows, event rows)."""
    cfg = load_config(
        config_dir / "tiny.yaml",
        [f"model.name={model_dir}", f"output_dir={out}", "tracking.progress=false", *overrides],
    )
    summary = train(cfg, config_dir=config_dir, **kwargs)
    rows = read_metrics(summary.run_dir)
    return summary, [r for r in rows if "event" not in r], [r for r in rows if "event" in r]


CONSTANT = ("rewards=[{fn: const_reward.py:one, name: one}]", "eval.metric=one")


def write_constant_reward(config_dir: Path) -> None:
    (config_dir / "const_reward.py").write_text(
        "def one(completion: str, **_: object) -> float:\n    return 1.0\n"
    )


@pytest.mark.precision  # the loop at model.bf16: auto
def test_a_healthy_tiny_run_raises_no_alert(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """examples/tiny.yaml as it is (30 steps): reward 0.09 -> 0.95, entropy 4.8 -> 2.4, no alert."""
    _, steps, events = tiny_run(tiny_config_dir, tiny_model_dir, tmp_path / "ok", "train.seed=0")
    assert events == []
    assert not any(k.startswith("alerts/") for row in steps for k in row)
    rewards = [r["reward"] for r in steps if "reward" in r]
    assert len(rewards) == 30 and rewards[-1] > rewards[0] + 0.5  # it did learn


@pytest.mark.precision  # the loop at model.bf16: auto
def test_format_only_reward_raises_the_hacking_alert(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tiny.yaml pays for digits only; read held-out accuracy as `correct` (the tiny model cannot
    add): train reward climbs, accuracy stays at 0."""
    _, steps, events = tiny_run(
        tiny_config_dir, tiny_model_dir, tmp_path / "hack", "train.steps=18", "eval.every=5",
        "eval.n=4", "eval.metric=correct",
    )  # fmt: skip
    hacking = [e for e in events if e["event"] == "reward_hacking/heldout"]
    assert hacking, events
    first = hacking[0]
    assert first["action"] == "warn" and "held-out accuracy" in first["message"]
    assert first["evidence"]["reward_now"] - first["evidence"]["reward_then"] >= 0.2
    row = next(r for r in steps if r["step"] == first["step"] and "reward" in r)
    assert row["alerts/reward_hacking/heldout"] == 1.0
    assert "monitor reward_hacking/heldout" in capsys.readouterr().err


@pytest.mark.precision  # the loop at model.bf16: auto
def test_far_too_high_learning_rate_raises_entropy_collapse(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """lr 1.0 (~330x tiny.yaml's): -log p of the samples 4.8 -> ~0 within 5 steps in fp32 and under
    a bf16 update; fires at step 10, the first step early_steps + patience allows. (At lr 0.3 a
    bf16 run with seed 0 settled at -log p 0.5-0.9 with every group at zero variance, which the
    echo-trap monitor reports instead: not "far too high" enough to be sure of a collapse.)
    HF's fp32 sampler, pinned: sampled from the bf16 copy (the default on native-bf16 CPUs) -log p
    falls 4.8 -> 0.06 within two steps, so the 5-step baseline (mean 1.09) already holds the
    collapse and one later step at 0.12 keeps the rule quiet; the echo-trap rules fire there."""
    _, _, events = tiny_run(
        tiny_config_dir, tiny_model_dir, tmp_path / "lr", "train.learning_rate=1.0",
        "train.steps=10", "eval.at_start=false", "eval.at_end=false", "generator.decode=hf",
    )  # fmt: skip
    collapse = [e for e in events if e["event"] == "entropy_collapse"]
    assert [e["step"] for e in collapse] == [10]
    assert collapse[0]["evidence"]["ratio"] < 0.1


@pytest.mark.precision  # the loop at model.bf16: auto
def test_constant_reward_raises_zero_variance(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    write_constant_reward(tiny_config_dir)
    _, _, events = tiny_run(
        tiny_config_dir, tiny_model_dir, tmp_path / "const", *CONSTANT, "train.steps=6",
        "eval.at_start=false", "eval.at_end=false",
    )  # fmt: skip
    assert [(e["step"], e["event"]) for e in events] == [(5, "echo_trap/zero_variance")]
    assert events[0]["evidence"]["frac_reward_zero_std"] == 1.0


@pytest.mark.precision  # the loop at model.bf16: auto
def test_injected_nan_loss_skips_the_step_and_raises_nonfinite(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rlvr.train.loop as loop
    import rlvr.train.update as update

    real_aggregate, real_update = update.aggregate, loop.policy_update
    calls: list[int] = []
    unchanged: dict[int, bool] = {}

    def poisoned_aggregate(*args: Any, **kwargs: Any) -> torch.Tensor:
        loss = real_aggregate(*args, **kwargs)
        return loss * float("nan") if len(calls) == 3 else loss

    def watched_update(policy: Any, *args: Any, **kwargs: Any) -> dict[str, float]:
        calls.append(len(calls) + 1)
        before = [p.detach().clone() for p in policy.trainable_parameters()]
        out = real_update(policy, *args, **kwargs)
        after = policy.trainable_parameters()
        unchanged[len(calls)] = all(torch.equal(b, a) for b, a in zip(before, after, strict=True))
        return out

    monkeypatch.setattr(update, "aggregate", poisoned_aggregate)
    monkeypatch.setattr(loop, "policy_update", watched_update)
    _, steps, events = tiny_run(
        tiny_config_dir, tiny_model_dir, tmp_path / "nan", "train.steps=4",
        "eval.at_start=false", "eval.at_end=false",
    )  # fmt: skip
    assert unchanged == {1: False, 2: False, 3: True, 4: False}  # step 3: weights untouched
    by_step = {r["step"]: r for r in steps}
    assert by_step[3]["update/skipped_nonfinite"] == 1.0 and by_step[3]["loss"] is None
    assert by_step[3]["alerts/nonfinite"] == 1.0
    assert all(by_step[s]["update/skipped_nonfinite"] == 0.0 for s in (1, 2, 4))
    assert [(e["step"], e["event"]) for e in events] == [(3, "nonfinite")]


@pytest.mark.precision  # the loop at model.bf16: auto
def test_action_stop_ends_the_run_with_a_checkpoint(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    write_constant_reward(tiny_config_dir)
    summary, steps, events = tiny_run(
        tiny_config_dir, tiny_model_dir, tmp_path / "stop", *CONSTANT, "train.steps=20",
        "monitors.echo_trap.action=stop", "eval.at_start=false", "eval.n=4",
    )  # fmt: skip
    assert summary.steps_done == 5
    assert summary.stopped_early is not None
    assert summary.stopped_early.startswith("echo_trap/zero_variance")
    assert (summary.run_dir / "checkpoints" / "step-000005" / "state.json").exists()
    assert max(r["step"] for r in steps) == 5
    assert summary.eval_history[-1][0] == 5  # the final eval scores the stopped policy
    assert events[0]["action"] == "stop"


@pytest.mark.precision  # the loop at model.bf16: auto
def test_action_mitigate_raises_beta_with_a_new_reference_and_resumes_exactly(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The hacking setup with action mitigate (and a low trigger, to fire by the step-9 eval: train
    reward over steps 1-3 ~0.13, over 7-9 ~0.2 while held-out `correct` stays 0): beta 0 -> 0.04; a full fine-tuning run then
    loads the base model as its reference, so `kl` appears from the next step. A run stopped after
    the mitigation and resumed matches the uninterrupted one."""
    common = (
        "train.steps=11", "eval.every=3", "eval.n=4", "eval.metric=correct", "eval.at_end=false",
        "monitors.reward_hacking.action=mitigate", "monitors.reward_hacking.window=3",
        "monitors.reward_hacking.reward_rise=0.03", "checkpoint.every=10",
    )  # fmt: skip
    full, steps, events = tiny_run(tiny_config_dir, tiny_model_dir, tmp_path / "full", *common)
    fired = next(e for e in events if e["event"] == "reward_hacking/heldout")
    assert fired["changes"] == {"objective.beta": 0.04}
    assert all("kl" not in r for r in steps if r["step"] <= fired["step"])
    assert all(r["kl"] > 0 for r in steps if r["step"] > fired["step"])
    state = json.loads((full.run_dir / "checkpoints" / "step-000010" / "state.json").read_text())
    assert state["monitors"]["changes"] == {"objective.beta": 0.04}

    class Stop(Exception):
        pass

    def stop_at_10(step: int, _metrics: object) -> None:
        if step == 10:
            raise Stop

    split = tmp_path / "split"
    with pytest.raises(Stop):
        tiny_run(tiny_config_dir, tiny_model_dir, split, *common, on_step_end=stop_at_10)
    cfg = load_config(split / "config.yaml", ["tracking.progress=false"])
    train(cfg, resume=True, config_dir=tiny_config_dir)
    resumed = [r for r in read_metrics(split) if r["step"] == 11]
    original = [r for r in read_metrics(full.run_dir) if r["step"] == 11]
    timing = WALL_CLOCK_METRICS

    def strip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k not in timing} for r in rows]

    assert strip(resumed) == strip(original) and "kl" in resumed[0]
    assert fired["step"] < 10


@pytest.mark.precision  # the loop at model.bf16: auto
def test_action_mitigate_turns_on_starpo_s_and_the_run_goes_on(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    write_constant_reward(tiny_config_dir)
    summary, _, events = tiny_run(
        tiny_config_dir, tiny_model_dir, tmp_path / "filter", *CONSTANT, "train.steps=7",
        "monitors.echo_trap.action=mitigate", "eval.at_start=false", "eval.at_end=false",
        "checkpoint.every=7",
    )  # fmt: skip
    assert summary.steps_done == 7 and summary.stopped_early is None
    assert [(e["step"], e["changes"]) for e in events] == [
        (5, {"filter.group_filter": "std-top-p"})
    ]
    state = json.loads((summary.run_dir / "checkpoints" / "step-000007" / "state.json").read_text())
    assert state["monitors"]["changes"] == {"filter.group_filter": "std-top-p"}
