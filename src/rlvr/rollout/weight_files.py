"""Weights written as safetensors files for a server to load, streamed: one tensor at a time, cast
through one reused scratch buffer, never a second copy of the model in memory.

safetensors' own `save_file` takes a dict of whole tensors, so a cast sync (fp32 weights, bf16
files) would first allocate every cast tensor: a bf16 copy of the model on the host, freshly
page-faulted at every sync. The file format is simple and public (https://github.com/huggingface/
safetensors, "Format"): an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the bytes. This module writes that format directly.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

# torch dtype -> the format's dtype name
_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class Deferred:
    """A tensor made only when its bytes are read (`detach()`): a LoRA layer's merged weight. Its
    shape and dtype are known ahead, so a shard's header is written before any is made, and each
    is dropped after its write: the host never holds every merged matrix at once (~26 GB for a 7B
    all-linear adapter on an fp32 base)."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, make: Callable[[], torch.Tensor]):
        self.shape, self.dtype, self.make = shape, dtype, make

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def numel(self) -> int:
        return math.prod(self.shape)

    def detach(self) -> torch.Tensor:
        return self.make().detach()


Weight = torch.Tensor | Deferred


def write_shards(
    tensors: Iterable[tuple[str, Weight]],
    folder: Path,
    dtype: torch.dtype,
    shard_bytes: int = 2**30,
) -> list[Path]:
    """(name, tensor) pairs into `model-0000k.safetensors` files of about `shard_bytes` each, every
    floating tensor written in `dtype` (integer and bool buffers as they are). Returns the files."""
    shards: list[list[tuple[str, Weight]]] = [[]]
    size = 0
    for name, tensor in tensors:
        out_dtype = dtype if tensor.is_floating_point() else tensor.dtype
        if shards[-1] and size >= shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += tensor.numel() * torch.empty((), dtype=out_dtype).element_size()
    scratch = _Scratch()
    files = []
    for index, shard in enumerate(s for s in shards if s):
        path = folder / f"model-{index + 1:05d}.safetensors"
        write_safetensors(path, shard, dtype, scratch)
        files.append(path)
    return files


class _Scratch:
    """One flat host buffer per dtype, grown to the largest tensor cast through it."""

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def cast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if tensor.dtype == dtype and tensor.device.type == "cpu":
            return tensor.contiguous()  # written as it is: no copy
        buffer = self.buffers.get(dtype)
        if buffer is None or buffer.numel() < tensor.numel():
            buffer = self.buffers[dtype] = torch.empty(tensor.numel(), dtype=dtype)
        out = buffer[: tensor.numel()].view(tensor.shape)
        out.copy_(tensor.detach())
        return out


def write_safetensors(
    path: Path,
    tensors: list[tuple[str, Weight]],
    dtype: torch.dtype,
    scratch: _Scratch | None = None,
) -> None:
    """One safetensors file: floating tensors in `dtype`, the rest as they are."""
    scratch = scratch or _Scratch()
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors:
        out_dtype = dtype if tensor.is_floating_point() else tensor.dtype
        nbytes = tensor.numel() * torch.empty((), dtype=out_dtype).element_size()
        header[name] = {
            "dtype": _NAMES[out_dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for _, tensor in tensors:
            out_dtype = dtype if tensor.is_floating_point() else tensor.dtype
            data = scratch.cast(tensor.detach(), out_dtype)
            if data.numel():
                out.write(data.reshape(-1).view(torch.uint8).numpy().data)


def read_weight_files(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file `path`, or of all *.safetensors files in folder `path`
    (what a server's reload reads; FileNotFoundError when there are none)."""
    from safetensors.torch import load_file

    folder = Path(path)
    files = [folder] if folder.is_file() else sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in '{path}'")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return weights
