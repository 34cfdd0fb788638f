"""rlvr against TRL's GRPOTrainer: same model, task, group size, prompts per step, max new tokens, beta, lr.

(Over 500 lines on purpose: the speed and the learning modes share one worker launch and one model
and task set-up; the pure report logic already lives in _vs_trl_report.py.)

Speed and memory (default): each run (framework, mode, precision) is a few steps in its own
subprocess, so peak RSS is that run's alone; TRL and rlvr alternate within one invocation, so both see
the same machine load. Step time is the median over the steps after the first (which pays one-off
costs). Per mode (full fine-tuning, LoRA) the runs are:

    TRL, bf16=False          fp32
    TRL, bf16=True           TRL's own default (autocast, fp32 weights); run where the CPU has
                             avx512_bf16 / amx_bf16 (`--trl-bf16 auto`); on an AVX2-only CPU bf16 is
                             ~8x slower, so there only with `--trl-bf16 on`
    rlvr, defaults           every setting the shared ones leave open at rlvr's default
    rlvr, decode=fast        + `generator.decode=fast` and `generator.decode_dtype=bfloat16` (its
                             bf16 sampling copy) where the CPU has native bf16, else `float32`
                             (`--rlvr-fast auto|bfloat16|float32|off`)

Every ratio is against TRL's FASTER precision in that mode; the output says which one that was. The
machine's fp32 matmul peak is measured before and after, and rlvr's update is reported as achieved
model GFLOP/s and MFU against it. The header states the CPU (lscpu model name, native bf16 flags),
torch threads, commit and date (benchmarks/_machine.py); then a Markdown table of every run side by
side (benchmarks/_vs_trl_report.py), a line per mode naming the TRL run the ratios use, and last

    step_time_ratio_trl_over_rlvr=X peak_rss_ratio_rlvr_over_trl=Y ...       (full fine-tuning)

(`_fast` fields: the decode=fast row; `trl_reference`: fp32 or bf16).

Learning per wall-clock (`--learning`): each framework trains full fine-tuning for the same budget
(`--budget-minutes`, counted from its first step; G=`--group-size` x `--learning-prompts` (4)
prompts, 32 new tokens, `--lr` constant (1e-5), beta 0, T=`--learning-temperature` (1); TRL in
fp32; the recipe chosen on the validation split below, before any held-out run of it), then
both final models are scored by the same evaluator (rlvr's: greedy, 32 new tokens, the first
`--eval-n` held-out problems). The last line is

    heldout_accuracy_trl=X heldout_accuracy_rlvr=Y after_minutes=B

A recipe is chosen with `--split validation`: both frameworks then train on the training problems
less 200 of them picked by a fixed hash, and are scored on those 200; the held-out problems are not
read at all. Only a recipe chosen that way may be quoted with a held-out number.

Usage: python benchmarks/vs_trl.py [--steps 4] [--modes full,lora] [--max-new-tokens 64]
                                   [--trl-bf16 auto|on|off] [--rlvr-fast auto|bfloat16|float32|off]
       python benchmarks/vs_trl.py --learning [--budget-minutes 10] [--lr 1e-5] [--split validation]
       python benchmarks/vs_trl.py --model tiny-random --steps 2 --modes full   (a smoke run)
This is a measuring instrument, not a test: numbers on a shared 2-core machine are noisy; read ratios.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

from _machine import has_native_bf16, machine, matmul_peak_gflops
from _vs_trl_report import (
    RLVR_FAST_CHOICES,
    TRL_BF16_CHOICES,
    Results,
    bf16_skip_reason,
    fast_variant,
    format_fields,
    parse_spec,
    ratio_fields,
    reference_line,
    render_table,
    rlvr_overrides,
    run_label,
    trl_variants,
    worker_specs,
)


def _prompts(n: int) -> list[dict[str, Any]]:
    from rlvr.config import ArithmeticConfig
    from rlvr.tasks import arithmetic_tasks

    tasks = arithmetic_tasks(ArithmeticConfig()).train[:n]
    return [{"prompt": [dict(m) for m in t.messages], "answer": t.fields["answer"]} for t in tasks]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run_trl(args: argparse.Namespace, lora: bool, bf16: bool) -> dict[str, Any]:
    import datasets
    import torch
    import trl
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
        bf16=bf16,
        save_strategy="no",
        seed=0,
    )
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"
        )
    # fp32 weights either way, as TRL loads a model id itself (bf16=True is autocast over them).
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
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
        "precision": "bf16 autocast, fp32 weights" if bf16 else "fp32",
        "trl_version": trl.__version__,
    }


def run_rlvr(args: argparse.Namespace, lora: bool, variant: str) -> dict[str, Any]:
    from rlvr.build import use_bf16
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
            *rlvr_overrides(variant),
        ],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(cfg)
    # HFGenerator warns when `decode: fast` falls back to HF's forward (an unsupported model).
    declined = [str(w.message) for w in caught if "falls back to HF's forward" in str(w.message)]
    autocast = use_bf16(cfg.model)
    precision = "bf16 autocast" if autocast else "fp32"
    if cfg.generator.decode == "fast":
        dtype = cfg.generator.decode_dtype
        if dtype == "auto":
            dtype = "bfloat16" if autocast else "float32"
        precision += f"; sampling: own decode, {dtype} weight copy"
        if declined:
            precision += f" DECLINED ({declined[0]})"
    metrics = [m for m in read_metrics(out_dir) if "step_time" in m]
    steady = metrics[1:] or metrics
    return {
        "s_per_step": statistics.median(m["step_time"] for m in steady),
        "tokens_per_s": statistics.fmean(m["tokens_per_second"] for m in steady),
        "peak_rss_mb": _peak_rss_mb(),
        "rollout_s": statistics.median(m["rollout_time"] for m in steady),
        "update_s": statistics.median(m["update_time"] for m in steady),
        "update_gflops_per_s": statistics.median(m["perf/update_gflops_per_s"] for m in steady),
        "precision": precision,
    }


# ------------------------------------------------------------------------------- learning per wall-clock
VALIDATION_SIZE = 200


def learning_settings(args: argparse.Namespace) -> str:
    return (
        f"G={args.group_size} x {args.learning_prompts} prompts, 32 new tokens, lr {args.lr:g} "
        f"constant, beta 0, T={args.learning_temperature:g}, full fine-tuning"
    )


@functools.cache
def _validation_files() -> tuple[str, str]:
    """The training problems cut in two JSONL files (train, validation) by a fixed hash of each
    problem: VALIDATION_SIZE of them to score a recipe on, the rest to train on. Held-out problems
    are never read. Rows: {"id", "prompt", "answer"}, the arithmetic task's own prompt text. Written
    once per process (training and scoring read the same files)."""
    from rlvr.config import ArithmeticConfig
    from rlvr.tasks import _stable_fraction, arithmetic_tasks

    directory = tempfile.mkdtemp(prefix="vs-trl-validation-")

    train = sorted(
        arithmetic_tasks(ArithmeticConfig()).train,
        key=lambda t: _stable_fraction("validation:" + t.id),
    )
    paths = (os.path.join(directory, "train.jsonl"), os.path.join(directory, "validation.jsonl"))
    for path, part in zip(paths, (train[VALIDATION_SIZE:], train[:VALIDATION_SIZE]), strict=True):
        with open(path, "w") as f:
            for t in part:
                row = {
                    "id": t.id,
                    "prompt": t.messages[-1]["content"],
                    "answer": t.fields["answer"],
                }
                f.write(json.dumps(row) + "\n")
    return paths


def _task_overrides(args: argparse.Namespace) -> list[str]:
    """rlvr config overrides that swap the arithmetic task for the validation files, or nothing."""
    if args.split != "validation":
        return []
    train, validation = _validation_files()
    return [
        "task.source=dataset",
        f"task.dataset.path={train}",
        f"task.dataset.heldout_path={validation}",
    ]


def _learning_rows(args: argparse.Namespace, n: int) -> list[dict[str, Any]]:
    if args.split != "validation":
        return _prompts(n)
    train, _ = _validation_files()
    with open(train) as f:
        rows = [json.loads(line) for line in f][:n]
    return [
        {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows
    ]


def heldout_accuracy(model_dir: str, args: argparse.Namespace) -> float:
    """rlvr's evaluator on any saved model: greedy, 32 new tokens, the first `--eval-n` problems of
    the held-out split (or, with `--split validation`, of the validation problems). It decodes on
    HF's fp32 path whatever the sampler default on this host, so the scorer is the same for every
    model, host kind and session."""
    from rlvr.evaluate_cli import run_eval

    return float(
        run_eval(
            model_dir,
            task="arithmetic",
            n=args.eval_n,
            k=1,
            max_new_tokens=32,
            temperature=0.0,
            overrides=["generator.decode=hf", *_task_overrides(args)],
        )["eval/accuracy"]
    )


def learn_trl(args: argparse.Namespace) -> dict[str, Any]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlvr.models import resolve_model_path
    from rlvr.verifiers import numeric_match

    path = resolve_model_path(args.model)
    dataset = datasets.Dataset.from_list(_learning_rows(args, 4000))

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
        per_device_train_batch_size=args.group_size * args.learning_prompts,
        num_generations=args.group_size,
        max_completion_length=32,
        beta=0.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        temperature=args.learning_temperature,
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
    return {"steps": steps[0], "accuracy": heldout_accuracy(final_dir, args)}


def learn_rlvr(args: argparse.Namespace) -> dict[str, Any]:
    from rlvr.config import load_config
    from rlvr.train.loop import train

    out_dir = tempfile.mkdtemp(prefix="rlvr-learn-")
    cfg = load_config(
        None,
        [
            f"model.name={args.model}",
            f"sampling.group_size={args.group_size}",
            f"sampling.prompts_per_step={args.learning_prompts}",
            "sampling.max_new_tokens=32",
            f"sampling.temperature={args.learning_temperature}",
            "objective.beta=0.0",
            f"train.learning_rate={args.lr}",
            "train.lr_schedule=constant",
            "train.steps=100000",
            f"train.time_limit_minutes={args.budget_minutes}",
            "eval.at_start=false",
            "eval.at_end=false",
            "tracking.trackio=false",
            "tracking.progress=false",
            f"output_dir={out_dir}",
            *_task_overrides(args),
            *args.rlvr_set,
        ],
    )
    summary = train(cfg)
    # Scored the same way as TRL's model: from the run directory's last checkpoint.
    return {"steps": summary.steps_done, "accuracy": heldout_accuracy(out_dir, args)}


def learning(args: argparse.Namespace, passthrough: list[str]) -> None:
    print("\n".join(machine().header()))
    print(
        f"model {args.model}, 2-digit addition, {learning_settings(args)}; budget "
        f"{args.budget_minutes} min each; scored on the {split_name(args)} problems: rlvr's evaluator, greedy, "
        f"first {args.eval_n} problems; rlvr overrides: {args.rlvr_set or 'none'}",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    for framework in args.frameworks.split(","):
        t0 = time.time()
        result = _subprocess(f"{framework}:learn", passthrough)
        if result is None:
            print(f"{framework}: FAILED", flush=True)
            continue
        results[framework] = result
        steps = "" if framework == "base" else f" after {result['steps']} steps"
        print(
            f"{framework:5s} {split_name(args)} accuracy {result['accuracy']:.1%}{steps}  "
            f"(wall {time.time() - t0:.0f} s incl. load and eval)",
            flush=True,
        )
    if "trl" in results and "rlvr" in results:
        key = split_name(args).replace("-", "")
        print(
            f"{key}_accuracy_trl={results['trl']['accuracy']:.3f} "
            f"{key}_accuracy_rlvr={results['rlvr']['accuracy']:.3f} "
            f"after_minutes={args.budget_minutes:g}"
        )


def split_name(args: argparse.Namespace) -> str:
    return "validation" if args.split == "validation" else "held-out"


# ---------------------------------------------------------------------------------------- plumbing
def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    framework, mode, variant = parse_spec(args.worker)
    if mode == "learn":
        if framework == "base":
            result = {"steps": 0, "accuracy": heldout_accuracy(args.model, args)}
        else:
            result = (learn_trl if framework == "trl" else learn_rlvr)(args)
    elif framework == "trl":
        result = run_trl(args, lora=mode == "lora", bf16=variant == "bf16")
    else:
        result = run_rlvr(args, lora=mode == "lora", variant=variant)
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


def speed(args: argparse.Namespace, passthrough: list[str]) -> None:
    modes = args.modes.split(",")
    native = has_native_bf16()
    trl = trl_variants(args.trl_bf16, native)
    fast = fast_variant(args.rlvr_fast, native)
    header = machine().header()
    print("\n".join(header), flush=True)
    peaks = [matmul_peak_gflops()]
    print(
        f"model {args.model}, 2-digit addition, {args.prompts_per_step} prompts x G={args.group_size}, "
        f"{args.max_new_tokens} new tokens, beta {args.beta}, lr {args.lr}, {args.steps} steps "
        f"(median of 2..N); TRL precisions: {', '.join(trl)} (--trl-bf16 {args.trl_bf16}); "
        f"rlvr rows: default{', ' + fast if fast else ''} (--rlvr-fast {args.rlvr_fast}); "
        f"rlvr overrides: {args.rlvr_set or 'none'}",
        flush=True,
    )
    results: Results = {}
    for spec in worker_specs(modes, trl, fast):
        t0 = time.time()
        result = _subprocess(spec, passthrough)
        if result is None:
            continue
        key = parse_spec(spec)
        results[key] = r = result
        extra = ""
        if key[0] == "rlvr":
            extra = (
                f"  [rollout {r['rollout_s']:.1f} s, update {r['update_s']:.1f} s at "
                f"{r['update_gflops_per_s']:.0f} GFLOP/s]"
            )
        print(
            f"{key[1]:5s} {run_label(key[0], key[2], r):38s} {r['s_per_step']:7.2f} s/step  "
            f"{r['tokens_per_s']:7.1f} tok/s  peak RSS {r['peak_rss_mb']:7.0f} MB   "
            f"(wall {time.time() - t0:.0f} s; {r['precision']}){extra}",
            flush=True,
        )
    peaks.append(matmul_peak_gflops())
    peak = max(peaks)
    print()
    print("\n".join(header))
    print("\n".join(render_table(results, modes)))
    print(
        f"fp32 matmul peak (2048^2, best of 3 s, before/after): {peaks[0]:.0f} / {peaks[1]:.0f} GFLOP/s"
    )
    for (framework, mode, variant), r in results.items():
        if framework == "rlvr":
            rate = r["update_gflops_per_s"]
            print(
                f"{mode}: {run_label(framework, variant, r)}: update {rate:.0f} GFLOP/s = MFU "
                f"{rate / peak:.0%} of {peak:.0f}"
            )
    for mode in modes:
        print(reference_line(results, mode, bf16_skip_reason(trl, args.trl_bf16, results, mode)))
    for mode in modes:
        if fields := ratio_fields(results, mode):
            print(f"{mode}: {format_fields(fields)}")
    if "full" in modes and (fields := ratio_fields(results, "full")):
        print(format_fields(fields))


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
    parser.add_argument(
        "--trl-bf16",
        choices=TRL_BF16_CHOICES,
        default="auto",
        help="also run TRL with bf16=True: auto = where /proc/cpuinfo has avx512_bf16 or amx_bf16",
    )
    parser.add_argument(
        "--rlvr-fast",
        choices=RLVR_FAST_CHOICES,
        default="auto",
        help="the rlvr row with generator.decode=fast and this decode_dtype: auto = bfloat16 "
        "where the CPU has native bf16, else float32",
    )
    parser.add_argument("--learning", action="store_true", help="learning per wall-clock instead")
    parser.add_argument("--budget-minutes", type=float, default=10.0)
    parser.add_argument("--eval-n", type=int, default=200)
    parser.add_argument(
        "--learning-prompts",
        type=int,
        default=4,
        help="--learning: prompts per step (x G); 4 was chosen on the validation split (2: 70.5%%, "
        "4: 79.0%%, 8: 78.5%%; lr 3e-5: 36.5%%; T=0.7: 74.0%%; docs/performance.md)",
    )
    parser.add_argument(
        "--learning-temperature", type=float, default=1.0, help="--learning: sampling temperature"
    )
    parser.add_argument(
        "--split",
        choices=("heldout", "validation"),
        default="heldout",
        help="--learning: score on the held-out problems, or on 200 training problems the runs "
        "then do not train on (to choose a recipe without reading the held-out split)",
    )
    parser.add_argument(
        "--frameworks",
        default="base,trl,rlvr",
        help="--learning: which runs, in order (a subset re-measures one side; the comparison "
        "counts only from one invocation of all three)",
    )
    parser.add_argument(
        "--rlvr-set", action="append", default=[], help="extra rlvr config KEY=VALUE (repeatable)"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    unknown = set(args.frameworks.split(",")) - {"base", "trl", "rlvr"}
    if unknown:
        parser.error(f"--frameworks: unknown {', '.join(sorted(unknown))} (base, trl, rlvr)")

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
        f"--learning-prompts={args.learning_prompts}",
        f"--learning-temperature={args.learning_temperature}",
        f"--split={args.split}",
        *[f"--rlvr-set={kv}" for kv in args.rlvr_set],
    ]
    if args.learning:
        learning(args, passthrough)
        return

    speed(args, passthrough)


if __name__ == "__main__":
    main()
