"""Multi-turn rollout time with and without the cross-turn KV cache (HFGenerator `turn_cache`).

SmolLM2-135M-Instruct plays `--prompts` x `--n` episodes through the engine (rollout/engine.py) of a
scripted env that always answers with the same short observation. Two shapes with the same sampled
tokens per episode: `--turns` turns of `--tokens` tokens, and one turn of turns x tokens tokens. EOS
is switched off (an empty EOS set), so every turn samples exactly its budget and the two shapes
decode the same number of tokens; what differs is the per-turn work: without the cache every turn
re-prefills the whole conversation so far, with it only the observation glue. Each configuration
runs `--repeats` times, interleaved (the machine is shared: read the ratios), best time kept.
Prints a table, the CPU, and the line

    turn_cache_ratio_multi_over_single=X (cache on) / Y (cache off)

Usage: OMP_NUM_THREADS=2 python benchmarks/turn_cache.py [--turns 4] [--tokens 32] [--prompts 4]
       [--n 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch


def cpu() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    name = next(
        (line.split(":", 1)[1].strip() for line in text.splitlines() if "Model name" in line), "?"
    )
    flags = "avx512_bf16" if "avx512_bf16" in text else "no avx512_bf16"
    return f"{name} ({flags})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32, help="sampled tokens per turn")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from rlvr.envs.base import Env, EnvReset, EnvStep
    from rlvr.models import load_policy
    from rlvr.precision import native_bf16
    from rlvr.records import Task
    from rlvr.rollout.engine import RolloutLimits, run_episodes
    from rlvr.rollout.generator import SamplingParams
    from rlvr.rollout.hf import HFGenerator

    class Scripted(Env):
        """Continues with the same observation until `turns` steps are done."""

        max_turns = args.turns

        def __init__(self, task: Task) -> None:
            self.task, self.steps = task, 0

        def reset(self) -> EnvReset:
            return EnvReset([dict(m) for m in self.task.messages])

        def step(self, assistant_text: str) -> EnvStep:
            self.steps += 1
            return EnvStep(
                messages=[{"role": "user", "content": "Noted. Continue with the next step."}],
                rewards={},
                done=self.steps >= self.max_turns,
            )

    policy = load_policy(args.model)
    model, tokenizer = policy.model.eval(), policy.tokenizer
    bf16 = native_bf16()  # as `model.bf16: auto` decides for training runs
    tasks = [
        Task(
            id=str(i),
            messages=(
                {"role": "system", "content": "You are a careful assistant solving puzzles."},
                {"role": "user", "content": f"Puzzle {i}: plan how to reach {17 * i + 3}."},
            ),
        )
        for i in range(args.prompts)
    ]

    def run(turns: int, cached: bool) -> float:
        generator = HFGenerator(
            model, tokenizer, set(), seed=0, autocast_bf16=bf16, turn_cache=cached
        )
        tokens = args.tokens * (args.turns // turns)
        sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=tokens)
        limits = RolloutLimits(max_turns=turns, max_total_tokens=4096, env_workers=1)
        t0 = time.perf_counter()
        episodes = run_episodes(tasks, Scripted, generator, tokenizer, sampling, limits)
        seconds = time.perf_counter() - t0
        sampled = {sum(s.end - s.start for s in ep.turns) for g in episodes for ep in g}
        assert sampled == {args.tokens * args.turns}, sampled
        return seconds

    configs = [(1, False), (1, True), (args.turns, False), (args.turns, True)]
    best: dict[tuple[int, bool], float] = {}
    with torch.no_grad():
        run(1, False)  # warm-up
        for _ in range(args.repeats):
            for config in configs:
                seconds = run(*config)
                print(f"turns={config[0]} cache={config[1]}: {seconds:.2f} s", flush=True)
                best[config] = min(best.get(config, float("inf")), seconds)

    rows = args.prompts * args.n
    print(f"CPU: {cpu()}; OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}; bf16 autocast: {bf16}")
    print(
        f"{rows} episodes, {args.tokens * args.turns} sampled tokens each; best of {args.repeats}"
    )
    print(f"{'episode shape':<28}{'cache off (s)':>15}{'cache on (s)':>15}")
    for turns in (1, args.turns):
        shape = f"{turns} turn(s) x {args.tokens * args.turns // turns} tokens"
        print(f"{shape:<28}{best[(turns, False)]:>15.2f}{best[(turns, True)]:>15.2f}")
    off = best[(args.turns, False)] / best[(1, False)]
    on = best[(args.turns, True)] / best[(1, True)]
    print(f"turn_cache_ratio_multi_over_single={on:.2f} (cache on) / {off:.2f} (cache off)")


if __name__ == "__main__":
    main()
