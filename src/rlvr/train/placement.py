"""The run's first lines: where the model is, in what dtype, what samples, and what a setting costs.

A user on a GPU box must see at once whether the policy landed on the GPU (issue 34: before
`model.device`, `rlvr train` trained on the host with the GPUs idle and said nothing).
"""

from __future__ import annotations

from typing import Any

import torch

from rlvr.config import RunConfig
from rlvr.devices import describe
from rlvr.models import Policy
from rlvr.train.micro_batching import packs_rows


def placement_line(cfg: RunConfig, policy: Policy, device: torch.device, generator: Any) -> str:
    """Where the model is, its weights' dtypes, what trains, and what samples."""
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in policy.model.parameters()})
    trainable = sum(p.numel() for p in policy.trainable_parameters())
    total = sum(p.numel() for p in policy.model.parameters())
    what = "LoRA adapters" if policy.lora else "all weights"
    line = (
        f"model {cfg.model.name} on {describe(device)}: weights {'/'.join(dtypes)}, "
        f"training {what} ({trainable / 1e6:.1f}M of {total / 1e6:.1f}M parameters)"
    )
    decode = getattr(generator, "decode", None)
    if decode is not None:
        dtype = str(getattr(generator, "decode_dtype", "")).removeprefix("torch.")
        line += f"; sampler: {'rlvr decode' if decode == 'fast' else 'HF forward'}"
        line += f" ({dtype} weight copy)" if decode == "fast" else ""
    elif cfg.generator.backend == "server":
        line += "; sampler: a server (generator.url / launch)"
    elif cfg.generator.backend == "vllm_colocate":
        line += f"; sampler: vLLM in this process ({cfg.generator.served_dtype()})"
    return line


def startup_lines(
    cfg: RunConfig, policy: Policy, device: torch.device, generator: Any
) -> list[str]:
    """`placement_line`, then what a setting costs that the run would otherwise pay silently."""
    lines = [placement_line(cfg, policy, device, generator)]
    if cfg.model.gradient_checkpointing and cfg.train.share_prompt_prefix:
        # train/batch.py falls back to the plain path: said here rather than hidden.
        lines.append(
            "gradient checkpointing: HF keeps no KV cache under it, so the update runs each "
            "row's prompt again (group_size x the prompt tokens per micro-batch, not 1x) "
            "instead of sharing it (train.share_prompt_prefix)"
        )
    if packs_rows(cfg, policy.model, training=True):
        lines.append(
            "padding-free update: a micro-batch's rows run end to end, no padding "
            "(train.padding_free; a probe checks once per model that rows stay apart)"
        )
    return lines
