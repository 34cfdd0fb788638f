"""rlvr against TRL's GRPOTrainer: same model, task, group size, prompts per step, max new tokens, beta, lr.

Speed and memory (default): each (framework, mode) runs a few steps in its own subprocess, so peak RSS
is that run's alone; the order alternates (trl, rlvr, trl, rlvr) within one invocation, so both see
the same machine load. Step time is the median over the steps after the first (which pays one-off
costs). Each framework runs at its own defaults for everything the shared settings leave open (rlvr:
micro-batches of 8 trajectories; `--rlvr-set KEY=VALUE` overrides). The machine's fp32 matmul peak is
measured before and after, and rlvr's update is reported as achieved model GFLOP/s and MFU against
it. The last line printed is

    step_time_ratio_trl_over_rlvr=X peak_rss_ratio_rlvr_over_trl=Y        (full fine-tuning)

Learning per wall-clock (`--learning`): each framework trains full fine-tuning for the same budget
(`--budget-minutes`, counted from its first step; G=8 x 2 prompts, 32 new tokens, lr 1e-5 constant,
beta 0, T=1), then both final models are scored by the same evaluator (rlvr's: greedy, 32 new tokens,
the first `--eval-n` held-out problems). The last line is

    heldout_accuracy_trl=X heldout_accuracy_rlvr=Y after_minutes=B

Usage: python benchmarks/vs_trl.py [--steps 4] [--modes full,lora] [--max-new-tokens 64]
       python benchmarks/vs_trl.py --learning [--budget-minutes 10]
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
            "eval.at_start=false",
            "eval.at_end=false",
            "checkpoint.save_final=false",
            "tracking.trackio=false",
            "tracking.progress=false",
            f"output_dir={out_dir}",
            *args.rlvr_set,
        ],
    )
    train(cfg)
    metrics = [m for m in read_metrics(out_dir) if "step_time" in m]
    steady = metrics[1:] or metrics
    return {
        "s_per_step": statistics.median(m["step_time"] for m in steady),
        "tokens_per_s": statistics.fmean(m["tokens_per_second"] for m in steady),
        "peak_rss_mb": _peak_rss_mb(),
        "rollout_s": statistics.median(m["rollout_time"] for m in steady),
        "update_s": statistics.median(m["update_time"] for m in steady),
        "update_gflops_per_s": statistics.median(m["perf/update_gflops_per_s"] for m in steady),
    }


# ------------------------------------------------------------------------------- learning per wall-clock
LEARNING_SETTINGS = (
    "G=8 x 2 prompts, 32 new tokens, lr 1e-5 constant, beta 0, T=1, full fine-tuning"
)


def heldout_accuracy(model_dir: str, n: int) -> float:
    """rlvr's evaluator on any saved model: greedy, 32 new tokens, the first n held-out problems."""
    from rlvr.evaluate_cli import run_eval

    return float(
        run_eval(model_dir, task="arithmetic", n=n, k=1, max_new_tokens=32, temperature=0.0)[
            "eval/accuracy"
        ]
    )


def learn_trl(args: argparse.Namespace) -> dict[str, Any]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlvr.models import resolve_model_path
    from rlvr.verifiers import numeric_match

    path = resolve_model_path(args.model)
    dataset = datasets.Dataset.from_list(_prompts(4000))

    def correct(completions: list[Any], answer: list[Any], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [numeric_match(t, answer=a) for t, a in zip(texts, answer, strict=True)]

    budget = 60.0 * args.budget_minutes
    steps = [0]

    class Budget(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, _a: Any, _s: Any, _c: Any, **k: Any) -> None:
            if not hasattr(self, "t0"):
                self.t0 = time.perf_counter()

        def on_step_end(self, _a: Any, _s: Any, control: Any, **k: Any) -> None:
            steps[0] += 1
            if time.perf_counter() - self.t0 >= budget:
                control.should_training_stop = True

    out_dir = tempfile.mkdtemp(prefix="trl-learn-")
    config = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=32,
        beta=0.0,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        temperature=1.0,
        max_steps=100_000,
        logging_steps=10,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(path),
        reward_funcs=correct,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Budget()],
    )
    trainer.train()
    final_dir = os.path.join(out_dir, "final")
    trainer.save_model(final_dir)
    tokenizer.save_pretrained(final_dir)
    del trainer
    return {"steps": steps[0], "accuracy": heldout_accuracy(final_dir, args.eval_n)}


def learn_rlvr(args: argparse.Namespace) -> dict[str, Any]:
    from rlvr.config import load_config
    from rlvr.train.loop import train

    out_dir = tempfile.mkdtemp(prefix="rlvr-learn-")
    cfg = load_config(
        None,
        [
            f"model.name={args.model}",
            "sampling.group_size=8",
            "sampling.prompts_per_step=2",
            "sampling.max_new_tokens=32",
            "sampling.temperature=1.0",
            "objective.beta=0.0",
            "train.learning_rate=1e-5",
            "train.lr_schedule=constant",
            "train.steps=100000",
            f"train.time_limit_minutes={args.budget_minutes}",
            "eval.at_start=false",
            "eval.at_end=false",
            "tracking.trackio=false",
            "tracking.progress=false",
            f"output_dir={out_dir}",
            *args.rlvr_set,
        ],
    )
    summary = train(cfg)
    # Scored the same way as TRL's model: from the run directory's last checkpoint.
    return {"steps": summary.steps_done, "accuracy": heldout_accuracy(out_dir, args.eval_n)}


