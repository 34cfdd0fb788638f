"""Rollout workers on Ray actors (`distributed.ray: true`): episodes played in other processes.

Why processes: an environment's step is Python, and Python threads share one interpreter lock, so
`rollout.env_workers` threads only overlap steps that wait (a sandboxed program, a tool call). A
simulation or search in the env itself runs one step at a time however many threads there are.
Each actor is its own interpreter with its own copy of the policy, so W actors play W chunks of a
step's tasks truly at once (on W cores, or on W machines of a cluster).

    learner                                    actor k (k = 0..W-1)
    tasks[P] --split into W contiguous chunks--> rollout_groups(chunk_k)  (its policy copy, its envs)
    groups[P] <--concatenated in task order----- groups of chunk_k
    update; sync_weights: trainable_state -> ray.put once -> load_trainable_state in every actor

Each actor builds what the learner builds for sampling (build_policy, build_generator, Sources for
envs and scoring, the same rollout limits), but no reference model (beta 0 there: sampling never
needs it) and its own sampling seed, `train.seed + 1000 * (k + 1)`, so no two actors draw the same
samples. The actors start from the configured base weights: a learner that resumes from a checkpoint
must call `sync_weights` before the first rollout.

Failures: an actor that raises, fails to build, or dies is reported as a one-line RuntimeError naming
its index and the cause, as soon as Ray reports it, never a hang. With `worker_gpus` > 0 an actor
loads its copy onto the GPU Ray reserved for it and samples there; with 0, on its CPUs.

Weight sync: LoRA sends the adapters (fp32: small). Full fine-tuning sends the linear weights in
bf16 when the actors sample from a bf16 weight copy (rlvr's decode path, `decode_dtype` bf16: the
default on a bf16 GPU), half the bytes of fp32 and exactly the values their copy would round to;
else fp32. Each sync's bytes and seconds are logged (`sync/weight_bytes`, `sync/weight_seconds`).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlvr.config import RunConfig
from rlvr.errors import ConfigError
from rlvr.models import Policy
from rlvr.records import Group, Task
from rlvr.rollout.engine import RolloutLimits, rollout_groups
from rlvr.rollout.generator import Completion, Generator, SamplingParams
from rlvr.scale import chunk_bounds
from rlvr.scale.weights import load_trainable_state, state_bytes, trainable_state
from rlvr.tasks import TaskSplits

# A local cluster's shared-memory object store: the weights of one sync live there at a time (the
# tiny model's are ~100 kB, SmolLM2-135M's 0.5 GB); Ray spills larger objects to disk.
LOCAL_OBJECT_STORE_BYTES = 1 << 30
# How long the actors may take to start (import torch, load the model, build the tasks) before the
# cluster is deemed unable to place them (too few CPUs/GPUs for num_workers x worker_cpus/gpus).
START_TIMEOUT_S = 600.0


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "distributed.ray needs Ray: pip install 'rlvr[scale]' (or pip install ray)"
        ) from None
    return ray


def seed_for_worker(seed: int, index: int) -> int:
    """The sampling seed of actor `index`: apart from the learner's (`seed`) and every other actor's."""
    return seed + 1000 * (index + 1)


def describe_failure(err: BaseException) -> str:
    """'Type: first line of the message' of what went wrong in an actor (Ray's wrapper removed)."""
    cause = getattr(err, "cause", None)  # RayTaskError keeps the exception the actor raised
    if isinstance(cause, BaseException):
        err = cause
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else '(no message)'}"


class _TimedGenerator:
    """A Generator that adds the seconds spent in `generate` to `seconds` (the rest of a rollout is
    env steps, tokenizing and scoring)."""

    def __init__(self, inner: Generator) -> None:
        self.inner = inner
        self.seconds = 0.0

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        started = time.perf_counter()
        try:
            return self.inner.generate(prompts, sampling)
        finally:
            self.seconds += time.perf_counter() - started

    def turn_session(self) -> contextlib.AbstractContextManager[Any]:
        """The inner generator's cross-turn KV cache session (rollout/hf.py), when it has one: the
        engine looks for this method, and a wrapper without it would turn the cache off."""
        session = getattr(self.inner, "turn_session", None)
        return session() if session is not None else contextlib.nullcontext()


