"""`model:`: which weights, where, in what precision, with or without LoRA."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from rlvr.config.base import _Section


class LoraConfig(_Section):
    enabled: bool = Field(False, description="Train LoRA adapters instead of all weights.")
    r: int = Field(16, ge=1, description="Adapter rank.")
    alpha: int = Field(32, ge=1, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: str | list[str] = Field("all-linear", description="peft target_modules.")


class ModelConfig(_Section):
    name: str = Field(
        "smollm2-135m-instruct",
        description="HF model directory, hub id, or alias (smollm2-135m-instruct, tiny-random).",
    )
    lora: LoraConfig = LoraConfig()
    gradient_checkpointing: bool = False
    bf16: Literal["auto", "on", "off"] = Field(
        "auto",
        description="bf16 autocast for the trainer's matmuls (fp32 weights stay the optimizer's master "
        "copy; log-probs and losses stay fp32). 'auto': on a CPU with native bf16 the RL loop times an "
        "update micro-batch both ways and takes bf16 only when it takes <= 0.85x the fp32 time, "
        "cached per host and model size (rlvr.train.precision_choice); fp32 on AVX2-only CPUs and in "
        "offline stages on CPUs; on a CUDA device bf16 where it is native (compute capability 8.0+), "
        "not timed. Sampling never autocasts (a bf16 sampler is generator.decode: fast with a "
        "bf16 copy).",
    )
    precision: Literal["mixed", "lean"] = Field(
        "mixed",
        description="How a full fine-tune keeps its weights. mixed: fp32 weights, gradients and "
        "AdamW moments (16 bytes a parameter), matmuls per model.bf16. lean: bf16 weights, "
        "gradients and AdamW moments (8 bytes a parameter: a 7B full fine-tune fits one 80 GB GPU "
        "with gradient checkpointing, `rlvr plan`), the optimizer's writes stochastically rounded "
        "so updates below bf16's resolution still move the weights in expectation "
        "(rlvr.optim.StochasticRoundingAdamW; torchao's bf16_stochastic_round AdamW; Zamirai et "
        "al. 2020). Full fine-tuning on one device; LoRA keeps its own precision.",
    )
    device: str = Field(
        "auto",
        description="Where the policy (and its reference, critic, teacher, reward models) lives: "
        "auto = cuda:LOCAL_RANK where CUDA is available, else cpu; or cpu, cuda, cuda:N.",
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa",
        description="transformers' attention kernel for the update and HF's sampler: sdpa (PyTorch's "
        "fused attention), eager, or flash_attention_2 (needs the flash-attn package and a GPU).",
    )

    @model_validator(mode="after")
    def _lean_is_full_bf16(self) -> ModelConfig:
        if self.precision == "lean":
            if self.lora.enabled:
                raise ValueError(
                    "model.precision: lean is for full fine-tuning (LoRA trains small fp32 adapters "
                    "and already stores its frozen base in bf16): drop one of them"
                )
            if self.bf16 == "off":
                raise ValueError(
                    "model.precision: lean computes in bf16 (its weights are bf16): model.bf16: "
                    "off contradicts it; leave model.bf16 at auto"
                )
        return self

    @field_validator("device")
    @classmethod
    def _device_known(cls, value: str) -> str:
        text = str(value).strip().lower()
        if text in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", text):
            return text
        raise PydanticCustomError(
            "device",
            "expected auto, cpu, cuda or cuda:N (N a GPU index), got '{value}'",
            {"value": value},
        )