def learning(args: argparse.Namespace, passthrough: list[str]) -> None:
    print(
        f"model {args.model}, 2-digit addition, {LEARNING_SETTINGS}; budget {args.budget_minutes} min "
        f"each; held-out: rlvr's evaluator, greedy, first {args.eval_n} problems",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    for framework in ("base", "trl", "rlvr"):
        t0 = time.time()
        result = _subprocess(f"{framework}:learn", passthrough)
        if result is None:
            print(f"{framework}: FAILED", flush=True)
            continue
        results[framework] = result
        steps = "" if framework == "base" else f" after {result['steps']} steps"
        print(
            f"{framework:5s} held-out accuracy {result['accuracy']:.1%}{steps}  "
            f"(wall {time.time() - t0:.0f} s incl. load and eval)",
            flush=True,
        )
    if "trl" in results and "rlvr" in results:
        print(
            f"heldout_accuracy_trl={results['trl']['accuracy']:.3f} "
            f"heldout_accuracy_rlvr={results['rlvr']['accuracy']:.3f} "
            f"after_minutes={args.budget_minutes:g}"
        )


# ---------------------------------------------------------------------------------------- plumbing
def matmul_peak_gflops(seconds: float = 3.0) -> float:
    """The best fp32 rate of a 2048^2 matmul over `seconds` (the machine's practical peak)."""
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        a @ b
        best = max(best, 2 * 2048**3 / (time.perf_counter() - t0) / 1e9)
    return best


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    framework, mode = args.worker.split(":")
    if mode == "learn":
        if framework == "base":
            result = {"steps": 0, "accuracy": heldout_accuracy(args.model, args.eval_n)}
        else:
            result = (learn_trl if framework == "trl" else learn_rlvr)(args)
    else:
        result = (run_trl if framework == "trl" else run_rlvr)(args, lora=mode == "lora")
    print("RESULT " + json.dumps(result), flush=True)


def _subprocess(worker_spec: str, passthrough: list[str]) -> dict[str, Any] | None:
    proc = subprocess.run(
        [sys.executable, __file__, f"--worker={worker_spec}", *passthrough],
        capture_output=True,
        text=True,
        check=False,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        print(f"{worker_spec}: FAILED (exit {proc.returncode})\n{tail}", flush=True)
        return None
    result: dict[str, Any] = json.loads(line[len("RESULT ") :])
    return result


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
    parser.add_argument("--learning", action="store_true", help="learning per wall-clock instead")
    parser.add_argument("--budget-minutes", type=float, default=10.0)
    parser.add_argument("--eval-n", type=int, default=200)
    parser.add_argument(
        "--rlvr-set", action="append", default=[], help="extra rlvr config KEY=VALUE (repeatable)"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    passthrough = [
        f"--model={args.model}",
        f"--steps={args.steps}",
        f"--group-size={args.group_size}",
        f"--prompts-per-step={args.prompts_per_step}",
        f"--max-new-tokens={args.max_new_tokens}",
        f"--beta={args.beta}",
        f"--lr={args.lr}",
        f"--budget-minutes={args.budget_minutes}",
        f"--eval-n={args.eval_n}",
        *[f"--rlvr-set={kv}" for kv in args.rlvr_set],
    ]
    if args.learning:
        learning(args, passthrough)
        return

    peaks = [matmul_peak_gflops()]
    print(
        f"model {args.model}, 2-digit addition, {args.prompts_per_step} prompts x G={args.group_size}, "
        f"{args.max_new_tokens} new tokens, beta {args.beta}, lr {args.lr}, {args.steps} steps "
        f"(median of 2..N); rlvr overrides: {args.rlvr_set or 'none'}",
        flush=True,
    )
    results: dict[tuple[str, str], dict[str, Any]] = {}
    for mode in args.modes.split(","):
        for framework in ("trl", "rlvr"):
            t0 = time.time()
            result = _subprocess(f"{framework}:{mode}", passthrough)
            if result is None:
                continue
            results[(framework, mode)] = r = result
            extra = ""
            if framework == "rlvr":
                extra = (
                    f"  [rollout {r['rollout_s']:.1f} s, update {r['update_s']:.1f} s at "
                    f"{r['update_gflops_per_s']:.0f} GFLOP/s]"
                )
            print(
                f"{framework:5s} {mode:5s}  {r['s_per_step']:7.2f} s/step  {r['tokens_per_s']:7.1f} tok/s  "
                f"peak RSS {r['peak_rss_mb']:7.0f} MB   (wall {time.time() - t0:.0f} s){extra}",
                flush=True,
            )
    peaks.append(matmul_peak_gflops())
    peak = max(peaks)
    print(
        f"fp32 matmul peak (2048^2, best of 3 s, before/after): {peaks[0]:.0f} / {peaks[1]:.0f} GFLOP/s"
    )
    for mode in args.modes.split(","):
        if ("rlvr", mode) in results:
            rate = results[("rlvr", mode)]["update_gflops_per_s"]
            print(f"{mode}: rlvr update {rate:.0f} GFLOP/s = MFU {rate / peak:.0%} of {peak:.0f}")
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
