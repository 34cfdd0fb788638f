"""How one GRPO step's cost grows with the group size G and the completion length.

Sweeps G in {4, 8, 16} x max new tokens in {32, 64, 128} (2 prompts a step, SmolLM2, full fine-tuning,
beta 0.04, as benchmarks/vs_trl.py) and prints a table: seconds per step (rollout and update apart),
completion tokens per step, milliseconds per completion token, and the update's achieved GFLOP/s.
Each configuration runs `--steps` steps in this process and reports the median of the steps after the
first (which pays one-off costs). Arithmetic answers often end before the cap, so the table shows the
tokens actually sampled; "linear" means step time ~ a + b x tokens, and the last lines print the fit
and the spread of ms per token.

Usage: python benchmarks/scaling.py [--groups 4,8,16] [--lengths 32,64,128] [--steps 3]
A measuring instrument, not a test: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from typing import Any


def run_one(model: str, group: int, length: int, steps: int, lora: bool) -> dict[str, Any]:
    from rlvr.config import load_config
    from rlvr.observe.tracking import read_metrics
    from rlvr.train.loop import train

    out_dir = tempfile.mkdtemp(prefix="rlvr-scaling-")
    cfg = load_config(
        None,
        [
            f"model.name={model}",
            f"model.lora.enabled={str(lora).lower()}",
            f"sampling.group_size={group}",
            "sampling.prompts_per_step=2",
            f"sampling.max_new_tokens={length}",
            "sampling.temperature=1.0",
            "objective.beta=0.04",
            "train.learning_rate=1e-5",
            f"train.steps={steps}",
            "eval.at_start=false",
            "eval.at_end=false",
            "checkpoint.save_final=false",
            "tracking.trackio=false",
            "tracking.progress=false",
            f"output_dir={out_dir}",
        ],
    )
    train(cfg)
    rows = [m for m in read_metrics(out_dir) if "step_time" in m]
    steady = rows[1:] or rows

    def median(key: str) -> float:
        return statistics.median(float(m[key]) for m in steady)

    tokens = statistics.median(
        m["completions/mean_length"] * group * 2 for m in steady if "completions/mean_length" in m
    )
    return {
        "G": group,
        "max_new": length,
        "step_s": median("step_time"),
        "rollout_s": median("rollout_time"),
        "update_s": median("update_time"),
        "tokens": tokens,
        "gflops_per_s": median("perf/update_gflops_per_s"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--groups", default="4,8,16")
    parser.add_argument("--lengths", default="32,64,128")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lora", action="store_true")
    args = parser.parse_args()

    results = []
    header = (
        f"{'G':>3} {'max_new':>7} {'tokens':>7} {'step s':>7} {'rollout s':>9} {'update s':>8} "
        f"{'ms/token':>8} {'upd GFLOP/s':>11}"
    )
    print(f"model {args.model}, 2 prompts a step, beta 0.04, full fine-tuning={not args.lora}")
    print(header, flush=True)
    for group in (int(g) for g in args.groups.split(",")):
        for length in (int(n) for n in args.lengths.split(",")):
            r = run_one(args.model, group, length, args.steps, args.lora)
            results.append(r)
            print(
                f"{r['G']:>3} {r['max_new']:>7} {r['tokens']:>7.0f} {r['step_s']:>7.1f} "
                f"{r['rollout_s']:>9.1f} {r['update_s']:>8.1f} "
                f"{1000 * r['step_s'] / r['tokens']:>8.1f} {r['gflops_per_s']:>11.1f}",
                flush=True,
            )
    # Least-squares line step_s = a + b * tokens, and how far each point sits from it.
    xs = [r["tokens"] for r in results]
    ys = [r["step_s"] for r in results]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    a = mean_y - b * mean_x
    residual = max(abs(y - (a + b * x)) / y for x, y in zip(xs, ys, strict=True))
    ss_res = sum((y - (a + b * x)) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - mean_y) ** 2 for y in ys)
    per_token = [1000 * y / x for x, y in zip(xs, ys, strict=True)]
    print(f"fit: step_s = {a:.2f} + {1000 * b:.2f} ms x tokens, R^2 {1 - ss_res / ss_tot:.3f}")
    print(
        f"largest relative residual {residual:.0%}; ms per token from {min(per_token):.1f} "
        f"to {max(per_token):.1f}"
    )


if __name__ == "__main__":
    main()
