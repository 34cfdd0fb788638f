"""`model.bf16: auto` for the policy update: bf16 autocast where this host runs it faster, measured.

On a CUDA device nothing is measured: `auto` is bf16 autocast where the GPU has native bf16 (compute
capability 8.0+), fp32 (with TF32 matmuls, rlvr.devices.enable_tf32) elsewhere. The rest of this
docstring is about CPUs.

Whether bf16 pays depends on the CPU, not on a flag: on AVX2-only CPUs bf16 matmuls run ~8x slower
than fp32; on a 2-core AMD EPYC (Zen 4) with avx512_bf16 they run 2.2-2.5x faster at SmolLM2's update
shapes; on an Intel Xeon with avx512_bf16 autocast made the update slower (issue 18). So on a CPU
with native bf16 (avx512_bf16 / amx_bf16) `auto` times one forward + backward of the policy on a
synthetic micro-batch in both precisions and picks bf16 only when it is at least `MARGIN` faster: the
choice never slows the update down against fp32. The answer is cached per CPU model, torch version,
thread count and model shape (`$RLVR_CACHE_DIR`, else `$XDG_CACHE_HOME/rlvr`, else ~/.cache/rlvr), so
a host pays the ~15 s once per model size. CPUs without native bf16 never measure: fp32.

What the choice covers: the update's matmuls (bf16 compute over fp32 weights, which stay the
optimizer's master copy; gradients accumulate in fp32 `.grad`; log-probs, losses and the softmax in
fp32). Sampling never autocasts whatever it says: the demo (examples/quickstart.yaml, seed 0, 12
steps) learned under a bf16 update with an fp32 sampler (train reward 0.0 -> 0.69, as in fp32) and
did not learn when the sampler ran under autocast too (0.0 -> 0.03-0.28, entropy rising). A bf16
sampler is a bf16 copy of the weights on rlvr's decode path (`generator.decode`/`decode_dtype`
auto: on every CPU with native bf16, a fixed rule, rlvr.precision.bf16_sampler_on). Offline stages
(sft, dpo, reward_model) resolve `auto` without measuring (fp32 unless RLVR_AUTO_BF16=on).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlvr import devices, precision
from rlvr.devices import device_of, supports_bf16

# bf16 must run the calibration step at most this fraction of fp32's time to be chosen: a margin
# for timing noise on shared machines, so a tie never switches a run to the less exact precision.
MARGIN = 0.85
# Bumped when what is measured changes, so old cached answers are not reused.
CALIBRATION_VERSION = 3


@dataclass(frozen=True)
class PrecisionChoice:
    """What `auto` resolved to for the update, and why. Seconds are the best of the timed repeats."""

    bf16: bool
    reason: str
    fp32_s: float | None = None
    bf16_s: float | None = None

    @property
    def bits(self) -> float:
        """16.0 for a bf16 update, 32.0 for fp32 (logged as `perf/precision`)."""
        return 16.0 if self.bf16 else 32.0

    def describe(self) -> str:
        name = "bf16 autocast" if self.bf16 else "fp32"
        timing = ""
        if self.fp32_s is not None and self.bf16_s is not None:
            timing = f" (update micro-batch fp32 {self.fp32_s:.2f} s, bf16 {self.bf16_s:.2f} s)"
        return f"update precision: {name}: {self.reason}{timing}"


def cache_dir() -> Path:
    explicit = os.environ.get("RLVR_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rlvr"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(model: Any) -> str:
    """The host and model facts the timing depends on, hashed."""
    config = getattr(model, "config", None)
    facts = {
        "version": CALIBRATION_VERSION,
        "cpu": _cpu_model(),
        "native_bf16": devices.cpu_has_bf16(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "params": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "shape": [
            getattr(config, k, None)
            for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")
        ],
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def _step_seconds(model: Any, ids_B_T: torch.Tensor, bf16: bool) -> float:
    """One forward + backward as the update runs it: completions scored at the last half of the
    positions, the softmax in fp32."""
    keep = ids_B_T.shape[1] // 2
    started = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=ids_B_T, use_cache=False, logits_to_keep=keep).logits
    # One target per position, as the update gathers the sampled token's log-prob.
    torch.log_softmax(logits.float(), dim=-1)[:, :, 0].mean().backward()
    return time.perf_counter() - started


def measure(model: Any, rows: int = 4, tokens: int = 64, repeats: int = 4) -> tuple[float, float]:
    """Best-of-`repeats` seconds of one update micro-batch in fp32 and in bf16, alternating (so both
    see the same machine load), after one warm-up each. Weights, gradients, the model's mode and
    every random stream are left as they were.

    Four repeats, not two: with two, one calibration in a fresh process here read bf16 at 0.91x
    fp32 (fp32 then chosen, a ~2x slower update for that host's runs) where every other read,
    before and after, was 0.60-0.74x (SmolLM2-135M, Zen 4; ~15 s once per host and model)."""
    vocab = int(getattr(model.config, "vocab_size", 1000))
    ids = torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(0))
    params = list(model.parameters())
    grads = [p.grad for p in params]
    was_training = model.training
    model.eval()  # no dropout: nothing draws from the global random stream
    best = {False: float("inf"), True: float("inf")}
    try:
        for rep in range(repeats + 1):
            for bf16 in (False, True):
                seconds = _step_seconds(model, ids, bf16)
                if rep > 0:  # the first of each is a warm-up (allocations, kernel selection)
                    best[bf16] = min(best[bf16], seconds)
                for p in params:
                    p.grad = None
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        model.train(was_training)
    return best[False], best[True]


def choose(
    model: Any,
    *,
    distributed: bool = False,
    measure_fn: Callable[[Any], tuple[float, float]] | None = None,
) -> PrecisionChoice:
    """Resolve `model.bf16: auto` for the update of `model` on this host (see the module docstring)."""
    forced = os.environ.get(precision.AUTO_BF16_ENV, "").strip()
    if forced:
        return PrecisionChoice(precision.native_bf16(), f"{precision.AUTO_BF16_ENV}={forced}")
    device = device_of(model)
    if device.type == "cuda":
        # No timing on a GPU: bf16 tensor-core matmuls are several times fp32's (even TF32's) on
        # every NVIDIA GPU that has them (compute capability 8.0+, Ampere on); older GPUs get fp32
        # with TF32 off (they have no TF32 either).
        if supports_bf16(device):
            return PrecisionChoice(True, f"{device} has native bf16 (compute capability 8.0+)")
        return PrecisionChoice(False, f"{device} has no native bf16 (compute capability < 8.0)")
    if device.type != "cpu":
        return PrecisionChoice(False, f"auto measures CPUs and CUDA devices only ({device.type})")
    if not devices.cpu_has_bf16():
        return PrecisionChoice(False, "this CPU has no native bf16 (avx512_bf16 / amx_bf16)")
    if distributed:
        # Every rank would time its own share of the machine and might decide differently.
        return PrecisionChoice(False, "not measured under torchrun (set model.bf16 to choose)")
    path = cache_dir() / "update_precision.json"
    key = cache_key(model)
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    hit = known.get(key) if isinstance(known, dict) else None
    if isinstance(hit, dict) and {"fp32_s", "bf16_s"} <= hit.keys():
        fp32_s, bf16_s = float(hit["fp32_s"]), float(hit["bf16_s"])
        origin = f"measured earlier on this host, cached in {path}"
    else:
        fp32_s, bf16_s = (measure_fn or measure)(model)
        origin = "measured now"
        _store(path, {**(known if isinstance(known, dict) else {}), key: {
            "fp32_s": fp32_s, "bf16_s": bf16_s, "cpu": _cpu_model(), "when": time.time(),
        }})  # fmt: skip
    faster = bf16_s <= MARGIN * fp32_s
    verdict = "bf16 is faster" if faster else f"bf16 is not {1 / MARGIN:.2f}x faster"
    return PrecisionChoice(faster, f"{verdict} on this CPU ({origin})", fp32_s, bf16_s)


def _store(path: Path, entries: dict[str, Any]) -> None:
    """Write atomically (two runs may calibrate at once); a read-only home is not an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".update_precision.")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass


def resolve(model: Any, model_name: str, **kwargs: Any) -> PrecisionChoice:
    """`choose`, then record the answer so `rlvr.build.use_bf16` gives it for `model_name`."""
    choice = choose(model, **kwargs)
    precision.record_auto_bf16(model_name, choice.bf16)
    return choice
