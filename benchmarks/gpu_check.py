"""The GPU check (issue 34): what the CPU suite can only prove by proxy, measured on a real GPU in one run.

    python benchmarks/gpu_check.py [--out DIR] [--budget-s 450] [--skip-7b]
    python benchmarks/gpu_check.py --allow-cpu --small     # a smoke run of this script on a CPU

One GPU machine, no network, about 8 minutes. Models are built from configs shipped as test data
(tests/data/configs/*.json, random weights, the tiny character tokenizer: no hub), and each part
stops being started once the time budget runs low (what was skipped is recorded, never hidden):
1. the tests marked `cuda` (tests/test_cuda.py: placement, greedy tokens equal to the CPU's, a step
   of every algorithm; tests/test_sampler_device.py: sampling on the GPU);
2. the tiny model trained 2 steps with every RL algorithm on the GPU, single- and multi-turn;
3. random-weight models shaped like Qwen2.5-1.5B (full fine-tuning in bf16 and fp32, LoRA in bf16)
   and, if time allows, Qwen2.5-7B with LoRA: 3 RL steps each, step time split into rollout and
   update, tokens/s, and the peak GPU memory (torch.cuda.max_memory_allocated) beside `rlvr plan`'s
   estimate for the same config;
4. one full-weight sync of the 1.5B shape each way rlvr has (benchmarks/gpu_check_sync.py): fp32
   files on disk (old), bf16 shards in /dev/shm, the colocated vLLM in memory and a launched vLLM
   server, where vLLM is installed (else recorded as skipped).
It writes DIR/gpu_check.json ($OUT when set, else benchmarks/) and prints the table that
docs/performance.md ("GPU") records with the device, date and commit.

On the device machine (python3 there has torch, transformers, peft, accelerate; the rest travels as
wheels, see `make gpu-wheels`):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:src python3 benchmarks/gpu_check.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
CONFIGS = REPO / "tests" / "data" / "configs"
RL_ALGORITHMS = ("grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp", "ppo")


class Clock:
    """The run's time budget: a part is started only if its estimate fits in what is left."""

    def __init__(self, budget_s: float) -> None:
        self.start = time.monotonic()
        self.budget_s = budget_s

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def allows(self, seconds: float) -> bool:
        return self.left() >= seconds


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        info["commit"] = subprocess.run(
            ["git", "-C", str(REPO), "log", "-1", "--format=%h %cs"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = "unknown (no git)"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["device"] = f"{props.name}, {props.total_memory / 2**30:.1f} GiB"
        info["capability"] = f"{props.major}.{props.minor}"
    else:
        info["device"] = "cpu (no CUDA device)"
    return info


# ------------------------------------------------------------------------------------ 1. the tests
def run_cuda_tests(clock: Clock) -> dict[str, Any]:
    timeout = max(30.0, min(200.0, clock.left() - 240))
    started = time.monotonic()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
             str(REPO / "tests" / "test_cuda.py"), str(REPO / "tests" / "test_sampler_device.py")],
            cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env,
        )  # fmt: skip
        tail = (done.stdout + done.stderr).strip().splitlines()
        summary = tail[-1] if tail else ""
        failures = [line for line in tail if line.startswith(("FAILED", "ERROR"))]
        return {
            "part": "cuda tests",
            "ok": done.returncode == 0,
            "summary": summary,
            "failures": failures[:20],
            "log_tail": tail[-60:] if done.returncode else [],
            "seconds": round(time.monotonic() - started, 1),
        }
    except subprocess.TimeoutExpired:
        return {"part": "cuda tests", "ok": False, "summary": f"timed out after {timeout:.0f} s"}


# ------------------------------------------------------------------------------------ training runs
def train_once(
    base_config: Path, overrides: list[str], device: str, out_dir: Path
) -> dict[str, Any]:
    """One `rlvr train` in this process; step metrics, peak device memory and the plan's estimate."""
    import torch

    from rlvr.config import load_config
    from rlvr.observe.tracking import read_metrics
    from rlvr.train.loop import train

    cfg = load_config(
        base_config,
        [
            f"output_dir={out_dir}",
            f"model.device={device}",
            "tracking.progress=false",
            "tracking.report_to=none",
            "eval.at_start=false",
            "eval.at_end=false",
            # Random weights rarely score: every row still runs forward and backward (the update's
            # real cost), not skipped for a zero advantage.
            "train.skip_zero_advantage_rows=false",
            *overrides,
        ],
    )
    estimate = plan_estimate_gb(cfg)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.monotonic()
    summary = train(cfg, config_dir=base_config.parent)
    wall = time.monotonic() - started
    rows = [m for m in read_metrics(summary.run_dir) if "loss" in m]
    later = rows[1:] or rows  # the first step pays warm-ups (kernels, allocator)

    def mean(key: str) -> float:
        values = [float(m[key]) for m in later if key in m]
        return sum(values) / len(values) if values else float("nan")

    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    return {
        "steps": len(rows),
        "finite_loss": all(math.isfinite(float(m["loss"])) for m in rows),
        "wall_s": round(wall, 1),
        "step_s": round(mean("step_time"), 3),
        "rollout_s": round(mean("rollout_time"), 3),
        "update_s": round(mean("update_time"), 3),
        "tokens_per_s": round(mean("tokens_per_second"), 1),
        "precision_bits": mean("perf/precision"),
        "peak_gb": round(peak, 2),
        "plan_gb": None if estimate is None else round(estimate, 2),
        "plan_ratio": None if estimate is None or not cuda else round(estimate / peak, 3),
    }


