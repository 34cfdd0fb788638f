"""The learned critic for PPO: a transformer backbone with a scalar value head, and its update.

V(s_t) for completion position t is the value of the state *before* completion token t is produced,
read from the hidden state that predicts token t: the last prompt token's for t = 0, then that of
completion token t - 1 (the alignment of `token_logprobs`). A row's values therefore line up with its
log-probs, its mask and the token-level rewards of rlvr.algorithms.gae.

How this departs from common implementations, on purpose:
- The backbone is the base model without its lm_head (`AutoModel`), not a causal LM with the head
  swapped, so no vocabulary-sized matmul is ever run for the critic.
- The head starts at exactly zero (weight and bias): V = 0 at step 0, so the first advantages are the
  plain discounted returns instead of returns minus a random per-state offset, and the targets' scale
  is learned from the returns rather than inherited from an arbitrary init. Backbone gradients are 0
  on the very first step (they flow through the head's weight) and non-zero from the second on.
- Each row runs its own prompt + completion (the plain path of rlvr.train.batch); prompts are not
  shared between rows.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from rlvr.algorithms.gae import value_loss
from rlvr.algorithms.losses import aggregate
from rlvr.devices import device_of
from rlvr.models import LoraSettings, add_lora, load_model_weights, resolve_model_path
from rlvr.train.batch import TrainBatch, autocast_context

WEIGHTS_FILE = "critic.safetensors"
CONFIG_FILE = "critic.json"


class ValueModel(torch.nn.Module):
    """Backbone (a HF base model, optionally with LoRA adapters) + `Linear(hidden, 1)` value head."""

    def __init__(
        self,
        backbone: Any,
        hidden_size: int,
        *,
        base_path: str,
        lora: LoraSettings | None = None,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        # fp32 whatever the backbone's dtype: the values are regression outputs on the reward scale.
        self.head = torch.nn.Linear(hidden_size, 1, dtype=torch.float32, device=device_of(backbone))
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.base_path = base_path
        self.lora = lora

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """V(s_t) for every completion position, (B, C) float32; gradient flows. Padding is garbage."""
        prompt_ids = batch.prompt_ids_P_Lp.index_select(0, batch.row_prompt_B)
        prompt_mask = batch.prompt_mask_P_Lp.index_select(0, batch.row_prompt_B)
        input_ids = torch.cat([prompt_ids, batch.completion_ids_B_C], dim=1)
        attention = torch.cat([prompt_mask, batch.completion_mask_B_C], dim=1)
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=False
        )
        # Column Lp - 1 + t holds the state that predicts completion token t.
        width, start = batch.completion_width, prompt_ids.shape[1] - 1
        hidden_B_C_H = out.last_hidden_state[:, start : start + width, :]
        with torch.autocast(hidden_B_C_H.device.type, enabled=False):  # the head stays fp32
            return self.head(hidden_B_C_H.float()).squeeze(-1)

    def forward(self, batch: TrainBatch) -> torch.Tensor:
        return self.values(batch)

    # -------------------------------------------------------------------------------- checkpointing
    def _trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.named_parameters() if p.requires_grad}

    def save(self, directory: str | Path) -> Path:
        """Write the trainable parameters (adapters or whole backbone, and the head) + critic.json."""
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        state = {n: t.contiguous().cpu() for n, t in self._trainable_state().items()}
        save_file(state, str(target / WEIGHTS_FILE))
        dtype = str(next(self.backbone.parameters()).dtype).removeprefix("torch.")
        meta = {
            "base": self.base_path,
            "lora": asdict(self.lora) if self.lora is not None else None,
            "dtype": dtype,
        }
        (target / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
        return target

    def load_into(self, directory: str | Path) -> None:
        """Copy saved trainable parameters into this critic (built the same way); exact."""
        state = load_file(str(Path(directory) / WEIGHTS_FILE))
        mine = dict(self.named_parameters())
        expected = set(self._trainable_state())
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ValueError(
                f"critic checkpoint {directory} does not match this critic "
                f"(missing {missing[:3]}, unexpected {extra[:3]}): built with other LoRA settings?"
            )
        with torch.no_grad():
            for name, tensor in state.items():
                mine[name].copy_(tensor)


def build_critic(
    model_path: str,
    lora: LoraSettings | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    gradient_checkpointing: bool = False,
    device: torch.device | str = "auto",
) -> ValueModel:
    """A critic from a causal-LM directory, hub id or rlvr alias (the lm_head is not loaded).

    With `lora` the backbone is frozen and gets adapters (peft); the head is always trainable.
    """
    path = resolve_model_path(model_path)
    backbone: Any = load_model_weights(AutoModel, path, device=device, dtype=dtype)
    if gradient_checkpointing:
        backbone.activation_checkpointing_enable()
        backbone.config.use_cache = False
        if lora is not None:  # frozen embeddings: checkpointed blocks need an input that wants grad
            backbone.enable_input_require_grads()
    if lora is not None:
        backbone = add_lora(backbone, lora, "FEATURE_EXTRACTION")
    return ValueModel(backbone, int(backbone.config.hidden_size), base_path=model_path, lora=lora)


def load_critic(directory: str | Path, device: torch.device | str = "auto") -> ValueModel:
    """Rebuild a critic from its critic.json (on `device`) and load its saved parameters."""
    meta = json.loads((Path(directory) / CONFIG_FILE).read_text())
    lora = LoraSettings(**meta["lora"]) if meta["lora"] is not None else None
    critic = build_critic(meta["base"], lora, getattr(torch, meta["dtype"]), device=device)
    critic.load_into(directory)
    return critic


# ------------------------------------------------------------------------------------------ update
def critic_update(
    critic: ValueModel,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[TrainBatch],
    returns: Sequence[torch.Tensor],
    old_values: Sequence[torch.Tensor],
    *,
    clip_range: float | None,
    aggregation: str,
    total_tokens: float,
    max_grad_norm: float,
    total_sequences: float | None = None,
    norm_length: float | None = None,
    bf16: bool = False,
) -> dict[str, float]:
    """One optimizer step on the clipped value loss (rlvr.algorithms.gae.value_loss) over micro-batches.

    `returns[i]` / `old_values[i]` are (B, C) for `batches[i]` (GAE targets and the critic's values at
    rollout time). Gradients accumulate with the normalisers of the whole batch (`total_tokens`;
    `total_sequences` defaults to the rows of all micro-batches, `norm_length` to the widest one), so
    the step equals one full-batch step. Metrics are over policy tokens, from the values of this
    pass (before the step); a non-finite gradient skips the step and is counted.
    """
    if not batches:
        raise ValueError("critic_update needs at least one micro-batch")
    n_rows = float(sum(b.mask_B_C.shape[0] for b in batches))
    norms = {
        "total_tokens": total_tokens,
        "total_sequences": total_sequences if total_sequences is not None else n_rows,
        "norm_length": norm_length
        if norm_length is not None
        else float(max(b.completion_width for b in batches)),
    }
    critic.train()
    optimizer.zero_grad(set_to_none=True)
    loss_sum = clipped_sum = count = 0.0
    flat_values, flat_returns = [], []
    for b, returns_B_C, old_B_C in zip(batches, returns, old_values, strict=True):
        with autocast_context(bf16):
            values_B_C = critic.values(b)
        values_B_C = values_B_C.float()
        loss_B_C, clipped_B_C = value_loss(values_B_C, old_B_C, returns_B_C, b.mask_B_C, clip_range)
        loss = aggregate(loss_B_C, b.mask_B_C, aggregation, **norms)
        loss.backward()
        on = b.mask_B_C != 0
        loss_sum += float(loss.detach())
        clipped_sum += float(clipped_B_C.sum())
        count += float(on.sum())
        flat_values.append(values_B_C.detach()[on])
        flat_returns.append(returns_B_C.float()[on])
    params = critic.trainable_parameters()
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    skipped = not math.isfinite(grad_norm)
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()

    values_N, returns_N = torch.cat(flat_values), torch.cat(flat_returns)
    var_returns = float(returns_N.var(unbiased=False)) if count else float("nan")
    residual_var = float((returns_N - values_N).var(unbiased=False)) if count else float("nan")
    return {
        "critic/value_loss": loss_sum,
        "critic/vf_clipfrac": clipped_sum / count if count else float("nan"),
        "critic/values_mean": float(values_N.mean()) if count else float("nan"),
        "critic/returns_mean": float(returns_N.mean()) if count else float("nan"),
        "critic/grad_norm": grad_norm,
        "critic/explained_variance": 1.0 - residual_var / var_returns
        if var_returns > 0
        else float("nan"),
        "critic/skipped_nonfinite": float(skipped),
    }
