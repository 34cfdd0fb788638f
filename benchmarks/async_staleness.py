"""Async rollouts at a staleness bound k: uncorrected against each off-policy correction.

Each configuration trains the same seeded run with `rollout.async_rollouts: true`,
`rollout.max_staleness: k` and one `objective.off_policy_correction`, then prints one markdown row:
held-out score at the start and end (`eval/accuracy`: greedy, by the task's eval.metric), the train reward of the last five steps, the
mean per-token gap between the sampler's and the trainer's log-probs (`update/behaviour_logprob_abs_diff`,
staleness plus numerics), the share of tokens whose weight was truncated (`update/tis_capped_frac`) or
masked (`rollout_corr/rollout_is_masked_fraction`), and the mean staleness trained on.

    python benchmarks/async_staleness.py                                   # tiny model, k = 3
    python benchmarks/async_staleness.py --config examples/quickstart.yaml --steps 12 --k 2 \\
        --corrections none,tis_token --eval-n 50                            # SmolLM2 (slow on CPU)

A measuring instrument, not a test: runs are short and the machine is shared; read differences of a
few points as noise (--seeds averages over several).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_one(
    config: Path, k: int, correction: str, steps: int, seed: int, eval_n: int, extra: list[str]
) -> dict[str, Any]:
    from rlvr.config import load_config
    from rlvr.observe.tracking import read_metrics
    from rlvr.train.loop import train

    out_dir = tempfile.mkdtemp(prefix="rlvr-staleness-")
    cfg = load_config(
        config,
        [
            "rollout.async_rollouts=true",
            f"rollout.max_staleness={k}",
            f"objective.off_policy_correction={correction}",
            f"train.steps={steps}",
            f"train.seed={seed}",
            f"eval.n={eval_n}",
            "eval.every=0",
            "checkpoint.save_final=false",
            "checkpoint.every=0",
            "tracking.trackio=false",
            "tracking.progress=false",
            f"output_dir={out_dir}",
            *extra,
        ],
    )
    started = time.perf_counter()
    train(cfg, config_dir=config.parent)
    seconds = time.perf_counter() - started
    rows = read_metrics(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)  # metrics read: nothing else of the run is kept
    steps_rows = [r for r in rows if "loss" in r and "event" not in r]
    # eval/accuracy is the held-out score by the task's metric (eval.metric), greedy.
    evals = [r for r in rows if "eval/accuracy" in r]
    first, final = (evals[0], evals[-1]) if evals else ({}, {})

    def mean(key: str, of: list[dict[str, Any]] = steps_rows) -> float:
        # A step with nothing to measure logs null (NaN in the jsonl): left out of the mean.
        values = [r[key] for r in of if r.get(key) is not None]
        return statistics.fmean(values) if values else float("nan")

    return {
        "eval_start": first.get("eval/accuracy", float("nan")),
        "eval_end": final.get("eval/accuracy", float("nan")),
        "reward_last5": mean("reward", steps_rows[-5:]),
        "gap": mean("update/behaviour_logprob_abs_diff"),
        "capped": mean("update/tis_capped_frac"),
        "masked": mean("rollout_corr/rollout_is_masked_fraction"),
        "staleness": mean("rollout/staleness_mean"),
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "tiny.yaml")
    parser.add_argument("--k", type=int, default=3, help="rollout.max_staleness")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", default="1", help="comma-separated train.seed values")
    parser.add_argument("--eval-n", type=int, default=50)
    parser.add_argument(
        "--corrections", default="none,tis_token,tis_sequence,mis_token,icepop,geo_mask"
    )
    parser.add_argument("--set", action="append", default=[], help="extra config overrides")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"config {args.config.name}, k = {args.k}, {args.steps} steps, seeds {seeds}")
    print(
        "| correction | held-out start | held-out end | train reward (last 5) | "
        "behaviour gap / token | capped | masked | staleness | s/run | end per seed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for correction in args.corrections.split(","):
        runs = [
            run_one(args.config, args.k, correction, args.steps, s, args.eval_n, args.set)
            for s in seeds
        ]

        def avg(key: str, runs: list[dict[str, Any]] = runs) -> float:
            return statistics.fmean(r[key] for r in runs)

        per_seed = ", ".join(f"{r['eval_end']:.2f}" for r in runs)
        print(
            f"| {correction} | {avg('eval_start'):.3f} | {avg('eval_end'):.3f} | "
            f"{avg('reward_last5'):.3f} | {avg('gap'):.4f} | {avg('capped'):.3f} | "
            f"{avg('masked'):.3f} | {avg('staleness'):.2f} | {avg('seconds'):.0f} | "
            f"{per_seed} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
