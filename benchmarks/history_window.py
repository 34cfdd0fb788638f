"""Training-step time of the grid envs with full history vs a history window (`rollout.history`).

Runs a few GRPO steps of examples/env_frozenlake.yaml and env_sokoban.yaml (`--model`: the tiny
random model by default, whose character-level tokenizer makes every map observation ~150-250 tokens
long; `--model smollm2-135m-instruct` for the examples' own model, ~5 min a step on 2 shared cores)
in fresh processes, once with `rollout.history=full` (each episode one row of
its whole conversation) and once with `rollout.history=window` (each turn sampled from the opening +
the last K turns and trained as its own row), and prints, side by side, the medians over steps of
`step_time`, `rollout_time` and `update_time` (seconds, from metrics.jsonl), the update's GFLOP
(`perf/update_gflops`), the rows trained and the turns per episode. Same seed, so both runs start
from the same tasks; their episodes part ways once a window drops a turn. The token budget is
raised (`--max-total-tokens`, whole episode in both modes) so that episodes run to the turn cap
rather than to the budget: the long-episode case a window is for. Every group is kept and every
row forwarded (no StarPO-S filter, no skipping of zero-advantage rows), so the update's cost does
not depend on which rewards the random policy happened to earn.

Usage: python benchmarks/history_window.py [--configs env_frozenlake.yaml env_sokoban.yaml]
       [--model tiny-random] [--steps 3] [--prompts 4] [--group 8] [--turns 2]
       [--max-total-tokens 4000] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _machine import machine  # lscpu's model name, bf16 kind, torch threads, commit

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("step_s", "rollout_s", "update_s", "update_gflop", "rows", "turns")


def run(config: str, history: str, args: argparse.Namespace, out: Path) -> dict[str, float]:
    """`rlvr train` for `args.steps` steps in a fresh process; medians of its per-step numbers."""
    overrides = [
        f"rollout.history={history}",
        f"rollout.history_turns={args.turns}",
        f"train.steps={args.steps}",
        f"sampling.prompts_per_step={args.prompts}",
        f"sampling.group_size={args.group}",
        f"model.name={args.model}",
        f"rollout.max_total_tokens={args.max_total_tokens}",
        # Every row forwarded, whatever its rewards: the update's cost is what is compared.
        "filter.group_filter=none",
        "train.skip_zero_advantage_rows=false",
        "eval.at_start=false",
        "eval.at_end=false",
        "eval.every=0",
        "checkpoint.every=0",
        "checkpoint.save_final=false",
        "tracking.progress=false",
        f"output_dir={out}",
        *args.set,
    ]
    command = [sys.executable, "-m", "rlvr.cli", "train", str(ROOT / "examples" / config)]
    for item in overrides:
        command += ["--set", item]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step_time" in r and "event" not in r]

    def median(key: str) -> float:
        values = [float(r[key]) for r in steps if r.get(key) is not None]
        return statistics.median(values) if values else float("nan")

    return {
        "step_s": median("step_time"),
        "rollout_s": median("rollout_time"),
        "update_s": median("update_time"),
        "update_gflop": median("perf/update_gflops"),
        "rows": median("update/rows_trained"),
        "turns": median("turns/mean"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", default=["env_frozenlake.yaml", "env_sokoban.yaml"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", default="tiny-random", help="model.name")
    parser.add_argument("--prompts", type=int, default=4, help="sampling.prompts_per_step")
    parser.add_argument("--group", type=int, default=8, help="sampling.group_size")
    parser.add_argument("--max-total-tokens", type=int, default=4000)
    parser.add_argument("--turns", type=int, default=2, help="rollout.history_turns (K)")
    parser.add_argument("--set", nargs="*", default=[], help="more config overrides")
    args = parser.parse_args()
    for line in machine().header():
        print(line)
    print(
        f"model {args.model}; {args.steps} steps per run (medians), {args.prompts} prompts x "
        f"{args.group} episodes, window K={args.turns}, rollout.max_total_tokens "
        f"{args.max_total_tokens}; extra overrides: {args.set or 'none'}"
    )
    print(f"{'config':<22} {'history':<8} " + " ".join(f"{c:>12}" for c in COLUMNS))
    for config in args.configs:
        results = {}
        for history in ("full", "window"):
            with tempfile.TemporaryDirectory() as tmp:
                results[history] = run(config, history, args, Path(tmp) / "run")
            r = results[history]
            print(
                f"{config:<22} {history:<8} " + " ".join(f"{r[c]:12.2f}" for c in COLUMNS),
                flush=True,
            )
        full, window = results["full"], results["window"]
        ratios = ", ".join(
            f"{name} {window[key] / full[key]:.2f}"
            for name, key in (("step", "step_s"), ("update", "update_s"), ("GFLOP", "update_gflop"))
            if full[key]
        )
        print(f"{config}: window / full: {ratios}", flush=True)


if __name__ == "__main__":
    main()