class RolloutWorker:
    """What runs inside one Ray actor: a policy copy, its generator, the run's envs and scoring.

    Construction never raises: a failure to build is kept and raised by `ready()`, so it reaches the
    learner as the original exception (Ray reports an actor that dies in its constructor only as a
    traceback inside a message)."""

    def __init__(
        self,
        cfg: RunConfig,
        config_dir: Path | None,
        tasks: TaskSplits | None,
        index: int,
        threads: int,
    ) -> None:
        self.index = index
        self.setup_error: BaseException | None = None
        try:
            self._build(cfg, config_dir, tasks, threads)
        except Exception as exc:
            self.setup_error = exc

    def _build(
        self, cfg: RunConfig, config_dir: Path | None, tasks: TaskSplits | None, threads: int
    ) -> None:
        from transformers.utils import logging as hf_logging

        from rlvr.build import build_generator, build_policy
        from rlvr.train.sources import Sources

        hf_logging.disable_progress_bar()  # W copies of one loading bar in the driver's output
        torch.set_num_threads(threads)
        seed = seed_for_worker(cfg.train.seed, self.index)
        torch.manual_seed(seed)
        # No reference model (sampling never reads it) and this actor's own sampling seed.
        # The actor's device: the GPU Ray gave it (Ray makes it the actor's cuda:0), else the host,
        # never the trainer's `model.device: auto` (which would put every worker on GPU 0).
        gpu = cfg.distributed.worker_gpus > 0 and torch.cuda.is_available()
        cfg = cfg.model_copy(
            update={
                "objective": cfg.objective.model_copy(update={"beta": 0.0}),
                "train": cfg.train.model_copy(update={"seed": seed}),
                "model": cfg.model.model_copy(update={"device": "cuda:0" if gpu else "cpu"}),
            }
        )
        self.policy: Policy = build_policy(cfg)
        self.policy.model.eval()
        self.generator = _TimedGenerator(build_generator(self.policy, cfg))
        self.sources = Sources(cfg, config_dir, tasks)

    def ready(self) -> int:
        if self.setup_error is not None:
            raise self.setup_error
        return os.getpid()

    def rollout(
        self, tasks: Sequence[Task], sampling: SamplingParams, limits: RolloutLimits
    ) -> tuple[list[Group], float, float]:
        """Groups of `tasks` in order, seconds busy, seconds of those spent generating."""
        self.ready()
        started = time.perf_counter()
        self.generator.seconds = 0.0
        groups = rollout_groups(
            tasks,
            self.sources.make_env,
            self.generator,
            self.policy.tokenizer,
            sampling,
            self.sources.scoring,
            limits,
        )
        return groups, time.perf_counter() - started, self.generator.seconds

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        self.ready()
        load_trainable_state(self.policy.model, state)

    def samples_from_bf16_copy(self) -> bool:
        """Whether this actor's sampler reads a bf16 copy of full fine-tuned weights (so bf16 weight
        syncs lose nothing it would not round away itself)."""
        from rlvr.rollout.fast_decode import decline_reason

        self.ready()
        g = self.generator.inner
        bf16_copy = (
            getattr(g, "decode", None) == "fast"
            and getattr(g, "decode_dtype", None) == torch.bfloat16
        )
        return bf16_copy and not self.policy.lora and decline_reason(self.policy.model) is None


