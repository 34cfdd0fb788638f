"""rlvr against TRL's GRPOTrainer: same model, task, group size, prompts per step, max new tokens, beta, lr.

Each (framework, mode) runs in its own subprocess, so peak RSS is that run's alone; the order alternates
(trl, rlvr, trl, rlvr) within one invocation, so both see the same machine load. Step time is the median
over the steps after the first (which pays one-off costs). The last line printed is

    step_time_ratio_trl_over_rlvr=X peak_rss_ratio_rlvr_over_trl=Y        (full fine-tuning)

Usage: python benchmarks/vs_trl.py [--steps 4] [--modes full,lora] [--max-new-tokens 64]
This is a measuring instrument, not a test: numbers on a shared 2-core machine are noisy; read ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def _prompts(n: int) -> list[dict[str, Any]]:
    from rlvr.config import ArithmeticConfig
    from rlvr.tasks import arithmetic_tasks

    tasks = arithmetic_tasks(ArithmeticConfig()).train[:n]
    return [{"prompt": [dict(m) for m in t.messages], "answer": t.fields["answer"]} for t in tasks]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run_trl(args: argparse.Namespace, lora: bool) -> dict[str, Any]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlvr.models import resolve_model_path
    from rlvr.verifiers import numeric_match

    path = resolve_model_path(args.model)
    rows = _prompts(args.steps * args.prompts_per_step * 4)
    dataset = datasets.Dataset.from_list(rows)

    def correct(completions: list[Any], answer: list[Any], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [numeric_match(t, answer=a) for t, a in zip(texts, answer, strict=True)]

    step_times: list[float] = []
    tokens: list[float] = []

    class Timer(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            step_times.append(time.perf_counter() - self.t0)

        def on_log(
            self, _args: Any, _state: Any, _control: Any, logs: Any = None, **k: Any
        ) -> None:
            if logs and "completions/mean_length" in logs:
                tokens.append(
                    logs["completions/mean_length"] * args.group_size * args.prompts_per_step
                )

    out_dir = tempfile.mkdtemp(prefix="trl-bench-")
    config = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=args.group_size * args.prompts_per_step,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        beta=args.beta,
        learning_rate=args.lr,
        temperature=1.0,
        max_steps=args.steps,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
    )
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"
        )
    model = AutoModelForCausalLM.from_pretrained(path)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=correct,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(path),
        peft_config=peft_config,
        callbacks=[Timer()],
    )
    trainer.train()
    steady = step_times[1:] or step_times
    return {
        "s_per_step": statistics.median(steady),
        "tokens_per_s": statistics.fmean(tokens[1:] or tokens) / statistics.median(steady)
        if tokens
        else float("nan"),
        "peak_rss_mb": _peak_rss_mb(),
        "gradient_checkpointing": config.gradient_checkpointing,
    }


def run_rlvr(args: argparse.Namespace, lora: bool) -> dict[str, Any]:
    from rlvr.config import load_config
    from rlvr.observe.tracking import read_metrics
    from rlvr.train.loop import train

    out_dir = tempfile.mkdtemp(prefix="rlvr-bench-")
    cfg = load_config(
        None,
        [
            f"model.name={args.model}",
            f"model.lora.enabled={str(lora).lower()}",
            f"sampling.group_size={args.group_size}",
            f"sampling.prompts_per_step={args.prompts_per_step}",
            f"sampling.max_new_tokens={args.max_new_tokens}",
            "sampling.temperature=1.0",
            f"objective.beta={args.beta}",
            f"train.learning_rate={args.lr}",
            f"train.steps={args.steps}",
            "train.micro_batch_size=16",
            "eval.at_start=false",
            "eval.at_end=false",
            "checkpoint.save_final=false",
            "tracking.trackio=false",
            "tracking.progress=false",
            f"output_dir={out_dir}",
        ],
    )
    train(cfg)
    metrics = [m for m in read_metrics(out_dir) if "step_time" in m]
    steady = metrics[1:] or metrics
    return {
        "s_per_step": statistics.median(m["step_time"] for m in steady),
        "tokens_per_s": statistics.fmean(m["tokens_per_second"] for m in steady),
        "peak_rss_mb": _peak_rss_mb(),
    }


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    framework, mode = args.worker.split(":")
    fn = run_trl if framework == "trl" else run_rlvr
    result = fn(args, lora=mode == "lora")
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="smollm2-135m-instruct", help="tiny-random for a smoke run"
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--modes", default="full,lora")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    results: dict[tuple[str, str], dict[str, Any]] = {}
    passthrough = [
        f"--model={args.model}",
        f"--steps={args.steps}",
        f"--group-size={args.group_size}",
        f"--prompts-per-step={args.prompts_per_step}",
        f"--max-new-tokens={args.max_new_tokens}",
        f"--beta={args.beta}",
        f"--lr={args.lr}",
    ]
    print(
        f"model {args.model}, 2-digit addition, {args.prompts_per_step} prompts x G={args.group_size}, "
        f"{args.max_new_tokens} new tokens, beta {args.beta}, lr {args.lr}, {args.steps} steps (median of 2..N)",
        flush=True,
    )
    for mode in args.modes.split(","):
        for framework in ("trl", "rlvr"):
            t0 = time.time()
            proc = subprocess.run(
                [sys.executable, __file__, f"--worker={framework}:{mode}", *passthrough],
                capture_output=True,
                text=True,
                check=False,
            )
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
                print(f"{framework} {mode}: FAILED (exit {proc.returncode})\n{tail}", flush=True)
                continue
            results[(framework, mode)] = json.loads(line[len("RESULT ") :])
            r = results[(framework, mode)]
            print(
                f"{framework:5s} {mode:5s}  {r['s_per_step']:7.2f} s/step  {r['tokens_per_s']:7.1f} tok/s  "
                f"peak RSS {r['peak_rss_mb']:7.0f} MB   (wall {time.time() - t0:.0f} s)",
                flush=True,
            )
    for mode in args.modes.split(","):
        if ("trl", mode) in results and ("rlvr", mode) in results:
            trl, ours = results[("trl", mode)], results[("rlvr", mode)]
            print(
                f"{mode}: step_time_ratio_trl_over_rlvr={trl['s_per_step'] / ours['s_per_step']:.2f} "
                f"peak_rss_ratio_rlvr_over_trl={ours['peak_rss_mb'] / trl['peak_rss_mb']:.2f}"
            )
    if ("trl", "full") in results and ("rlvr", "full") in results:
        trl, ours = results[("trl", "full")], results[("rlvr", "full")]
        print(
            f"step_time_ratio_trl_over_rlvr={trl['s_per_step'] / ours['s_per_step']:.2f} "
            f"peak_rss_ratio_rlvr_over_trl={ours['peak_rss_mb'] / trl['peak_rss_mb']:.2f}"
        )


if __name__ == "__main__":
    main()