def plan_estimate_gb(cfg: Any) -> float | None:
    """`rlvr plan`'s peak estimate per device for `cfg`, in GiB (None if the planner failed: the
    error is printed, the check goes on)."""
    try:
        from rlvr.plan import estimate

        return float(estimate(cfg).peak_bytes) / 2**30
    except Exception as err:  # a planner bug must not cost the rest of the GPU check
        print(f"plan estimate failed: {type(err).__name__}: {err}", file=sys.stderr)
        return None


def attempt(part: str, name: str, fn: Any) -> dict[str, Any]:
    try:
        return {"part": part, "name": name, "ok": True, **fn()}
    except Exception as err:  # recorded; the check goes on to the next configuration
        traceback.print_exc()
        return {
            "part": part,
            "name": name,
            "ok": False,
            "error": f"{type(err).__name__}: {err}"[:500],
        }


def tiny_runs(clock: Clock, device: str, work: Path) -> list[dict[str, Any]]:
    """Every RL algorithm 2 steps on the tiny model, single-turn; then multi-turn GRPO and LoRA."""
    from rlvr.models import TINY_ALIAS, resolve_model_path

    model = resolve_model_path(TINY_ALIAS)
    results = []
    runs = [(f"{a} single-turn", EXAMPLES / "tiny.yaml", [f"algorithm={a}"]) for a in RL_ALGORITHMS]
    runs += [
        ("grpo multi-turn", EXAMPLES / "tiny_multiturn.yaml", []),
        ("grpo multi-turn lora bf16", EXAMPLES / "tiny_multiturn.yaml",
         ["model.lora.enabled=true", "model.bf16=on"]),
        ("grpo kl beta 0.04", EXAMPLES / "tiny.yaml", ["objective.beta=0.04"]),
    ]  # fmt: skip
    for name, config, extra in runs:
        if not clock.allows(200):
            results.append({"part": "tiny", "name": name, "ok": None, "skipped": "time budget"})
            continue
        overrides = [f"model.name={model}", "train.steps=2", "model.bf16=off", *extra]
        out_dir = work / name.replace(" ", "-")
        results.append(
            attempt(
                "tiny", name, lambda c=config, o=overrides, d=out_dir: train_once(c, o, device, d)
            )
        )
    return results


