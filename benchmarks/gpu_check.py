"""The GPU check (issue 34): what the CPU suite can only prove by proxy, measured on a real GPU in one run.

    python benchmarks/gpu_check.py [--out DIR] [--budget-s 480] [--skip-7b]
    python benchmarks/gpu_check.py --dry-run            # each part's seconds and disk; runs nothing
    python benchmarks/gpu_check.py --allow-cpu --small  # a smoke run of this script on a CPU

One GPU machine, no network, 8 minutes (`--dry-run` adds up the estimates: ~456 s, 18.3 GB of disk
at most). Models are built from configs shipped as test data (tests/data/configs/*.json, random
weights, the tiny character tokenizer: no hub), and each part starts only if its estimate fits in
what is left of the budget, so the clock drops the last rows first (what was skipped is recorded,
never hidden). Every part is guarded: one that fails is a row with its error, and the table is
always printed.
1. the tests marked `cuda` (tests/test_cuda.py: placement, greedy tokens equal to the CPU's, a step
   of every algorithm; tests/test_sampler_device.py: sampling on the GPU);
2. the tiny model trained 2 steps with every RL algorithm on the GPU, single- and multi-turn;
3. random-weight models shaped like Qwen2.5-1.5B and -7B, 3 RL steps each (SHAPED_ROWS, most
   informative first): 1.5B full FT, the same with CUDA-graph decode steps
   (`generator.cuda_graphs`), 7B LoRA, 7B full FT in the lean mode (`model.precision: lean`,
   checkpointed), then the 1.5B shape checkpointed padded and packed. Each row:
   step time split into rollout and update, decode ms per step, tokens/s, and the peak GPU memory
   (torch.cuda.max_memory_allocated) beside `rlvr plan`'s estimate for the same config. No row
   writes a checkpoint, and each row's run directory and each model folder after its last row are
   removed, so the disk never holds more than the two model folders (18.3 GB);
4. one full-weight sync of the 1.5B shape each way rlvr has (benchmarks/gpu_check_sync.py): fp32
   files on disk (old), bf16 shards in /dev/shm, the colocated vLLM in memory and a launched vLLM
   server, where vLLM is installed (else recorded as skipped).
It writes DIR/gpu_check.json ($OUT when set, else benchmarks/) after each part and prints the
table that docs/performance.md ("GPU") records with the device, date and commit.

On the device machine (python3 there has torch, transformers 5.17, accelerate, safetensors; not
pydantic, fastapi, ...: benchmarks/gpu_image.py lists what it lacks). `make gpu-wheels` first,
here; then one `run` of the device tool with `carry: [".whl"]` and `timeout_s: 600`, the whole
log under $OUT (about 10 minutes with the machine's start, leaving ~5 of the 15 for a rerun):

    set -o pipefail; python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
      && PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py 2>&1 \
      | tee $OUT/gpu_check.log

Here, `python benchmarks/gpu_image.py benchmarks/gpu_check.py --allow-cpu --small` runs the smoke
path with those packages unimportable (tests/test_gpu_check.py does, from a tree without .git).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
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
            # No checkpoint: a 1.5B full fine-tune's is ~18.5 GB (weights and two Adam moments).
            "checkpoint.save_final=false",
            # Random weights score alike: without this a step would skip its update (no signal),
            # and the row would time and size no update at all.
            "train.step_without_signal=true",
            *overrides,
        ],
    )
    estimate = plan_estimate_gb(cfg)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.monotonic()
    try:
        summary = train(cfg, config_dir=base_config.parent)
        wall = time.monotonic() - started
        rows = [m for m in read_metrics(summary.run_dir) if "loss" in m]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)  # the disk holds no row's leftovers
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
        "decode_ms_per_step": round(mean("perf/decode_ms_per_step"), 2),
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
    for name, config, extra in TINY_ROWS:
        if not clock.allows(TINY_ROW_S):
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


TINY_ROWS = [
    (f"{a} single-turn", EXAMPLES / "tiny.yaml", [f"algorithm={a}"]) for a in RL_ALGORITHMS
]
TINY_ROWS += [
    ("grpo multi-turn", EXAMPLES / "tiny_multiturn.yaml", []),
    ("grpo multi-turn lora bf16", EXAMPLES / "tiny_multiturn.yaml",
     ["model.lora.enabled=true", "model.bf16=on"]),
    ("grpo kl beta 0.04", EXAMPLES / "tiny.yaml", ["objective.beta=0.04"]),
]  # fmt: skip

# Seconds each part is expected to take on an H100 (estimates, not yet measured: the first lease
# records each row's wall_s in gpu_check.json; correct these from it). A part starts only if its
# estimate fits in what is left of the budget, and `--dry-run` adds them up.
TESTS_S, TINY_ROW_S, SYNC_S = 60, 6, 45
BUILD_S_PER_BILLION = 6  # a random-weight model made on the GPU and written in bf16 (~2 GB/s)
LORA = "model.lora.enabled=true"
CKPT = "model.gradient_checkpointing=true"
# The shaped rows, the most informative first (the clock drops from the end): the 1.5B full
# fine-tune as the defaults run it and with CUDA-graph decode steps (decode ms per step side by
# side), then the 7B rows (the memory rows: LoRA, and full fine-tuning
# in the lean mode, which needs checkpointing to fit 80 GB), then the 1.5B variants. Each: shape,
# variant, overrides, seconds (the model's build is counted apart). LoRA at 1.5B and fp32 were
# dropped to fit the 8 minutes (7B LoRA covers LoRA; an H100 trains in bf16).
SHAPED_ROWS = (
    ("qwen2.5-1.5b", "full bf16", ["model.bf16=auto"], 35),
    ("qwen2.5-1.5b", "full bf16 cuda graphs", ["model.bf16=auto", "generator.cuda_graphs=true"], 25),
    ("qwen2.5-7b", "lora bf16", [LORA, "model.bf16=auto"], 60),
    ("qwen2.5-7b", "full lean ckpt", ["model.precision=lean", CKPT], 60),
    ("qwen2.5-1.5b", "full bf16 ckpt padded", ["model.bf16=auto", CKPT, "train.padding_free=false"], 25),
    ("qwen2.5-1.5b", "full bf16 ckpt packed", ["model.bf16=auto", CKPT, "train.padding_free=true"], 25),
)  # fmt: skip
SYNC_SHAPE = "qwen2.5-1.5b"  # the weight-sync part's model (its folder is kept until then)


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


def shape_params(shape: str) -> int:
    """Parameters of a shipped shape, from its config alone (rlvr.plan's count)."""
    from transformers import AutoConfig

    from rlvr.plan import ModelShape

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text((CONFIGS / f"{shape}.json").read_text())
        return ModelShape.from_config(AutoConfig.from_pretrained(folder)).total


def last_use(shape: str) -> int:
    """Index of the last shaped row that needs `shape`'s folder; past the end if the sync does."""
    if shape == SYNC_SHAPE:
        return len(SHAPED_ROWS)
    return max(i for i, row in enumerate(SHAPED_ROWS) if row[0] == shape)


def shaped_runs(
    clock: Clock, device: str, work: Path, small: bool, with_7b: bool
) -> list[dict[str, Any]]:
    """SHAPED_ROWS, 3 RL steps each; a shape's random-weight folder is removed after its last row."""
    tokens = 16 if small else 128
    common = [
        "sampling.group_size=8",
        "sampling.prompts_per_step=4",
        f"sampling.max_new_tokens={tokens}",
        "train.steps=3",
        "train.micro_batch_size=8",
        "train.learning_rate=1e-6",
    ]
    results = []
    for index, (shape, variant, extra, seconds) in enumerate(SHAPED_ROWS):
        name = f"{shape} {variant}"
        built = (work / "models" / (shape + ("-small" if small else ""))).exists()
        needs_s = seconds + (0 if built else BUILD_S_PER_BILLION * shape_params(shape) / 1e9)
        if shape == "qwen2.5-7b" and not with_7b:
            results.append({"part": "shaped", "name": name, "ok": None, "skipped": "--skip-7b"})
        elif not clock.allows(needs_s):
            results.append({"part": "shaped", "name": name, "ok": None, "skipped": "time budget"})
        else:

            def run(
                shape: str = shape, extra: list[str] = extra, name: str = name
            ) -> dict[str, Any]:
                model = shaped_model_dir(CONFIGS / f"{shape}.json", work / "models", device, small)
                return train_once(
                    EXAMPLES / "tiny.yaml",
                    [f"model.name={model}", *common, *extra],
                    device,
                    work / name.replace(" ", "-"),
                )

            results.append(attempt("shaped", name, run))
        if last_use(shape) == index:  # the disk holds one 7B folder at most, never two
            remove_model_dir(work, shape)
    return results


def remove_model_dir(work: Path, shape: str) -> None:
    for suffix in ("", "-small"):
        shutil.rmtree(work / "models" / (shape + suffix), ignore_errors=True)


def dry_run(budget_s: float, with_7b: bool, skip_tests: bool) -> int:
    """Each part's estimated seconds and bytes written, and whether the whole run fits the lease's
    budget (`budget_s`) and 40 GB of disk. Nothing is built or run. Returns 0 if it fits, else 1."""
    gb = 1e9
    params = {shape: shape_params(shape) for shape in {r[0] for r in SHAPED_ROWS}}
    rows: list[tuple[str, float, float]] = []  # name, seconds, disk bytes in use during it
    if not skip_tests:
        rows.append(("cuda tests", TESTS_S, 0.0))
    rows += [(f"tiny {name}", TINY_ROW_S, 0.0) for name, _, _ in TINY_ROWS]
    live: dict[str, float] = {}  # model folders on disk: bf16 weights
    for index, (shape, variant, _, seconds) in enumerate(SHAPED_ROWS):
        if shape == "qwen2.5-7b" and not with_7b:
            continue
        build_s = 0.0
        if shape not in live:
            live[shape] = 2.0 * params[shape]
            build_s = BUILD_S_PER_BILLION * params[shape] / 1e9
        # save_final off, eval off: a row writes its metrics and config only (kilobytes)
        rows.append((f"{shape} {variant}", seconds + build_s, sum(live.values())))
        if last_use(shape) == index:
            live.pop(shape)
    # the sync part: the fp32 folder on disk (4 bytes a parameter) beside the model's; /dev/shm's
    # bf16 shards are memory, not disk
    rows.append(("weight sync", SYNC_S, sum(live.values()) + 4.0 * params[SYNC_SHAPE]))
    total_s = sum(r[1] for r in rows)
    peak = max(r[2] for r in rows)
    print(f"{'part':<40}{'seconds':>9}{'disk GB in use':>16}")
    for name, seconds, disk in rows:
        print(f"{name:<40}{seconds:>9.0f}{disk / gb:>16.1f}")
    fits = total_s <= budget_s and peak <= DISK_LIMIT_GB * gb
    print(
        f"total {total_s:.0f} s of a {budget_s:.0f} s budget; disk peak {peak / gb:.1f} GB of "
        f"{DISK_LIMIT_GB} GB: {'fits' if fits else 'does NOT fit'}"
    )
    return 0 if fits else 1


DISK_LIMIT_GB = 40  # of the machine's 64 GiB, which also holds the image


# ------------------------------------------------------------------------------------ the report
def table(results: dict[str, Any]) -> str:
    m = {k: v for k, v in results["machine"].items() if v is not None}
    lines = [
        f"GPU check: {m.get('device', '?')} (capability {m.get('capability', '-')}), torch "
        f"{m.get('torch', '?')}, CUDA {m.get('cuda', '-')}, transformers "
        f"{m.get('transformers', '?')}, commit {m.get('commit', '?')}, {m.get('date', '?')}",
    ]
    for part in results["parts"]:
        if part.get("part") == "cuda tests":
            summary = part.get("summary") or part.get("error", "")
            lines.append(f"cuda tests: {'ok' if part['ok'] else 'FAILED'}: {summary}")
            lines += [f"  {f}" for f in part.get("failures", [])]
        elif part.get("part") == "error":
            lines.append(f"ERROR in {part['name']}: {part['error']}")
    header = "| run | ok | step s | rollout s | update s | decode ms/step | tokens/s | bits | peak GiB | plan GiB | plan/peak |"
    lines += [header, "|---" * 11 + "|"]
    for part in results["parts"]:
        if part.get("part") not in ("tiny", "shaped"):
            continue
        if part.get("ok") is None:
            lines.append(f"| {part['name']} | skipped ({part['skipped']}) |" + " |" * 9)
            continue
        if not part["ok"]:
            lines.append(f"| {part['name']} | ERROR: {part['error'][:120]} |" + " |" * 9)
            continue
        cells = [part["name"], "yes" if part["finite_loss"] else "non-finite loss"]
        keys = ("step_s", "rollout_s", "update_s", "decode_ms_per_step", "tokens_per_s")
        cells += [str(part.get(k, "")) for k in keys]
        cells += [f"{part['precision_bits']:.0f}", str(part["peak_gb"]), str(part["plan_gb"])]
        cells.append(str(part["plan_ratio"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def guarded(name: str, fn: Any) -> list[dict[str, Any]]:
    """A part's rows, or one error row if the part itself fails: the script always gets to its
    table (a missing package, a planner bug, an OOM outside a row are findings, not the end)."""
    try:
        rows = fn()
        return rows if isinstance(rows, list) else [rows]
    except Exception as err:  # recorded; the check goes on to the next part
        traceback.print_exc()
        return [
            {
                "part": "error",
                "name": name,
                "ok": False,
                "error": f"{type(err).__name__}: {err}"[:500],
            }
        ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "benchmarks"))
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--skip-7b", action="store_true")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--allow-cpu", action="store_true", help="smoke-run on a host without CUDA")
    parser.add_argument("--small", action="store_true", help="2-layer stand-ins of the shapes")
    parser.add_argument(
        "--sync-only", action="store_true", help="only part 4, the weight syncs (skips 1-3)"
    )
    parser.add_argument(
        "--dry-run", action="store_true",
        help="print each part's estimated seconds and disk use, and whether the run fits; run nothing",
    )  # fmt: skip
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    if args.dry_run:
        return dry_run(args.budget_s, with_7b=not args.skip_7b, skip_tests=args.skip_tests)
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("gpu_check: torch sees no CUDA device (use --allow-cpu for a smoke run)")
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    clock = Clock(args.budget_s)
    results: dict[str, Any] = {"machine": {}, "parts": []}
    results["parts"] += guarded("machine", lambda: results["machine"].update(machine()) or [])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rlvr-gpu-check-"))
    os.environ.setdefault("RLVR_CACHE", str(work / "cache"))

    def save() -> None:
        results["seconds"] = round(args.budget_s - clock.left(), 1)
        (out / "gpu_check.json").write_text(json.dumps(results, indent=1))

    try:
        if not args.skip_tests and not args.sync_only:
            results["parts"] += guarded("cuda tests", lambda: run_cuda_tests(clock))
            save()
        if not args.sync_only:
            results["parts"] += guarded("tiny", lambda: tiny_runs(clock, device, work))
            save()
            results["parts"] += guarded(
                "shaped",
                lambda: shaped_runs(clock, device, work, args.small, with_7b=not args.skip_7b),
            )
            save()

        def sync() -> list[dict[str, Any]]:
            from gpu_check_sync import sync_runs

            config = CONFIGS / f"{SYNC_SHAPE}.json"
            model = shaped_model_dir(config, work / "models", device, args.small)
            return sync_runs(clock, device, work, model)

        results["parts"] += guarded("weight sync", sync)
        save()
    finally:
        shutil.rmtree(work, ignore_errors=True)  # model folders, caches: nothing left on the disk
    from gpu_check_sync import sync_table

    print(table(results))
    print("\n".join(sync_table(results["parts"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
