"""Env-bound rollouts on Ray rollout workers: 1 worker vs 2 (and the in-process loop beside them).

The environment dominates on purpose: the tiny random model samples a few tokens per turn, and each
env step runs ~60-100 ms of pure-Python Game of Life (benchmarks/ray_scaling_env.py), which holds the
interpreter lock, so `rollout.env_workers` threads cannot overlap steps and only processes can.
Every configuration plays the same task batches: one warm-up step, then `--steps` timed steps of
`RayRollout.rollout` (P tasks x G episodes x 3 turns each). Printed side by side: seconds per step
(mean and best), generation's share of the workers' busy time (the rest is env steps, tokenizing
and scoring), the busiest minus the idlest worker's seconds, and `ray_scaling_speedup_2_over_1`. The configurations take turns on each batch (the machine is
shared: a change in its load then hits all of them alike).

Usage: python benchmarks/ray_scaling.py [--tasks 8] [--group 4] [--steps 3] [--no-inprocess]
A measuring instrument, not a test: the machine is shared and noisy. Needs Ray (the `scale` extra).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault(
    "OMP_NUM_THREADS", "1"
)  # one thread per worker: the workers are the parallelism
os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent


def make_cfg(args: argparse.Namespace, workers: int) -> Any:
    from rlvr.config import RunConfig

    return RunConfig.model_validate(
        {
            "model": {"name": "tiny-random"},
            "task": {
                "source": "env",
                "env": {
                    "name": f"{HERE / 'ray_scaling_env.py'}:LifeFamily",
                    "options": {"generations": args.generations, "turns": 3},
                    "num_train": 200,
                    "num_heldout": 10,
                },
            },
            "sampling": {
                "group_size": args.group,
                "prompts_per_step": args.tasks,
                "max_new_tokens": args.max_new_tokens,
            },
            "rollout": {"max_turns": 3, "max_total_tokens": 256},
            "distributed": {"ray": True, "rollout_workers": workers, "worker_cpus": 1},
            "tracking": {"trackio": False},
        }
    )


def sampling_of(cfg: Any) -> Any:
    from rlvr.rollout.generator import SamplingParams

    s = cfg.sampling
    return SamplingParams(
        n=s.group_size, temperature=s.temperature, max_new_tokens=s.max_new_tokens
    )


def env_step_ms(args: argparse.Namespace, tasks: list[Any]) -> float:
    """The mean time of one env step, measured here in the driver."""
    from ray_scaling_env import LifeFamily

    family = LifeFamily({"generations": args.generations})
    times = []
    for i, task in enumerate(tasks[:4]):
        env = family.make(task)
        env.reset()
        started = time.perf_counter()
        env.step(str(i))
        times.append(time.perf_counter() - started)
    return 1000 * statistics.mean(times)


class InProcess:
    """The loop's own rollout: rollout_groups in this process, env steps on threads."""

    name = "in-process (env threads)"

    def __init__(self, cfg: Any) -> None:
        from rlvr.build import build_generator, build_policy, rollout_limits
        from rlvr.scale.ray_rollout import _TimedGenerator
        from rlvr.train.sources import Sources

        self.sources = Sources(cfg)
        self.policy = build_policy(cfg)
        self.generator = _TimedGenerator(build_generator(self.policy, cfg))
        self.sampling, self.limits = sampling_of(cfg), rollout_limits(cfg)

    def step(self, tasks: list[Any]) -> dict[str, float]:
        from rlvr.rollout.engine import rollout_groups

        self.generator.seconds = 0.0
        started = time.perf_counter()
        rollout_groups(
            tasks,
            self.sources.make_env,
            self.generator,
            self.policy.tokenizer,
            self.sampling,
            self.sources.scoring,
            self.limits,
        )
        wall = time.perf_counter() - started
        return {"s": wall, "generate_share": self.generator.seconds / wall}

    def close(self) -> None:
        pass


