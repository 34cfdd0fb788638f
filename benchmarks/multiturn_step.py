"""Training-step time of the multi-turn examples with and without the cross-turn KV cache.

benchmarks/turn_cache.py times the rollout engine on a scripted env; this script times what a user
runs: a few GRPO steps of an example config (examples/env_calculator.yaml, env_frozenlake.yaml) on
the bundled SmolLM2-135M-Instruct, once with `generator.turn_cache=true` and once with `false`,
interleaved `--repeats` times (the machine is shared: read the ratios). Same seed, so the first
steps of both runs sample the same episodes up to the numeric noise of the two prefill paths.
Reports per configuration the median over steps of `rollout_time` and `step_time` (seconds, from
the run's metrics.jsonl), and turns per episode, the best repeat kept.

Usage: python benchmarks/multiturn_step.py [--configs env_calculator.yaml env_frozenlake.yaml]
       [--steps 3] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from turn_cache import cpu  # benchmarks/turn_cache.py: lscpu model name and bf16 flag

ROOT = Path(__file__).resolve().parent.parent


def run(config: str, cache: bool, steps: int, out: Path) -> dict[str, float]:
    """`rlvr train` for `steps` steps in a fresh process; medians of its per-step timings."""
    overrides = [
        f"generator.turn_cache={'true' if cache else 'false'}",
        f"train.steps={steps}",
        "eval.at_start=false",
        "eval.at_end=false",
        "eval.every=0",
        "checkpoint.every=0",
        "tracking.progress=false",
        f"output_dir={out}",
    ]
    command = [sys.executable, "-m", "rlvr.cli", "train", str(ROOT / "examples" / config)]
    for item in overrides:
        command += ["--set", item]
    subprocess.run(command, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "rollout_time" in r and "event" not in r]
    turns = [r.get("turns/mean") for r in steps_rows if r.get("turns/mean") is not None]
    return {
        "rollout_s": statistics.median(r["rollout_time"] for r in steps_rows),
        "step_s": statistics.median(r["step_time"] for r in steps_rows),
        "turns": statistics.fmean(turns) if turns else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs", nargs="*", default=["env_calculator.yaml", "env_frozenlake.yaml"]
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    print(f"CPU: {cpu()}; {args.steps} steps per run, best of {args.repeats}")
    print(f"{'config':<24} {'turn_cache':<10} {'rollout s':>9} {'step s':>7} {'turns':>6}")
    for config in args.configs:
        best: dict[bool, dict[str, float]] = {}
        for _ in range(args.repeats):
            for cache in (True, False):
                with tempfile.TemporaryDirectory() as tmp:
                    result = run(config, cache, args.steps, Path(tmp) / "run")
                if cache not in best or result["rollout_s"] < best[cache]["rollout_s"]:
                    best[cache] = result
        for cache in (True, False):
            r = best[cache]
            print(
                f"{config:<24} {cache!s:<10} {r['rollout_s']:9.1f} {r['step_s']:7.1f} "
                f"{r['turns']:6.2f}"
            )
        ratio = best[False]["rollout_s"] / best[True]["rollout_s"]
        print(f"{config}: rollout_time cache off / on = {ratio:.2f}")


if __name__ == "__main__":
    main()
