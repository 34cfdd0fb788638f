"""Where models live: `model.device` resolved to a torch.device, and the device facts code branches on.

Every model a run builds (policy, reference, critic, teacher, reward models) is placed on the device
`resolve_device` returns, and every tensor the sampler and the trainer create is made on the device of
the model it feeds (`device_of`), so the same code runs on a CPU and on a GPU. CPU-only tunings (the
allocator, `SkinnyLinear`, the fp64 sampler, the bf16 calibration) ask `is_cpu` first.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import Any

import torch

from rlvr.errors import ConfigError


def resolve_device(setting: str = "auto") -> torch.device:
    """`model.device` as a torch.device: `auto` = `cuda:LOCAL_RANK` where CUDA is available (rank 0
    when not under torchrun), else the CPU; `cuda` = `cuda:LOCAL_RANK`; `cuda:N` as given. Asking for
    a GPU that is not there is a one-line ConfigError, not a CUDA error at the first tensor."""
    text = str(setting).strip().lower()
    if text == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if text == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        return torch.device("cpu")
    if not text.startswith("cuda"):
        raise ConfigError(f"model.device: expected auto, cpu, cuda or cuda:N, got {setting!r}")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"model.device: {setting} asked for, but torch sees no CUDA device "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}); "
            "use model.device: cpu or auto"
        )
    index = local_rank if text == "cuda" else int(text.split(":", 1)[1])
    if index >= torch.cuda.device_count():
        raise ConfigError(
            f"model.device: {setting}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return torch.device("cuda", index)


def device_of(model: Any) -> torch.device:
    """The device of a model's first parameter (or buffer); the CPU for a model with neither."""
    for tensors in (model.parameters(), model.buffers()):
        for tensor in tensors:
            return tensor.device
    return torch.device("cpu")


def is_cpu(device: torch.device | str) -> bool:
    return torch.device(device).type == "cpu"


def describe(device: torch.device) -> str:
    """`cpu` or `cuda:0 (NVIDIA H200, 139.8 GiB)`: for the run's first lines."""
    if device.type != "cuda":
        return str(device)
    props = torch.cuda.get_device_properties(device)
    return f"{device} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"


def supports_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls are native on `device`: CUDA devices of compute capability 8.0+ (Ampere
    and later). CPUs are measured instead (rlvr.train.precision_choice)."""
    if device.type != "cuda":
        return False
    return bool(torch.cuda.is_bf16_supported(including_emulation=False))


def enable_tf32(device: torch.device) -> None:
    """TF32 for the fp32 matmuls and convolutions that remain on a CUDA device (Ampere and later run
    them ~8x faster at 10 mantissa bits; PyTorch leaves it off by default). A no-op on the CPU."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


@cache
def cpu_has_bf16() -> bool:
    """Whether this CPU has native bf16 matmuls (avx512_bf16 / AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def device_or_cpu(setting: str) -> torch.device:
    """`model.device` resolved, or the CPU where it cannot be (a config read on a machine without
    the GPU it names: loading the model says so, in one line)."""
    try:
        return resolve_device(setting)
    except ConfigError:
        return torch.device("cpu")