class OnRay:
    """RayRollout with `workers` actors, synced once to the learner's weights."""

    def __init__(self, cfg: Any, workers: int, policy: Any) -> None:
        from rlvr.build import rollout_limits
        from rlvr.scale.ray_rollout import RayRollout

        self.name = f"ray, {workers} worker(s)"
        self.sampling, self.limits = sampling_of(cfg), rollout_limits(cfg)
        started = time.perf_counter()
        self.rollout = RayRollout(cfg)
        self.start_s = time.perf_counter() - started
        started = time.perf_counter()
        self.rollout.sync_weights(policy)
        self.sync_s = time.perf_counter() - started

    def step(self, tasks: list[Any]) -> dict[str, float]:
        started = time.perf_counter()
        self.rollout.rollout(tasks, self.sampling, self.limits)
        wall = time.perf_counter() - started
        m = self.rollout.last_metrics
        return {
            "s": wall,
            "generate_share": m["rollout_workers/generate_sum_s"] / m["rollout_workers/busy_sum_s"],
            "busy_spread_s": m["rollout_workers/busy_max_s"] - m["rollout_workers/busy_min_s"],
        }

    def close(self) -> None:
        self.rollout.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=8, help="tasks (prompts) per step")
    parser.add_argument("--group", type=int, default=4, help="episodes per task (G)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--generations", type=int, default=40, help="Life generations per step")
    parser.add_argument("--no-inprocess", action="store_true", help="skip the in-process run")
    args = parser.parse_args()

    import sys

    import ray

    sys.path.insert(0, str(HERE))  # ray_scaling_env for the driver-side timing
    from rlvr.build import build_policy
    from rlvr.train.sources import Sources

    cfg = make_cfg(args, 1)
    sources = Sources(cfg)
    batches = [sources.next_batch(args.tasks) for _ in range(args.steps + 1)]
    policy = build_policy(cfg)
    episodes = args.tasks * args.group
    print(
        f"{args.tasks} tasks x G={args.group} = {episodes} episodes x 3 turns per step, "
        f"{args.max_new_tokens} new tokens per turn; env step {env_step_ms(args, batches[0]):.0f} ms "
        f"(measured in the driver); {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} at start"
    )
    # Every configuration stays up and they take turns on each batch, so a change in the load of
    # this shared machine hits them alike. Ray's CPU count is bookkeeping: an idle actor uses none.
    ray.init(num_cpus=3, include_dashboard=False, object_store_memory=256 * 1024**2)
    runners: list[Any] = [] if args.no_inprocess else [InProcess(cfg)]
    try:
        runners += [OnRay(make_cfg(args, workers), workers, policy) for workers in (1, 2)]
        rows: dict[str, list[dict[str, float]]] = {r.name: [] for r in runners}
        for i, tasks in enumerate(batches):
            for runner in runners:
                row = runner.step(tasks)
                if i:  # the first batch is the warm-up
                    rows[runner.name].append(row)
    finally:
        for runner in runners:
            runner.close()
        ray.shutdown()
    results = {
        name: {key: statistics.mean(row[key] for row in steps) for key in steps[0]}
        for name, steps in rows.items()
    }
    for name, steps in rows.items():
        results[name]["s_min"] = min(row["s"] for row in steps)
    for runner in runners:
        if isinstance(runner, OnRay):
            results[runner.name].update(start_s=runner.start_s, sync_s=runner.sync_s)

    print(
        f"{'configuration':<26}{'s/step':>8}{'best':>8}{'generate':>10}{'env+rest':>10}"
        f"{'spread s':>10}"
    )
    for name, r in results.items():
        spread = f"{r['busy_spread_s']:.2f}" if "busy_spread_s" in r else "-"
        share = r["generate_share"]
        print(
            f"{name:<26}{r['s']:>8.2f}{r['s_min']:>8.2f}{share:>10.0%}{1 - share:>10.0%}"
            f"{spread:>10}"
        )
    for workers in (1, 2):
        r = results[f"ray, {workers} worker(s)"]
        print(
            f"ray_{workers}_workers: start {r['start_s']:.1f} s, first sync_weights {r['sync_s']:.3f} s"
        )
    one, two = results["ray, 1 worker(s)"], results["ray, 2 worker(s)"]
    print(f"ray_scaling_speedup_2_over_1={one['s'] / two['s']:.2f}")
    print(f"ray_scaling_speedup_2_over_1_best_step={one['s_min'] / two['s_min']:.2f}")
    if "in-process (env threads)" in results:
        inproc = results["in-process (env threads)"]
        print(f"ray_2_over_inprocess={inproc['s'] / two['s']:.2f}")
    print(f"load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