def shaped_model_dir(config_file: Path, root: Path, device: str, small: bool) -> Path:
    """A random-weight model of `config_file`'s shape with the tiny tokenizer, written once (bf16
    on disk, loaded in fp32 by rlvr). `small` (the CPU smoke run): 2 layers, narrow."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlvr.models import tiny_tokenizer

    shape = {k: v for k, v in json.loads(config_file.read_text()).items() if not k.startswith("_")}
    shape.pop("architectures", None)
    if small:  # head_dim 64: vLLM's CPU attention has no kernel for head_dim 16
        shape.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    target = root / (config_file.stem + ("-small" if small else ""))
    if (target / "config.json").exists():
        return target
    tokenizer = tiny_tokenizer()
    config = AutoConfig.for_model(
        shape.pop("model_type"),
        **shape,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    del model
    return target


def shaped_runs(
    clock: Clock, device: str, work: Path, small: bool, with_7b: bool
) -> list[dict[str, Any]]:
    """Qwen2.5-1.5B shape: full FT bf16 / fp32, LoRA bf16; Qwen2.5-7B shape with LoRA if time; then
    the 1.5B shape checkpointed, padded and packed."""
    tokens = 16 if small else 128
    common = [
        "sampling.group_size=8",
        "sampling.prompts_per_step=4",
        f"sampling.max_new_tokens={tokens}",
        "train.steps=3",
        "train.micro_batch_size=8",
        "train.learning_rate=1e-6",
    ]
    plans = [
        ("qwen2.5-1.5b", "full bf16", ["model.bf16=auto"], 150),
        ("qwen2.5-1.5b", "full fp32", ["model.bf16=off"], 150),
        ("qwen2.5-1.5b", "lora bf16", ["model.lora.enabled=true", "model.bf16=auto"], 120),
    ]
    if with_7b:
        plans.append(
            ("qwen2.5-7b", "lora bf16", ["model.lora.enabled=true", "model.bf16=auto"], 200)
        )
    # Rows run whole under checkpointing: padded vs packed (train.padding_free), last so the budget
    # drops them first.
    ckpt = ["model.bf16=auto", "model.gradient_checkpointing=true"]
    plans += [
        ("qwen2.5-1.5b", "full bf16 ckpt padded", [*ckpt, "train.padding_free=false"], 150),
        ("qwen2.5-1.5b", "full bf16 ckpt packed", [*ckpt, "train.padding_free=true"], 150),
    ]
    results = []
    for shape, variant, extra, needs_s in plans:
        name = f"{shape} {variant}"
        if not clock.allows(needs_s):
            results.append({"part": "shaped", "name": name, "ok": None, "skipped": "time budget"})
            continue

        def run(shape: str = shape, extra: list[str] = extra, name: str = name) -> dict[str, Any]:
            model = shaped_model_dir(CONFIGS / f"{shape}.json", work / "models", device, small)
            return train_once(
                EXAMPLES / "tiny.yaml",
                [f"model.name={model}", *common, *extra],
                device,
                work / name.replace(" ", "-"),
            )

        results.append(attempt("shaped", name, run))
    return results


# ------------------------------------------------------------------------------------ the report
def table(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"GPU check: {m['device']} (capability {m.get('capability', '-')}), torch {m['torch']}, "
        f"CUDA {m['cuda']}, transformers {m.get('transformers', '?')}, commit {m['commit']}, "
        f"{m['date']}",
    ]
    for part in results["parts"]:
        if part.get("part") == "cuda tests":
            lines.append(f"cuda tests: {'ok' if part['ok'] else 'FAILED'}: {part['summary']}")
            lines += [f"  {f}" for f in part.get("failures", [])]
    header = "| run | ok | step s | rollout s | update s | tokens/s | bits | peak GiB | plan GiB | plan/peak |"
    lines += [header, "|---" * 10 + "|"]
    for part in results["parts"]:
        if part.get("part") not in ("tiny", "shaped"):
            continue
        if part.get("ok") is None:
            lines.append(f"| {part['name']} | skipped ({part['skipped']}) |" + " |" * 8)
            continue
        if not part["ok"]:
            lines.append(f"| {part['name']} | ERROR: {part['error'][:120]} |" + " |" * 8)
            continue
        cells = [part["name"], "yes" if part["finite_loss"] else "non-finite loss"]
        cells += [str(part[k]) for k in ("step_s", "rollout_s", "update_s", "tokens_per_s")]
        cells += [f"{part['precision_bits']:.0f}", str(part["peak_gb"]), str(part["plan_gb"])]
        cells.append(str(part["plan_ratio"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "benchmarks"))
    parser.add_argument("--budget-s", type=float, default=450.0)
    parser.add_argument("--skip-7b", action="store_true")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--allow-cpu", action="store_true", help="smoke-run on a host without CUDA")
    parser.add_argument("--small", action="store_true", help="2-layer stand-ins of the shapes")
    parser.add_argument(
        "--sync-only", action="store_true", help="only part 4, the weight syncs (skips 1-3)"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("gpu_check: torch sees no CUDA device (use --allow-cpu for a smoke run)")
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    clock = Clock(args.budget_s)
    results: dict[str, Any] = {"machine": machine(), "parts": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rlvr-gpu-check-"))
    os.environ.setdefault("RLVR_CACHE", str(work / "cache"))

    def save() -> None:
        results["seconds"] = round(args.budget_s - clock.left(), 1)
        (out / "gpu_check.json").write_text(json.dumps(results, indent=1))

    if not args.skip_tests and not args.sync_only:
        results["parts"].append(run_cuda_tests(clock))
        save()
    if not args.sync_only:
        results["parts"] += tiny_runs(clock, device, work)
        save()
        results["parts"] += shaped_runs(clock, device, work, args.small, with_7b=not args.skip_7b)
        save()
    from gpu_check_sync import sync_runs, sync_table

    model = shaped_model_dir(CONFIGS / "qwen2.5-1.5b.json", work / "models", device, args.small)
    results["parts"] += sync_runs(clock, device, work, model)
    save()
    print(table(results))
    print("\n".join(sync_table(results["parts"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
