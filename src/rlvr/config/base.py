"""The base of every section (unknown keys are errors) and the sampler-precision questions several sections ask."""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def bf16_sampling_copy(
    backend: Any, decode: Any, decode_dtype: Any, bf16: Any, device: Any = "auto"
) -> bool:
    """Whether the sampler decodes from a bf16 copy of the weights while the trainer scores with its
    own: an in-process generator (`generator.backend: hf`) on rlvr's decode path (`decode: fast`,
    or `auto`) with `decode_dtype: bfloat16`, or `auto` where `rlvr.precision.bf16_sampler_on` says
    so (a CPU with native bf16, `model.bf16` not off). Plain values, so that both the resolved config
    (the mismatch monitor) and the raw dict (the truncated-IS default below) ask the same question."""
    if backend in ("server", "vllm_colocate") or decode == "hf" or decode_dtype == "float32":
        return False
    from rlvr.precision import bf16_sampler_on  # lazily: it imports torch

    return decode_dtype == "bfloat16" or bf16_sampler_on(str(bf16), str(device))


def decode_path(
    backend: Any, decode: Any, decode_dtype: Any, bf16: Any, device: Any = "auto"
) -> str:
    """`generator.decode` resolved: "fast" or "hf". `auto` takes rlvr's decode path exactly when it
    samples from a bf16 copy (`bf16_sampling_copy`): the copy is what makes it faster (2.1-2.3x
    HF's generate on two native-bf16 CPU kinds, docs/performance.md); in float32 it gains ~5-20%."""
    if decode in ("hf", "fast"):
        return str(decode)
    return "fast" if bf16_sampling_copy(backend, decode, decode_dtype, bf16, device) else "hf"