class RayRollout:
    """`distributed.rollout_workers` Ray actors playing a step's episodes, a contiguous chunk each.

    `rollout` returns what `rollout_groups` would in the learner (one Group per task, in the order
    of `tasks`), sampled by the weights of the last `sync_weights`.
    """

    def __init__(
        self, cfg: RunConfig, config_dir: Path | None = None, tasks: TaskSplits | None = None
    ) -> None:
        ray = _import_ray()
        dist = cfg.distributed
        self._ray = ray
        self._started_ray = False
        self._workers: list[Any] = []
        self._last_metrics: dict[str, float] = {}
        self._sync_metrics: dict[str, float] = {}
        self.sync_dtype: torch.dtype | None = None  # None: every weight in its own dtype (fp32)
        if not ray.is_initialized():
            if dist.ray_address is None:
                # A local cluster on this machine: room for every actor even on a small box (Ray
                # would otherwise leave an actor pending forever on a 2-core machine).
                ray.init(
                    num_cpus=max(
                        os.cpu_count() or 1, math.ceil(dist.rollout_workers * dist.worker_cpus)
                    ),
                    include_dashboard=False,
                    object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                )
            else:
                ray.init(address=dist.ray_address)
            self._started_ray = True
        actor = ray.remote(RolloutWorker).options(
            num_cpus=dist.worker_cpus, num_gpus=dist.worker_gpus, max_restarts=0
        )
        tasks_ref = ray.put(tasks) if tasks is not None else None
        threads = max(1, int(dist.worker_cpus))
        try:
            self._workers = [
                actor.remote(cfg, config_dir, tasks_ref, k, threads)
                for k in range(dist.rollout_workers)
            ]
            self._gather(
                [(k, w.ready.remote()) for k, w in enumerate(self._workers)],
                "failed to start",
                timeout_s=START_TIMEOUT_S,
            )
            bf16_copies = self._gather(
                [(k, w.samples_from_bf16_copy.remote()) for k, w in enumerate(self._workers)],
                "failed to report its sampler",
            )
            self.sync_dtype = torch.bfloat16 if all(bf16_copies) else None
        except BaseException:
            self.close()
            raise

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def rollout(
        self, tasks: Sequence[Task], sampling: SamplingParams, limits: RolloutLimits
    ) -> list[Group]:
        started = time.perf_counter()
        calls = [
            (k, self._workers[k].rollout.remote(list(tasks[a:b]), sampling, limits))
            for k, (a, b) in enumerate(chunk_bounds(len(tasks), self.num_workers))
            if b > a
        ]
        results = self._gather(calls, "failed during a rollout")
        groups: list[Group] = []
        busy = [0.0] * self.num_workers  # a worker given no task this step was idle: 0 s
        generating = 0.0
        for (k, _), (chunk_groups, busy_s, generate_s) in zip(calls, results, strict=True):
            groups.extend(chunk_groups)
            busy[k] = busy_s
            generating += generate_s
        if len(groups) != len(tasks) or any(
            g.task.id != t.id for g, t in zip(groups, tasks, strict=True)
        ):
            raise RuntimeError("rollout workers returned groups out of the order of their tasks")
        self._last_metrics = {
            "rollout_workers/wall_s": time.perf_counter() - started,
            "rollout_workers/busy_max_s": max(busy),
            "rollout_workers/busy_min_s": min(busy),
            # Summed over workers: generation's share of the work; the rest is envs and scoring.
            "rollout_workers/busy_sum_s": sum(busy),
            "rollout_workers/generate_sum_s": generating,
        }
        return groups

    def sync_weights(self, policy: Policy) -> None:
        """Every actor's policy copy takes the learner's trainable weights (LoRA: the adapters);
        returns once all have them."""
        started = time.perf_counter()
        state = trainable_state(policy.model, self.sync_dtype)
        state_ref = self._ray.put(state)
        self._gather(
            [(k, w.load_weights.remote(state_ref)) for k, w in enumerate(self._workers)],
            "failed to load synced weights",
        )
        self._sync_metrics = {
            "sync/weight_bytes": float(state_bytes(state)),
            "sync/weight_seconds": time.perf_counter() - started,
        }

    @property
    def last_metrics(self) -> dict[str, float]:
        """Timings of the last `rollout`: its wall time, the busiest and idlest worker's seconds,
        and all workers' busy and generating seconds summed."""
        return {**self._last_metrics, **self._sync_metrics}

    def close(self) -> None:
        """Kill the actors; shut Ray down only when this object started it."""
        for worker in self._workers:
            with contextlib.suppress(Exception):  # already dead: nothing left to stop
                self._ray.kill(worker)
        self._workers = []
        if self._started_ray and self._ray.is_initialized():
            self._ray.shutdown()
        self._started_ray = False

    def _gather(
        self, calls: list[tuple[int, Any]], doing: str, timeout_s: float | None = None
    ) -> list[Any]:
        """Results of (worker index, object ref) calls, in call order. The first failure to arrive
        raises at once (the others are not waited for) with the worker index and its cause."""
        ray = self._ray
        index_of = {ref: k for k, ref in calls}
        results: dict[Any, Any] = {}
        pending = [ref for _, ref in calls]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            if not done:
                late = ", ".join(str(index_of[ref]) for ref in pending)
                raise RuntimeError(
                    f"rollout workers {late} did not start within {timeout_s:g} s: the cluster may "
                    f"lack the resources (available: {ray.available_resources()})"
                )
            for ref in done:
                try:
                    results[ref] = ray.get(ref)
                except Exception as err:
                    raise RuntimeError(
                        f"rollout worker {index_of[ref]} {doing}: {describe_failure(err)}"
                    ) from err
        return [results[ref] for _, ref in calls]

    def __enter__(self) -> RayRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
