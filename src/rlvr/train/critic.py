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
from rlvr.scale.torch_dist import DistContext, norm_value
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

    def full_trainable_state(self) -> dict[str, torch.Tensor]:
        """The trainable parameters, whole and on the host. Under fsdp the parameters are shards
        (DTensors) and this gathers them: a collective, every rank calls it."""
        from torch.distributed.tensor import DTensor

        return {
            n: (t.full_tensor() if isinstance(t, DTensor) else t).contiguous().cpu()
            for n, t in self._trainable_state().items()
        }

    def save(self, directory: str | Path, state: dict[str, torch.Tensor] | None = None) -> Path:
        """Write the trainable parameters (adapters or whole backbone, and the head) + critic.json.
        `state`: the parameters to write when this critic's own are fsdp shards
        (`full_trainable_state`, gathered on every rank)."""
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        if state is None:
            state = self.full_trainable_state()
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
        """Copy saved trainable parameters into this critic (built the same way); exact. A sharded
        (fsdp) critic takes its own shard of each tensor."""
        from torch.distributed.tensor import DTensor, distribute_tensor

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
                target = mine[name]
                if isinstance(target, DTensor):
                    whole = tensor.to(target.device, target.dtype)
                    tensor = distribute_tensor(whole, target.device_mesh, target.placements)
                target.copy_(tensor)


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
    real: Sequence[bool] | None = None,
    dist: DistContext | None = None,
) -> dict[str, float]:
    """One optimizer step on the clipped value loss (rlvr.algorithms.gae.value_loss) over micro-batches.

    `returns[i]` / `old_values[i]` are (B, C) for `batches[i]` (GAE targets and the critic's values at
    rollout time). Gradients accumulate with the normalisers of the whole batch (`total_tokens`;
    `total_sequences` defaults to the rows of all micro-batches, `norm_length` to the widest one), so
    the step equals one full-batch step. Metrics are over policy tokens, from the values of this
    pass (before the step); a non-finite gradient skips the step and is counted.

    `dist` (torchrun): `batches` are this rank's shard of the rows (rlvr.train.micro_batching.RankPlan)
    and the normalisers count the whole batch; the gradients are summed over ranks (ddp: one
    all-reduce; fsdp: its reduce-scatter), so every rank takes the one-process step, and the metrics
    are whole-batch ones. `real[i]` False marks fsdp's padding micro-batches: forwarded and
    backwarded with weight 0 to keep the ranks' collectives in step.
    """
    if not batches and dist is None:  # under torchrun a rank may have no rows, and still sums
        raise ValueError("critic_update needs at least one micro-batch")
    real = list(real) if real is not None else [True] * len(batches)
    n_rows = float(sum(b.mask_B_C.shape[0] for b, r in zip(batches, real, strict=True) if r))
    norms = {
        "total_tokens": total_tokens,
        "total_sequences": total_sequences if total_sequences is not None else n_rows,
        "norm_length": norm_length
        if norm_length is not None
        else float(max((b.completion_width for b in batches), default=1)),
    }
    critic.train()
    optimizer.zero_grad(set_to_none=True)
    # Whole-batch metrics from sums (over ranks under torchrun), in float64.
    sums = dict.fromkeys(("loss", "clipped", "count", "v", "r", "r2", "d", "d2"), 0.0)
    for b, returns_B_C, old_B_C, is_real in zip(batches, returns, old_values, real, strict=True):
        with autocast_context(bf16):
            values_B_C = critic(b)  # through forward: fsdp gathers the root's weights there
        values_B_C = values_B_C.float()
        if not is_real:
            (values_B_C.sum() * 0.0).backward()
            continue
        loss_B_C, clipped_B_C = value_loss(values_B_C, old_B_C, returns_B_C, b.mask_B_C, clip_range)
        loss = aggregate(loss_B_C, b.mask_B_C, aggregation, **norms)
        loss.backward()
        on = b.mask_B_C != 0
        v_N, r_N = values_B_C.detach()[on].double(), returns_B_C[on].double()
        sums["loss"] += float(loss.detach())
        sums["clipped"] += float(clipped_B_C.sum())
        sums["count"] += float(on.sum())
        sums["v"] += float(v_N.sum())
        sums["r"] += float(r_N.sum())
        sums["r2"] += float((r_N * r_N).sum())
        sums["d"] += float((r_N - v_N).sum())
        sums["d2"] += float(((r_N - v_N) ** 2).sum())
    params = critic.trainable_parameters()
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if dist is not None:
        if not dist.fsdp:  # fsdp has reduce-scattered them in the backward
            dist.sum_gradients(params, [])
        sums = dist.all_reduce_sums(sums)
    grad_norm = norm_value(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    skipped = not math.isfinite(grad_norm)
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()

    count = sums["count"]

    def variance(total: float, squares: float) -> float:
        return max(squares / count - (total / count) ** 2, 0.0)

    var_returns = variance(sums["r"], sums["r2"]) if count else float("nan")
    residual_var = variance(sums["d"], sums["d2"]) if count else float("nan")
    return {
        "critic/value_loss": sums["loss"],
        "critic/vf_clipfrac": sums["clipped"] / count if count else float("nan"),
        "critic/values_mean": sums["v"] / count if count else float("nan"),
        "critic/returns_mean": sums["r"] / count if count else float("nan"),
        "critic/grad_norm": grad_norm,
        "critic/explained_variance": 1.0 - residual_var / var_returns
        if var_returns > 0
        else float("nan"),
        "critic/skipped_nonfinite": float(skipped),
    }
