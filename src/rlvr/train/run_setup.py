"""What a training run holds between steps, and the stages that build it before the first step.

`train()` (rlvr.train.loop) passes one `Run` from stage to stage:

    load_run          checks, the model (and a checkpoint's weights), its precision, the run directory,
                      where episodes are played (RolloutPlan)
    build_trainer     the watchdog, ranks' sharding, the optimizer, the algorithm, critic and teacher,
                      the monitors
    restore           a checkpoint's optimizer, samplers, RNGs, monitors and mitigations
    open_reporting    the tracker, the progress display, the metric history of a resumed run

Everything that runs beside the loop (a server, Ray actors, threads, the watchdog, the tracker) is
added to `run.closers` as it starts, so `train()` closes whatever was started however the run ends.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from rich.markup import escape

from rlvr.algorithms.algorithm import Algorithm
from rlvr.allocator import keep_freed_memory
from rlvr.build import build_optimizer, build_policy, rollout_limits, use_bf16, weights_dtype
from rlvr.config import RunConfig, config_to_dict
from rlvr.devices import device_of, enable_tf32, resolve_device
from rlvr.evaluate import evaluate_sources
from rlvr.models import Policy, load_policy
from rlvr.observe.mismatch import mismatch_rule
from rlvr.observe.monitors import Monitors, apply_changes
from rlvr.observe.progress import Progress
from rlvr.observe.trackers import require_trackers
from rlvr.observe.tracking import NullTracker, Tracker, read_metrics
from rlvr.observe.watchdog import Watchdog
from rlvr.plan import check_fits
from rlvr.registry import ALGORITHMS
from rlvr.rollout.engine import RolloutLimits
from rlvr.rollout.generator import SamplingParams
from rlvr.scale.torch_dist import DistContext
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
from rlvr.train.sources import Sources


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


@dataclass
class Run:
    """The run's state between stages. `cfg` is replaced when a monitor's mitigation changes it
    (rlvr.train.loop.act_on_alert), so every stage reads `run.cfg`, never a copy taken earlier.
    Fields without `init` are set by the stage named beside them."""

    cfg: RunConfig
    run_dir: Path
    resume: bool
    config_dir: Path | None
    tasks: TaskSplits | None
    closers: list[Callable[[], None]]
    # load_run
    dist: Any = field(init=False)  # rlvr.scale.torch_dist.DistContext under torchrun, else None
    sources: Sources = field(init=False)
    curriculum: Curriculum = field(init=False)
    policy: Policy = field(init=False)
    device: torch.device = field(init=False)  # the policy's, before torchrun shards it
    checkpoint: Path | None = field(init=False)
    precision: precision_choice.PrecisionChoice = field(init=False)
    limits: RolloutLimits = field(init=False)
    plan: RolloutPlan = field(init=False)
    # build_trainer
    watchdog: Watchdog = field(init=False)
    # The rollout plan's sampler (HF, a server, ...); it has get_state / set_state.
    generator: Any = field(init=False)
    optimizer: torch.optim.Optimizer = field(init=False)
    scheduler: Any = field(init=False)
    algorithm: Algorithm = field(init=False)
    critic: RunCritic | None = field(init=False)
    teacher: Any = field(init=False)
    monitors: Monitors = field(init=False)
    # restore
    start_step: int = 0
    # open_reporting
    tracker: Tracker = field(init=False)
    summary: RunSummary = field(init=False)
    progress: Progress = field(init=False)
    stop_signals: StopSignals = field(init=False)
    first_step_started: float = 0.0  # train.time_limit_minutes counts from here

    @property
    def is_main(self) -> bool:
        """This process writes metrics and checkpoints (the only process, or torchrun's rank 0)."""
        return self.dist is None or self.dist.is_main

    @property
    def rank(self) -> int:
        return self.dist.rank if self.dist is not None else 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_run(run: Run, *, overwrite: bool) -> None:
    """Checks that need nothing loaded, then the model (with a checkpoint's weights when resuming),
    the update's precision, the run directory, and where episodes are played."""
    cfg, run_dir = run.cfg, run.run_dir
    # Before anything slow loads. Under torchrun rank 0 alone judges: the others may start after it
    # made the directory.
    main_rank = os.environ.get("RANK", "0") == "0"
    check_run_dir(run_dir, resume=run.resume, overwrite=overwrite, main=main_rank)
    if main_rank:
        require_trackers(cfg.tracking.trackers)  # a missing tracker library, before the model loads
    seed_everything(cfg.train.seed)
    if cfg.train.keep_freed_memory and resolve_device(cfg.model.device).type == "cpu":
        keep_freed_memory()  # for the rest of the process (rlvr.allocator): a CPU tuning

    # Under torchrun: this process is one rank; rank 0 alone writes metrics and checkpoints.
    run.dist = dist = torch_dist_context(cfg)
    if dist is not None:
        run.closers.append(dist.close)  # closed last
    run.sources = Sources(cfg, run.config_dir, run.tasks)
    # levels / scheduled weights (train/curriculum.py)
    run.curriculum = Curriculum(cfg, run.sources, run.tasks)
    # Before any weights load: a run that cannot fit on its GPU is refused with the smallest change
    # that fits (rlvr plan), not an out-of-memory error an hour in; on the CPU it only warns.
    check_fits(cfg, resolve_device(cfg.model.device))
    run.policy = policy = build_policy(cfg)
    run.checkpoint = latest_checkpoint(run_dir) if run.resume else None
    if run.checkpoint is not None:
        # Into the unsharded model, before anything copies it (the fsdp sampling copy, an async
        # producer's) or torchrun broadcasts and shards it (DistContext.prepare_policy).
        load_weights_into(policy.model, run.checkpoint, policy.lora)
    run.device = device_of(policy.model)
    enable_tf32(run.device)  # the fp32 matmuls left on a GPU (a no-op on the CPU)
    # `model.bf16: auto`: the update's precision measured on this host (train/precision_choice.py)
    run.precision = precision_choice.PrecisionChoice(
        use_bf16(cfg.model), f"model.bf16: {cfg.model.bf16}"
    )
    if cfg.model.precision == "lean":  # bf16 weights: nothing to choose or time
        run.precision = precision_choice.PrecisionChoice(
            True, "model.precision: lean, bf16 weights"
        )
    elif cfg.model.bf16 == "auto":
        run.precision = precision_choice.resolve(
            policy.model, cfg.model.name, distributed=dist is not None
        )
    # Made only now: a config, task or model that fails to load leaves no half-made run directory.
    open_run_dir(run_dir, overwrite=overwrite, main=run.is_main)
    # The effective config (a resume may change fields with --set), so `rlvr eval RUN_DIR` sees it.
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    sampling = SamplingParams(
        n=cfg.sampling.group_size,
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        max_new_tokens=cfg.sampling.max_new_tokens,
        stop=tuple(cfg.sampling.stop),
    )
    run.limits = rollout_limits(cfg)
    # Where episodes are played (in process, a server, the user's agent, Ray, a background thread)
    run.plan = RolloutPlan(
        cfg, policy, run.sources, sampling, run.limits,
        config_dir=run.config_dir, tasks=run.tasks, dist=dist, run_dir=run_dir,
    )  # fmt: skip
    run.closers.append(run.plan.close)
    run.plan.store_frozen_base_bf16()  # LoRA, bf16 update, bf16 sampling copy: the base in bf16


def build_trainer(run: Run) -> None:
    """The watchdog, the ranks' identical start (ddp) or shards (fsdp), the optimizer, the
    algorithm with its critic (ppo) or teacher (distill), and the failure-mode monitors."""
    cfg, policy, dist = run.cfg, run.policy, run.dist
    # A phase past its deadline ends the process with every stack on disk (observe/watchdog.py).
    run.watchdog = Watchdog.from_config(
        cfg.watchdog,
        run.run_dir,
        rank=run.rank,
        write_event=run.is_main,
        # Raises while there is none; the watchdog then says there is no checkpoint yet.
        last_checkpoint=lambda: latest_checkpoint(run.run_dir),
    )
    run.watchdog.on_hang.append(run.plan.abandon)  # a launched server would outlive os._exit
    run.closers.append(run.watchdog.close)
    run.watchdog.start()
    run.generator = run.plan.generator
    if dist is not None:
        # ddp: identical start on every rank; fsdp: shard (bf16 gathers for a bf16 update)
        dist.prepare_policy(policy, bf16=run.precision.bf16)
    run.optimizer, run.scheduler = build_optimizer(policy, cfg)
    run.algorithm = algorithm = ALGORITHMS.resolve(cfg.algorithm)
    # ppo's value model and distill's teacher: built only for the algorithms that use them.
    run.critic = (
        RunCritic(cfg, int(policy.tokenizer.pad_token_id), device_of(policy.model), dist)
        if algorithm.needs_critic
        else None
    )
    run.teacher = build_teacher(cfg, policy) if algorithm.needs_teacher else None
    if dist is not None and run.teacher is not None:
        # sharded under fsdp (gathered in bf16 as the policy is): forwards in step with the policy
        dist.prepare_model(run.teacher, run.precision.bf16)
    metrics_of = {s.metric for s in run.sources}
    run.monitors = Monitors(
        cfg.monitors,
        accuracy=next(iter(metrics_of)) if len(metrics_of) == 1 else None,
        optimised=[name for name, w in run.sources.reward_weights.items() if w != 0],
        extra=[mismatch_rule(cfg)],  # sampler vs trainer log-probs (observe/mismatch.py)
    )


def restore(run: Run) -> None:
    """A resumed run's state from its checkpoint: the critic, optimizer and scheduler, the
    generator's RNG, curriculum and task samplers, the monitors and the mitigations they made."""
    if run.checkpoint is None:
        return
    if run.critic is not None:
        run.critic.load(run.checkpoint)
    dist = run.dist
    state, generator_rng = load_training_state(
        run.checkpoint,
        run.optimizer,
        run.scheduler,
        rank=run.rank,
        sharded_model=run.policy.model if dist is not None and dist.fsdp else None,
    )
    run.generator.set_state(generator_rng)
    run.curriculum.load_state_dict(state.get("curriculum"))  # before the samplers
    run.sources.load_state_dict(state["sampler"])
    run.start_step = int(state["step"])
    run.monitors.load_state_dict(state.get("monitors", {}))
    run.cfg = apply_changes(run.cfg, run.monitors.changes)  # mitigations made before the checkpoint
    ensure_reference(run.policy, run.cfg, dist, run.precision.bf16)
    run.plan.after_resume(run.start_step)


def open_reporting(run: Run) -> None:
    """The tracker, the summary, the progress display and its first lines, a resumed run's metric
    history (replayed into the monitors), and the Ctrl-C / SIGTERM handler."""
    cfg, start_step = run.cfg, run.start_step
    run.tracker = (Tracker if run.is_main else NullTracker)(
        run.run_dir,
        report_to=cfg.tracking.trackers,
        project=cfg.tracking.project,
        run_name=cfg.tracking.run_name or run.run_dir.name,
        config=config_to_dict(cfg),
        resume_step=start_step if run.resume else None,
    )
    run.closers.append(run.tracker.close)
    run.summary = RunSummary(run_dir=run.run_dir, steps_done=start_step)
    run.progress = progress = Progress(
        total=cfg.train.steps, start=start_step, enabled=cfg.tracking.progress and run.is_main
    )
    run.closers.append(progress.close)
    for line in startup_lines(cfg, run.policy, run.device, run.generator):
        progress.note(escape(line))
    progress.note(escape(run.precision.describe()))
    if run.resume and run.is_main:
        progress.console.print(
            escape(f"resuming from step {start_step} (checkpoint {run.checkpoint})"),
            soft_wrap=True,  # a path to copy, never broken across lines
        )
    if run.resume and run.tracker.metrics_path.exists():
        history = read_metrics(run.run_dir)
        run.monitors.replay(history)  # the history up to the checkpoint
        # The summary's evals as if the run had never stopped: the base model's eval first.
        run.summary.eval_history = eval_history(history)
    # Ctrl-C / SIGTERM from here on: the step finishes, a checkpoint is saved, then we stop.
    run.stop_signals = StopSignals()
    run.closers.append(run.stop_signals.restore)


def run_eval(run: Run, failures: list[str] | None = None) -> dict[str, float]:
    """Held-out accuracy of the current policy (`eval/...` metrics); `failures` collects the
    rollouts that failed, by name."""
    cfg = run.cfg
    return run.plan.evaluate(
        lambda: evaluate_sources(
            run.sources,
            run.generator,
            run.policy.tokenizer,
            n=cfg.eval.n,
            max_new_tokens=cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens,
            stop=tuple(cfg.sampling.stop),
            limits=run.limits,
            failures=failures,
        )
    )


def save(run: Run, step: int) -> None:
    """A checkpoint of `step` (every rank takes part: its RNGs, and under fsdp its optimizer shard)."""
    cfg, dist, plan = run.cfg, run.dist, run.plan
    plan.before_save()  # async: producer idle; fsdp: full weights gathered (collective)
    # fsdp without an fp32 sampling copy (a server samples, or the copy is bf16): gather the
    # weights here (collective), so a checkpoint holds the fp32 masters
    copy = plan.copy_model if plan.copy_model is not None and not plan.copy_bf16 else None
    gather = dist is not None and dist.fsdp and copy is None
    save_checkpoint(
        run.run_dir,
        step,
        model=copy if copy is not None else run.policy.model,
        model_state=dist.full_state_dict(run.policy.model, keep=run.is_main) if gather else None,
        tokenizer=run.policy.tokenizer,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        generator_rng=run.generator.get_state(),
        sampler_state=run.sources.state_dict(),
        extra_state={
            "algorithm": cfg.algorithm,
            "monitors": run.monitors.state_dict(),
            "curriculum": run.curriculum.state_dict(),
        },
        keep_last=cfg.checkpoint.keep_last,
        save_extra=run.critic.save if run.critic is not None else None,
        dist=dist,
        sharded_model=run.policy.model if dist is not None and dist.fsdp else None,
    )


def ensure_reference(
    policy: Policy, cfg: RunConfig, dist: DistContext | None = None, bf16: bool = False
) -> None:
    """Give a full fine-tuning run a reference once beta > 0 (a mitigation raised it from 0): the
    base model, frozen, which is what a run started with that beta would have (so a resume matches).
    LoRA needs none: its reference is the base with adapters disabled. Under torchrun (`dist`) every
    rank calls it at the same step (the alerts are rank 0's, broadcast) and the reference is placed
    like the policy's: sharded under fsdp, gathered in bf16 when the update is (`bf16`)."""
    if cfg.objective.beta > 0 and not policy.lora and policy._reference is None:
        # Loading must not move the run's RNG: a resumed run loads it at another moment.
        with torch.random.fork_rng(devices=[]):
            reference = load_policy(
                cfg.model.name, device=device_of(policy.model), dtype=weights_dtype(cfg.model)
            ).model
            policy._reference = reference.eval().requires_grad_(False)
        if dist is not None:
            dist.prepare_model(policy._reference, bf16)
