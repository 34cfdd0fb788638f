"""The RL step, top to bottom: tasks -> rollouts -> scores -> advantages -> update -> metrics -> checkpoint.

Over the 500-line guide by a few lines: the RL step is kept readable top to bottom in one file;
issue 37 shortens `train()`.

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

import os
import random
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from rich.markup import escape

from rlvr.allocator import keep_freed_memory
from rlvr.build import build_optimizer, build_policy, rollout_limits, use_bf16
from rlvr.config import RunConfig, config_to_dict, load_config
from rlvr.devices import device_of, enable_tf32, resolve_device
from rlvr.evaluate import check_error_fraction, check_eval_errors, evaluate_sources
from rlvr.models import Policy, load_policy
from rlvr.observe.inspect import trajectory_rows, write_step_trajectories
from rlvr.observe.metrics import (
    agent_metrics,
    rollout_metrics,
    rollout_rows,
    source_metrics,
    verifiability_metrics,
)
from rlvr.observe.mismatch import mismatch_rule
from rlvr.observe.monitors import Alert, Monitors, apply_changes, mitigation
from rlvr.observe.progress import Progress
from rlvr.observe.trackers import require_trackers
from rlvr.observe.tracking import NullTracker, Tracker, read_metrics
from rlvr.observe.watchdog import Watchdog, watch
from rlvr.plan import check_fits
from rlvr.records import flatten
from rlvr.registry import ALGORITHMS
from rlvr.rollout.generator import SamplingParams
from rlvr.tasks import TaskSplits
from rlvr.train import precision_choice
from rlvr.train.checkpoint import (
    latest_checkpoint,
    load_training_state,
    load_weights_into,
    save_checkpoint,
)
from rlvr.train.companions import RunCritic, build_teacher
from rlvr.train.curriculum import Curriculum
from rlvr.train.placement import startup_lines
from rlvr.train.rollouts import RolloutPlan, torch_dist_context
from rlvr.train.run_dir import StopSignals, check_run_dir, eval_history, open_run_dir
from rlvr.train.selection import assign_credit, collect_groups
from rlvr.train.sources import Sources, absolutize_reward_files
from rlvr.train.update import policy_update, reference_logprobs


@dataclass
class RunSummary:
    run_dir: Path
    steps_done: int
    eval_history: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    wall_seconds: float = 0.0
    # Why the run ended before train.steps: a monitor whose action is `stop` fired (None: it did not).
    stopped_early: str | None = None
    # The run ended at train.time_limit_minutes rather than at train.steps.
    time_limited: bool = False


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------- the run
StepHook = Callable[[int, dict[str, Any]], None]


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
    run_dir = Path(cfg.output_dir)
    # Before anything slow loads. Under torchrun rank 0 alone judges: the others may start after it
    # made the directory.
    main_rank = os.environ.get("RANK", "0") == "0"
    check_run_dir(run_dir, resume=resume, overwrite=overwrite, main=main_rank)
    if main_rank:
        require_trackers(cfg.tracking.trackers)  # a missing tracker library, before the model loads
    seed_everything(cfg.train.seed)
    if cfg.train.keep_freed_memory and resolve_device(cfg.model.device).type == "cpu":
        keep_freed_memory()  # for the rest of the process (rlvr.allocator): a CPU tuning

    # Under torchrun: this process is one rank; rank 0 alone writes metrics and checkpoints.
    dist = torch_dist_context(cfg)
    sources = Sources(cfg, config_dir, tasks)
    curriculum = Curriculum(cfg, sources, tasks)  # levels / scheduled weights (train/curriculum.py)
    # Before any weights load: a run that cannot fit on its GPU is refused with the smallest change
    # that fits (rlvr plan), not an out-of-memory error an hour in; on the CPU it only warns.
    check_fits(cfg, resolve_device(cfg.model.device))
    policy = build_policy(cfg)
    checkpoint = latest_checkpoint(run_dir) if resume else None
    if checkpoint is not None:
        # Into the unsharded model, before anything copies it (the fsdp sampling copy, an async
        # producer's) or torchrun broadcasts and shards it (DistContext.prepare_policy).
        load_weights_into(policy.model, checkpoint, policy.lora)
    device = device_of(policy.model)
    enable_tf32(device)  # the fp32 matmuls left on a GPU (a no-op on the CPU)
    # `model.bf16: auto`: the update's precision measured on this host (train/precision_choice.py)
    precision = precision_choice.PrecisionChoice(
        use_bf16(cfg.model), f"model.bf16: {cfg.model.bf16}"
    )
    if cfg.model.bf16 == "auto":
        precision = precision_choice.resolve(
            policy.model, cfg.model.name, distributed=dist is not None
        )
    # Made only now: a config, task or model that fails to load leaves no half-made run directory.
    open_run_dir(run_dir, overwrite=overwrite, main=dist is None or dist.is_main)
    # The effective config (a resume may change fields with --set), so `rlvr eval RUN_DIR` sees it.
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    tokenizer = policy.tokenizer
    group_size = cfg.sampling.group_size
    sampling = SamplingParams(
        n=group_size,
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        max_new_tokens=cfg.sampling.max_new_tokens,
        stop=tuple(cfg.sampling.stop),
    )
    limits = rollout_limits(cfg)
    # Where episodes are played (in process, a server, the user's agent, Ray, a background thread)
    plan = RolloutPlan(
        cfg, policy, sources, sampling, limits,
        config_dir=config_dir, tasks=tasks, dist=dist, run_dir=run_dir,
    )  # fmt: skip
    # Everything that runs beside the loop (a server, Ray actors, threads) is closed however it ends.
    closers: list[Callable[[], None]] = [plan.close]
    plan.store_frozen_base_bf16()  # LoRA, bf16 update, bf16 sampling copy: the base in bf16
    try:
        # A phase past its deadline ends the process with every stack on disk (observe/watchdog.py).
        watchdog = Watchdog.from_config(
            cfg.watchdog,
            run_dir,
            rank=dist.rank if dist else 0,
            write_event=not dist or dist.is_main,
            # Raises while there is none; the watchdog then says there is no checkpoint yet.
            last_checkpoint=lambda: latest_checkpoint(run_dir),
        )
        watchdog.on_hang.append(plan.abandon)  # a launched server would outlive os._exit
        closers.append(watchdog.close)
        watchdog.start()
        generator = plan.generator
        if dist is not None:
            # ddp: identical start on every rank; fsdp: shard (bf16 gathers for a bf16 update)
            dist.prepare_policy(policy, bf16=precision.bf16)
        optimizer, scheduler = build_optimizer(policy, cfg)
        is_main = dist is None or dist.is_main
        algorithm = ALGORITHMS.resolve(cfg.algorithm)
        # ppo's value model and distill's teacher: built only for the algorithms that use them.
        critic = (
            RunCritic(cfg, int(tokenizer.pad_token_id), device_of(policy.model))
            if algorithm.needs_critic
            else None
        )
        teacher = build_teacher(cfg, policy) if algorithm.needs_teacher else None
        metrics_of = {s.metric for s in sources}
        monitors = Monitors(
            cfg.monitors,
            accuracy=next(iter(metrics_of)) if len(metrics_of) == 1 else None,
            optimised=[name for name, w in sources.reward_weights.items() if w != 0],
            extra=[mismatch_rule(cfg)],  # sampler vs trainer log-probs (observe/mismatch.py)
        )

        def run_eval(failures: list[str] | None = None) -> dict[str, float]:
            return plan.evaluate(
                lambda: evaluate_sources(
                    sources,
                    generator,
                    tokenizer,
                    n=cfg.eval.n,
                    max_new_tokens=cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens,
                    stop=tuple(cfg.sampling.stop),
                    limits=limits,
                    failures=failures,
                )
            )

        start_step = 0
        if checkpoint is not None:
            if critic is not None:
                critic.load(checkpoint)
            state, generator_rng = load_training_state(
                checkpoint,
                optimizer,
                scheduler,
                rank=dist.rank if dist is not None else 0,
                sharded_model=policy.model if dist is not None and dist.fsdp else None,
            )
            generator.set_state(generator_rng)
            curriculum.load_state_dict(state.get("curriculum"))  # before the samplers
            sources.load_state_dict(state["sampler"])
            start_step = int(state["step"])
            monitors.load_state_dict(state.get("monitors", {}))
            cfg = apply_changes(cfg, monitors.changes)  # mitigations made before the checkpoint
            ensure_reference(policy, cfg)
            plan.after_resume(start_step)

        tracker = (Tracker if is_main else NullTracker)(
            run_dir,
            report_to=cfg.tracking.trackers,
            project=cfg.tracking.project,
            run_name=cfg.tracking.run_name or run_dir.name,
            config=config_to_dict(cfg),
            resume_step=start_step if resume else None,
        )
        closers.append(tracker.close)
        summary = RunSummary(run_dir=run_dir, steps_done=start_step)
        progress = Progress(
            total=cfg.train.steps, start=start_step, enabled=cfg.tracking.progress and is_main
        )
        closers.append(progress.close)
        for line in startup_lines(cfg, policy, device, generator):
            progress.note(escape(line))
        progress.note(escape(precision.describe()))
        if resume and is_main:
            progress.console.print(
                escape(f"resuming from step {start_step} (checkpoint {checkpoint})"),
                soft_wrap=True,  # a path to copy, never broken across lines
            )
        if resume and tracker.metrics_path.exists():
            history = read_metrics(run_dir)
            monitors.replay(history)  # the history up to the checkpoint
            # The summary's evals as if the run had never stopped: the base model's eval first.
            summary.eval_history = eval_history(history)
        # Ctrl-C / SIGTERM from here on: the step finishes, a checkpoint is saved, then we stop.
        stop_signals = StopSignals()
        closers.append(stop_signals.restore)

        def save(step: int) -> None:
            plan.before_save()  # async: producer idle; fsdp: full weights gathered (collective)
            # fsdp without a sampling copy (a server samples): gather the weights here (collective)
            gather = dist is not None and dist.fsdp and plan.copy_model is None
            save_checkpoint(  # every rank: its RNGs (and under fsdp its optimizer shard)
                run_dir,
                step,
                model=plan.copy_model if plan.copy_model is not None else policy.model,
                model_state=dist.full_state_dict(policy.model, keep=is_main) if gather else None,
                tokenizer=tokenizer,
                optimizer=optimizer,
                scheduler=scheduler,
                generator_rng=generator.get_state(),
                sampler_state=sources.state_dict(),
                extra_state={
                    "algorithm": cfg.algorithm,
                    "monitors": monitors.state_dict(),
                    "curriculum": curriculum.state_dict(),
                },
                keep_last=cfg.checkpoint.keep_last,
                save_extra=critic.save if critic is not None else None,
                dist=dist,
                sharded_model=policy.model if dist is not None and dist.fsdp else None,
            )

        if cfg.eval.at_start and not resume:
            progress.note("evaluating the base policy on held-out tasks...")
            failures: list[str] = []
            base = run_eval(failures)
            summary.eval_history.append((0, base))
            monitors.observe(0, base)
            tracker.log(base, step=0)
            progress.note(f"held-out accuracy before training: {base['eval/accuracy']:.1%}")
            # Never a silent 0%: failed rollouts are named; all of them failing stops the run
            # (under torchrun on rank 0's numbers, so every rank stops alike).
            check_eval_errors(
                base if dist is None else dist.broadcast_object(base),
                failures,
                "held-out eval before training",
                progress.console if is_main else None,
            )
            if stop_signals.requested(dist):
                save(0)
                raise stop_signals.interrupted(0, run_dir)

        first_step_started = time.time()
        for step in range(start_step + 1, cfg.train.steps + 1):
            t0 = time.time()
            watchdog.step = step
            curriculum.before_step(step)
            # 1. tasks -> rollouts (multi-turn when the env asks), scored; the filter keeps the
            #    groups worth learning from (StarPO-S / DAPO dynamic sampling)
            sampled, kept, filter_metrics = collect_groups(cfg, plan.sample_round)
            trajectories = flatten(kept)
            t_rollout = time.time() - t0
            plan.before_update()  # the sampler's weight copy is not kept through the update
            # 2. advantages over the rollouts that scored, then per-token credit; KL in the reward
            #    needs the reference's log-probs first, ppo the critic's values
            ref_logprobs = reference_logprobs(policy, trajectories, cfg, dist=dist)
            values = critic.token_values(trajectories) if critic is not None else None
            credit = assign_credit(
                trajectories, cfg, algorithm, ref_logprobs=ref_logprobs, values=values
            )
            token_adv = credit.token_advantages
            # 3. the update: the critic towards its returns, the policy along its advantages
            update = dict(credit.metrics)
            if critic is not None:
                update.update(critic.update(trajectories, credit))
            if critic is None or step > cfg.critic.warmup_steps:
                with watch("update"):
                    update.update(
                        policy_update(
                            policy, optimizer, trajectories, token_adv, cfg, teacher=teacher,
                            dist=dist,
                        )
                    )  # fmt: skip
                plan.after_update(step)  # the samplers get the new weights
            metrics = {
                **rollout_metrics(sampled, sources.reward_names, group_size),
                **agent_metrics(flatten(sampled)),
                **filter_metrics,
                **plan.metrics(),
                **update,
            }
            if sources.is_mixture:
                metrics.update(
                    source_metrics(flatten(sampled), {s.name: s.metric for s in sources})
                )
            # A judge or reward model's share reported apart from the verifiers' (hacking shows there).
            metrics.update(
                verifiability_metrics(
                    flatten(sampled), sources.reward_weights, sources.unverifiable
                )
            )
            metrics["learning_rate"] = scheduler.get_last_lr()[0]
            with warnings.catch_warnings():
                # The schedule follows steps even when an update was skipped (no optimizer.step()).
                warnings.simplefilter("ignore", UserWarning)
                scheduler.step()
            elapsed = time.time() - t0
            n_tokens = sum(len(t.token_ids) - t.prompt_length for t in flatten(sampled))
            metrics.update(
                {
                    "step_time": elapsed,
                    "rollout_time": t_rollout,
                    "update_time": elapsed - t_rollout,
                    "tokens_per_second": n_tokens / elapsed,
                    "perf/precision": precision.bits,  # 16: bf16 autocast update, 32: fp32
                }
            )
            # 4. held-out eval, metrics, checkpoint
            at_end_anyway = step == cfg.train.steps and cfg.eval.at_end
            if cfg.eval.every and step % cfg.eval.every == 0 and not at_end_anyway:
                ev = run_eval()
                summary.eval_history.append((step, ev))
                metrics.update(ev)
            if dist is not None:  # every rank acts on rank 0's numbers, so all decide alike
                metrics = dist.broadcast_object(metrics)
            # 5. the monitors read the history; an alert is an event row after this step's metrics,
            #    and its action applies from the next step (a mitigation is in the checkpoint)
            promotions = curriculum.after_step(step, flatten(sampled), metrics)  # level changes now
            alerts = monitors.observe(step, metrics)
            metrics.update({f"alerts/{a.name}": 1.0 for a in alerts})
            tracker.log(metrics, step=step)
            for event in promotions:  # an event row, as an alert's
                tracker.log(event, step=step)
                progress.console.print(escape(event["message"]))
            for alert in alerts:
                cfg, stop = act_on_alert(alert, cfg, monitors, policy, tracker, progress)
                summary.stopped_early = summary.stopped_early or stop
            tracker.log_rollouts(rollout_rows(sampled), step=step)
            every = cfg.tracking.trajectories_every
            if is_main and every and step % every == 0:
                write_step_trajectories(
                    run_dir, step, trajectory_rows(trajectories, token_adv, tokenizer)
                )
            summary.steps_done = step
            progress.update(step, metrics)
            check_error_fraction(flatten(sampled), step, cfg.train.max_reward_error_fraction)
            saved = summary.stopped_early or (
                cfg.checkpoint.every and step % cfg.checkpoint.every == 0
            )
            if saved:
                save(step)
            if on_step_end is not None:
                on_step_end(step, metrics)
            if summary.stopped_early:
                progress.console.print(
                    f"stopped early at step {step}: {escape(summary.stopped_early)}"
                )
                break
            if stop_signals.requested(dist):  # this step is complete: checkpoint it, then stop
                if not saved:
                    save(step)
                raise stop_signals.interrupted(step, run_dir)
            limit = cfg.train.time_limit_minutes
            out_of_time = limit is not None and time.time() - first_step_started >= 60.0 * limit
            if dist is not None:
                out_of_time = bool(dist.broadcast_object(out_of_time))
            if out_of_time and step < cfg.train.steps:
                summary.time_limited = True
                if not (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                    save(step)
                progress.console.print(f"time limit of {limit:g} min reached after step {step}")
                break

        if cfg.eval.at_end:
            final = run_eval()
            summary.eval_history.append((summary.steps_done, final))
            alerts = monitors.observe(summary.steps_done, final)  # the held-out rule, one last time
            tracker.log(
                {**final, **{f"alerts/{a.name}": 1.0 for a in alerts}}, step=summary.steps_done
            )
            for alert in alerts:
                log_alert(alert, tracker, progress)
        if cfg.checkpoint.save_final and summary.steps_done == cfg.train.steps:
            save(cfg.train.steps)
    finally:
        for close in reversed(closers):
            close()
        if dist is not None:
            dist.close()
    summary.wall_seconds = time.time() - started
    return summary


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


def act_on_alert(
    alert: Alert,
    cfg: RunConfig,
    monitors: Monitors,
    policy: Policy,
    tracker: Tracker,
    progress: Progress,
) -> tuple[RunConfig, str | None]:
    """Log `alert` and carry out its action: returns the config for the next step and, for `stop`,
    why the run stops."""
    changes = mitigation(cfg, alert.name) if alert.action == "mitigate" else None
    if changes:
        cfg = apply_changes(cfg, changes)
        monitors.changes.update(changes)
        ensure_reference(policy, cfg)
    log_alert(alert, tracker, progress, changes)
    return cfg, f"{alert.name}: {alert.message}" if alert.action == "stop" else None


def ensure_reference(policy: Policy, cfg: RunConfig) -> None:
    """Give a full fine-tuning run a reference once beta > 0 (a mitigation raised it from 0): the
    base model, frozen, which is what a run started with that beta would have (so a resume matches).
    LoRA needs none: its reference is the base with adapters disabled."""
    if cfg.objective.beta > 0 and not policy.lora and policy._reference is None:
        # Loading must not move the run's RNG: a resumed run loads it at another moment.
        with torch.random.fork_rng(devices=[]):
            reference = load_policy(cfg.model.name, device=device_of(policy.model)).model
            policy._reference = reference.eval().requires_grad_(False)


def train_from_file(path: str, overrides: list[str] | None = None) -> RunSummary:
    cfg = load_config(path, overrides)
    return train(cfg, config_dir=Path(path).parent)
