"""The RL step, top to bottom: tasks -> rollouts -> scores -> advantages -> update -> metrics -> checkpoint.

`train()` reads as the run in order, each stage a named function: the set-up stages
(rlvr.train.run_setup: load_run, build_trainer, restore, open_reporting), then per step `rl_step`
(rollouts, credit, update), `record_step` (eval, monitors, tracker) and `end_step` (checkpoint,
stop, time limit), then `finish`. The stages pass one `Run` (rlvr.train.run_setup.Run).

Objective (GRPO, Shao et al. 2024, and its family; one `algorithm:` key picks the advantage
estimator and the policy loss from the registries in rlvr.algorithms, docs/algorithms.md lists them):

    J = agg_t[ min(r_t A, clip(r_t, 1-eps, 1+eps_high) A) - beta * KL_est(pi || pi_ref)_t + c_H * H_t ]

How this departs from the paper, on purpose:
- Advantages are one scalar per trajectory (outcome supervision), applied to every token the policy
  sampled; prompt, padding and (multi-turn) observation tokens are masked out of every term. ppo
  instead gets per-token advantages from its critic (GAE over the policy tokens).
- The default aggregation is token-mean over the whole batch (DAPO) rather than the paper's
  per-sequence mean; `objective.loss_aggregation` selects either, or Dr.GRPO's constant normaliser.
- beta defaults to 0 (no reference model, as DAPO/Dr.GRPO and TRL); with beta > 0 the KL is k3 by
  default, as in the paper, in the loss, or per token in the reward with `objective.kl_in_reward`.
  LoRA's reference is the base with adapters disabled.
- With num_iterations == 1 the update is on-policy: pi_old is the current policy detached, so the ratio
  is exactly 1 and no extra forward pass is spent. With num_iterations > 1 (or truncated importance
  sampling), pi_old log-probs are computed once by the trainer before the first update.
- A rollout whose reward function raised is left out of the update and of its group's baseline, and
  counted; past `train.max_reward_error_fraction` the run stops.
- After every step the failure-mode monitors (rlvr.observe.monitors, docs/monitors.md) read the metric
  history; an alert is logged as an event and warns, stops the run (with a checkpoint), or mitigates
  (StarPO-S filtering or a larger beta from the next step on).

The update itself is rlvr.train.update.policy_update; ppo's critic and distill's teacher are built in
rlvr.train.companions. Where episodes are played (in process, on a vLLM-protocol server, by the user's
own agent through `rlvr serve`, on Ray actors, in a background thread, or by torchrun ranks) is
rlvr.train.rollouts.RolloutPlan; the step is the same in every case (docs/scaling.md).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.markup import escape

from rlvr.config import RunConfig, load_config
from rlvr.evaluate import check_error_fraction, check_eval_errors
from rlvr.observe.inspect import trajectory_rows, write_step_trajectories
from rlvr.observe.metrics import (
    agent_metrics,
    rollout_metrics,
    rollout_rows,
    signal_metrics,
    source_metrics,
    verifiability_metrics,
)
from rlvr.observe.monitors import Alert, apply_changes, mitigation
from rlvr.observe.progress import Progress
from rlvr.observe.tracking import Tracker
from rlvr.observe.watchdog import watch
from rlvr.records import Group, Trajectory, flatten
from rlvr.tasks import TaskSplits
from rlvr.train.run_setup import (
    Run,
    RunSummary,
    build_trainer,
    ensure_reference,
    load_run,
    open_reporting,
    restore,
    run_eval,
    save,
    seed_everything,
)
from rlvr.train.selection import assign_credit, collect_groups
from rlvr.train.sources import absolutize_reward_files
from rlvr.train.update import policy_update, reference_logprobs

__all__ = ["RunSummary", "StepHook", "seed_everything", "train", "train_from_file"]

StepHook = Callable[[int, dict[str, Any]], None]


# ---------------------------------------------------------------------------------------------- the run
def train(
    cfg: RunConfig,
    *,
    resume: bool = False,
    config_dir: Path | None = None,
    on_step_end: StepHook | None = None,
    tasks: TaskSplits | None = None,
    overwrite: bool = False,
) -> RunSummary:
    """Run (or resume) a training run as configured; everything lands in `cfg.output_dir`.

    `tasks` replaces the config's task source (e.g. `dataset_tasks(cfg, rows=my_datasets_Dataset)`).
    `on_step_end(step, metrics)` is called after each step's metrics and checkpoint are written.
    A fresh run into a directory that holds one is refused unless `overwrite` (the old run is
    moved aside); SIGINT / SIGTERM end the run after the current step with a checkpoint, raising
    `RunInterrupted` (rlvr.train.run_dir).
    """
    started = time.time()
    cfg = absolutize_reward_files(cfg, config_dir)
    run = Run(cfg, Path(cfg.output_dir), resume, config_dir, tasks, closers=[])
    try:
        # The set-up stages (rlvr.train.run_setup); each adds what it starts to run.closers.
        load_run(run, overwrite=overwrite)
        build_trainer(run)
        restore(run)
        open_reporting(run)
        if run.cfg.eval.at_start and not resume:
            evaluate_base(run)
        run.first_step_started = time.time()
        for step in range(run.start_step + 1, run.cfg.train.steps + 1):
            metrics, rollouts = rl_step(run, step)
            metrics = record_step(run, step, metrics, rollouts)
            if end_step(run, step, metrics, on_step_end):
                break
        finish(run)
    finally:
        for close in reversed(run.closers):
            close()
    run.summary.wall_seconds = time.time() - started
    return run.summary


def evaluate_base(run: Run) -> None:
    """The untrained policy's held-out accuracy, logged at step 0; a run whose every eval rollout
    failed stops here, naming them."""
    progress = run.progress
    progress.note("evaluating the base policy on held-out tasks...")
    failures: list[str] = []
    base = run_eval(run, failures)
    run.summary.eval_history.append((0, base))
    run.monitors.observe(0, base)
    run.tracker.log(base, step=0)
    progress.note(f"held-out accuracy before training: {base['eval/accuracy']:.1%}")
    # Never a silent 0%: failed rollouts are named; all of them failing stops the run
    # (under torchrun on rank 0's numbers, so every rank stops alike).
    check_eval_errors(
        base if run.dist is None else run.dist.broadcast_object(base),
        failures,
        "held-out eval before training",
        progress.console if run.is_main else None,
    )
    if run.stop_signals.requested(run.dist):
        save(run, 0)
        raise run.stop_signals.interrupted(0, run.run_dir)


@dataclass
class StepRollouts:
    """One step's episodes: every group sampled, and the trajectories the update trains on (with
    their per-token advantages)."""

    sampled: list[Group]
    trajectories: list[Trajectory]
    token_advantages: Sequence[Sequence[float]]


def rl_step(run: Run, step: int) -> tuple[dict[str, Any], StepRollouts]:
    """The RL step: tasks -> scored rollouts -> advantages -> the update. Returns the step's metrics
    (rollouts, filter, credit, update, timing) and its episodes."""
    cfg, plan, policy = run.cfg, run.plan, run.policy
    t0 = time.time()
    run.watchdog.step = step
    run.curriculum.before_step(step)
    # 1. tasks -> rollouts (multi-turn when the env asks), scored; the filter keeps the
    #    groups worth learning from (StarPO-S / DAPO dynamic sampling)
    sampled, kept, filter_metrics = collect_groups(cfg, plan.sample_round)
    trajectories = flatten(kept)
    t_rollout = time.time() - t0
    plan.before_update()  # the sampler's weight copy is not kept through the update
    # 2. advantages over the rollouts that scored, then per-token credit; KL in the reward
    #    needs the reference's log-probs first, ppo the critic's values
    ref_logprobs = reference_logprobs(policy, trajectories, cfg, dist=run.dist)
    critic = run.critic
    values = critic.token_values(trajectories) if critic is not None else None
    credit = assign_credit(
        trajectories, cfg, run.algorithm, ref_logprobs=ref_logprobs, values=values, step=step
    )
    # 3. the update: the critic towards its returns, the policy along its advantages
    update = dict(credit.metrics)
    if critic is not None:
        update.update(critic.update(trajectories, credit))
    if critic is None or step > cfg.critic.warmup_steps:
        with watch("update"):
            update.update(
                policy_update(
                    policy, run.optimizer, trajectories, credit.token_advantages, cfg,
                    teacher=run.teacher, dist=run.dist,
                )
            )  # fmt: skip
        plan.after_update(step)  # the samplers get the new weights
    fit_schedule_to_time_limit(run, step)
    metrics = {**step_metrics(run, sampled, filter_metrics), **update}
    elapsed = time.time() - t0
    n_tokens = sum(len(t.token_ids) - t.prompt_length for t in flatten(sampled))
    metrics.update(
        {
            "step_time": elapsed,
            "rollout_time": t_rollout,
            "update_time": elapsed - t_rollout,
            "tokens_per_second": n_tokens / elapsed,
            "perf/precision": run.precision.bits,  # 16: bf16 autocast update, 32: fp32
        }
    )
    return metrics, StepRollouts(sampled, trajectories, credit.token_advantages)


def fit_schedule_to_time_limit(run: Run, step: int) -> None:
    """With train.time_limit_minutes and a decaying lr, set the schedule's horizon (rlvr.build.
    LrSchedule) to the steps that fit: this step plus the remaining time over the mean step time so
    far (the run ends after the first step past the limit, hence the ceiling), at most train.steps.
    Re-estimated every step, so a run whose steps slow down anneals sooner; never below this step."""
    tc = run.cfg.train
    schedule = getattr(run.scheduler, "lr_lambdas", [None])[0]
    if tc.time_limit_minutes is None or tc.lr_schedule == "constant" or schedule is None:
        return
    elapsed = time.time() - run.first_step_started
    per_step = elapsed / max(1, step - run.start_step)
    remaining = 60.0 * tc.time_limit_minutes - elapsed
    more = max(0, math.ceil(remaining / per_step)) if per_step > 0 else tc.steps
    if run.dist is not None:  # rank 0's clock for all: replicas must keep one lr
        more = int(run.dist.broadcast_object(more))
    schedule.horizon = max(step, min(tc.steps, step + more))


def step_metrics(
    run: Run, sampled: list[Group], filter_metrics: dict[str, float]
) -> dict[str, Any]:
    """The rollouts' metrics (reward per component, lengths, agent turns, per source, verifiable
    vs not), the filter's, the rollout plan's, and the learning rate; steps the schedule."""
    sources = run.sources
    episodes = flatten(sampled)
    metric_of = {s.name: s.metric for s in sources}
    default_metric = next(iter(metric_of.values()))

    def succeeded(t: Trajectory) -> bool:  # the held-out eval's pass rule, per source
        return t.rewards.get(metric_of.get(t.source, default_metric), 0.0) >= 1.0

    metrics = {
        **rollout_metrics(sampled, sources.reward_names, run.cfg.sampling.group_size),
        **signal_metrics(sampled, succeeded, run.cfg.sampling.group_size),
        **agent_metrics(episodes),
        **filter_metrics,
        **run.plan.metrics(),
    }
    if sources.is_mixture:
        metrics.update(source_metrics(episodes, {s.name: s.metric for s in sources}))
    # A judge or reward model's share reported apart from the verifiers' (hacking shows there).
    metrics.update(verifiability_metrics(episodes, sources.reward_weights, sources.unverifiable))
    metrics["learning_rate"] = run.scheduler.get_last_lr()[0]  # the lr this step's update used
    schedule = getattr(run.scheduler, "lr_lambdas", [None])[0]
    if hasattr(schedule, "horizon"):
        metrics["lr_horizon_steps"] = float(schedule.horizon)
    with warnings.catch_warnings():
        # The schedule follows steps even when an update was skipped (no optimizer.step()).
        warnings.simplefilter("ignore", UserWarning)
        run.scheduler.step()
    return metrics


def record_step(
    run: Run, step: int, metrics: dict[str, Any], rollouts: StepRollouts
) -> dict[str, Any]:
    """Held-out eval when due, then the monitors, the tracker, the step's trajectories and the
    progress line. Returns the metrics as logged (under torchrun, rank 0's on every rank)."""
    cfg = run.cfg
    at_end_anyway = step == cfg.train.steps and cfg.eval.at_end
    if cfg.eval.every and step % cfg.eval.every == 0 and not at_end_anyway:
        ev = run_eval(run)
        run.summary.eval_history.append((step, ev))
        metrics.update(ev)
    if run.dist is not None:  # every rank acts on rank 0's numbers, so all decide alike
        metrics = run.dist.broadcast_object(metrics)
    # The monitors read the history; an alert is an event row after this step's metrics, and its
    # action applies from the next step (a mitigation is in the checkpoint).
    episodes = flatten(rollouts.sampled)
    promotions = run.curriculum.after_step(step, episodes, metrics)  # level changes now
    alerts = run.monitors.observe(step, metrics)
    metrics.update({f"alerts/{a.name}": 1.0 for a in alerts})
    run.tracker.log(metrics, step=step)
    for event in promotions:  # an event row, as an alert's
        run.tracker.log(event, step=step)
        run.progress.console.print(escape(event["message"]))
    for alert in alerts:
        run.cfg, stop = act_on_alert(alert, run)
        run.summary.stopped_early = run.summary.stopped_early or stop
    cfg = run.cfg  # as a mitigation left it
    run.tracker.log_rollouts(rollout_rows(rollouts.sampled), step=step)
    every = cfg.tracking.trajectories_every
    if run.is_main and every and step % every == 0:
        rows = trajectory_rows(
            rollouts.trajectories, rollouts.token_advantages, run.policy.tokenizer
        )
        write_step_trajectories(run.run_dir, step, rows)
    run.summary.steps_done = step
    run.progress.update(step, metrics)
    check_error_fraction(episodes, step, cfg.train.max_reward_error_fraction)
    return metrics


def end_step(run: Run, step: int, metrics: dict[str, Any], on_step_end: StepHook | None) -> bool:
    """The checkpoint when due, the user's hook, then whether the run ends here: a monitor's stop,
    Ctrl-C / SIGTERM (raises `RunInterrupted` after a checkpoint) or the time limit."""
    cfg, summary = run.cfg, run.summary
    due = bool(cfg.checkpoint.every and step % cfg.checkpoint.every == 0)
    saved = bool(summary.stopped_early) or due
    if saved:
        save(run, step)
    if on_step_end is not None:
        on_step_end(step, metrics)
    if summary.stopped_early:
        run.progress.console.print(f"stopped early at step {step}: {escape(summary.stopped_early)}")
        return True
    if run.stop_signals.requested(run.dist):  # this step is complete: checkpoint it, then stop
        if not saved:
            save(run, step)
        raise run.stop_signals.interrupted(step, run.run_dir)
    limit = cfg.train.time_limit_minutes
    out_of_time = limit is not None and time.time() - run.first_step_started >= 60.0 * limit
    if run.dist is not None:
        out_of_time = bool(run.dist.broadcast_object(out_of_time))
    if out_of_time and step < cfg.train.steps:
        summary.time_limited = True
        if not due:
            save(run, step)
        run.progress.console.print(f"time limit of {limit:g} min reached after step {step}")
        return True
    return False


def finish(run: Run) -> None:
    """The held-out eval at the end (and the monitors' held-out rule one last time), and the final
    checkpoint of a run that reached train.steps."""
    cfg, summary = run.cfg, run.summary
    if cfg.eval.at_end:
        final = run_eval(run)
        summary.eval_history.append((summary.steps_done, final))
        alerts = run.monitors.observe(summary.steps_done, final)
        run.tracker.log(
            {**final, **{f"alerts/{a.name}": 1.0 for a in alerts}}, step=summary.steps_done
        )
        for alert in alerts:
            log_alert(alert, run.tracker, run.progress)
    if cfg.checkpoint.save_final and summary.steps_done == cfg.train.steps:
        save(run, cfg.train.steps)


def log_alert(
    alert: Alert, tracker: Tracker, progress: Progress, changes: dict[str, Any] | None = None
) -> None:
    """The alert's event row in metrics.jsonl ({"step", "time", "event", "action", "message",
    "evidence"[, "changes"]}) and a console warning (printed even without the progress bar)."""
    event = alert.event() if changes is None else {**alert.event(), "changes": changes}
    tracker.log(event, step=alert.step)
    done = "" if changes is None else f"; changed {changes}" if changes else "; nothing to change"
    progress.console.print(
        f"[bold yellow]monitor {alert.name}[/] (step {alert.step}, {alert.action}): "
        f"{escape(alert.message)}{escape(done)}"
    )


def act_on_alert(alert: Alert, run: Run) -> tuple[RunConfig, str | None]:
    """Log `alert` and carry out its action: returns the config for the next step and, for `stop`,
    why the run stops. Every rank acts alike (the alerts come from rank 0's broadcast metrics)."""
    cfg = run.cfg
    changes = mitigation(cfg, alert.name) if alert.action == "mitigate" else None
    if changes:
        cfg = apply_changes(cfg, changes)
        run.monitors.changes.update(changes)
        ensure_reference(run.policy, cfg, run.dist, run.precision.bf16)
    log_alert(alert, run.tracker, run.progress, changes)
    return cfg, f"{alert.name}: {alert.message}" if alert.action == "stop" else None


def train_from_file(path: str, overrides: list[str] | None = None) -> RunSummary:
    cfg = load_config(path, overrides)
    return train(cfg, config_dir=Path(path).parent)
