"""What a benchmark ran on, for the header of every table it prints: `lscpu`'s model name, whether
the CPU has native bf16 matmuls (avx512_bf16 / amx_bf16 in /proc/cpuinfo: on a CPU without them,
bf16 matmuls run ~8x slower than fp32), torch's thread count, and the git commit of the code measured
(with its date, and whether the tree had uncommitted changes) and the date of the run.

    python benchmarks/_machine.py     # the header alone (make bench prints it before generation.py)

The parsing functions take the text of /proc/cpuinfo and `lscpu`, so tests can feed them any CPU.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
REPO = Path(__file__).resolve().parent.parent


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of the first processor in /proc/cpuinfo's text (x86 `flags`, ARM
    `Features`); empty when there is no such line."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            return set(value.split())
    return set()


def native_bf16_flags(cpuinfo: str) -> tuple[str, ...]:
    """Which of avx512_bf16 / amx_bf16 the CPU has (whole flags only: `avx512_bf16x` is not one)."""
    flags = cpu_flags(cpuinfo)
    return tuple(f for f in NATIVE_BF16_FLAGS if f in flags)


def cpu_model_name(lscpu: str, cpuinfo: str = "") -> str:
    """`lscpu`'s "Model name", else /proc/cpuinfo's "model name", else "unknown CPU"."""
    for text, key in ((lscpu, "model name"), (cpuinfo, "model name")):
        for line in text.splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip().lower() == key and value.strip():
                return value.strip()
    return "unknown CPU"


def cpu_kind(bf16_flags: tuple[str, ...], flags: set[str]) -> str:
    """The CPU kind the performance tables are split by."""
    if bf16_flags:
        return "native bf16 (" + ", ".join(bf16_flags) + ")"
    if "avx512f" in flags:
        return "AVX-512 without bf16 (bf16 matmuls emulated, slow)"
    if "avx2" in flags:
        return "AVX2-only (bf16 matmuls emulated, ~8x slower than fp32)"
    return "no avx512_bf16 / amx_bf16"


@dataclass(frozen=True)
class Machine:
    cpu: str  # lscpu's model name
    kind: str  # cpu_kind()
    cpus: int
    torch_version: str
    torch_threads: int
    omp_num_threads: str | None  # the environment variable, as set (None: unset)
    commit: str
    commit_date: str
    dirty: bool  # tracked files differ from the commit
    run_date: str

    def header(self) -> list[str]:
        omp = f"OMP_NUM_THREADS={self.omp_num_threads}" if self.omp_num_threads else "OMP unset"
        dirty = ", with uncommitted changes" if self.dirty else ""
        return [
            f"CPU: {self.cpu}, {self.cpus} CPUs, {self.kind}",
            f"torch {self.torch_version}, {self.torch_threads} threads ({omp}); "
            f"commit {self.commit} ({self.commit_date}{dirty}); run {self.run_date}",
        ]


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _run(*cmd: str) -> str:
    try:
        return subprocess.run(
            list(cmd), capture_output=True, text=True, check=True, cwd=REPO
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def machine() -> Machine:
    """This machine and checkout (imports torch for its version and thread count)."""
    import torch

    cpuinfo = _read("/proc/cpuinfo")
    bf16 = native_bf16_flags(cpuinfo)
    return Machine(
        cpu=cpu_model_name(_run("lscpu"), cpuinfo),
        kind=cpu_kind(bf16, cpu_flags(cpuinfo)),
        cpus=os.cpu_count() or 0,
        torch_version=torch.__version__,
        torch_threads=torch.get_num_threads(),
        omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
        commit=_run("git", "rev-parse", "--short", "HEAD") or "unknown",
        commit_date=_run("git", "show", "-s", "--format=%cs", "HEAD") or "?",
        dirty=bool(_run("git", "status", "--porcelain", "--untracked-files=no")),
        run_date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    )


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


def has_native_bf16() -> bool:
    return bool(native_bf16_flags(_read("/proc/cpuinfo")))


if __name__ == "__main__":
    print("\n".join(machine().header()))
