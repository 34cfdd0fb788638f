"""From trajectories to padded tensors, and the trainer-side forward pass that yields token log-probs.

A micro-batch keeps each distinct prompt once (P prompts, left-padded) and every trajectory's
completion region once (B rows, right-padded); `row_prompt_B` says which prompt a row continues.

    prompts      [pad pad p p p p]                  P x Lp
    completions                  [c c c c c pad]    B x C   (sampled tokens and, multi-turn, observations)

The forward pass runs the prompts once, repeats their KV cache for the rows that share them (the
repeat is differentiable, so gradients from all G samples flow back into the one prompt pass), then
runs the completions on top. With G = 8 samples of a 40-token prompt and 32-token completions this
halves the tokens pushed through the model. `share_prefix=False` gives the plain path (each row runs
its whole prompt + completion) that the shortcut is tested against. Either way the lm_head only runs
where a completion token is predicted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from transformers import DynamicCache

from rlvr.models import cache_kwarg
from rlvr.records import Trajectory
from rlvr.train.fused_logprobs import fusable_head, plain_head, token_logprobs_from_hidden
from rlvr.train.packing import PackedRows, pack_rows, packed_outputs, packing_is_exact


@dataclass(frozen=True)
class TrainBatch:
    """Padded tensors for a micro-batch of B trajectories over P distinct prompts; C = longest completion.

    prompt_ids_P_Lp / prompt_mask_P_Lp: left-padded prompts. row_prompt_B: prompt index of each row.
    completion_ids_B_C / completion_mask_B_C: right-padded completion regions (the targets).
    mask_B_C: 1 where the policy sampled the token, the only positions that get gradient.
    behaviour_logprobs_B_C: the generator's log-probs; advantages_B_C: per-token advantages.
    packed: the same rows laid end to end without padding (`collate(pack=True)`,
    rlvr.train.packing), for the padding-free forward; None when not asked for.
    """

    prompt_ids_P_Lp: torch.Tensor
    prompt_mask_P_Lp: torch.Tensor
    row_prompt_B: torch.Tensor
    completion_ids_B_C: torch.Tensor
    completion_mask_B_C: torch.Tensor
    mask_B_C: torch.Tensor
    behaviour_logprobs_B_C: torch.Tensor
    advantages_B_C: torch.Tensor
    packed: PackedRows | None = None

    @property
    def completion_width(self) -> int:
        return int(self.completion_ids_B_C.shape[1])

    def to(self, device: torch.device) -> TrainBatch:
        """The batch on `device` (a no-op when `collate` was given it: the usual case)."""
        if self.completion_ids_B_C.device == device:
            return self
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=True)
            for f in fields(TrainBatch)
            if f.name != "packed"
        }
        if self.packed is not None:
            moved["packed"] = PackedRows(
                *(
                    getattr(self.packed, f.name).to(device, non_blocking=True)
                    for f in fields(PackedRows)
                )
            )
        return replace(self, **moved)


def collate(
    trajectories: Sequence[Trajectory],
    token_advantages: Sequence[Sequence[float]],
    pad_token_id: int,
    device: torch.device | str | None = None,
    *,
    pack: bool = False,
) -> TrainBatch:
    """Pad trajectories into the layout above. `token_advantages[i]` has one value per completion
    token. Rows are padded as Python lists and each tensor is made once, on `device` (the model's:
    one host-to-device copy per tensor, none per row; None: the host). `pack` also lays the rows
    out end to end for the padding-free forward (`TrainBatch.packed`)."""
    prompts: dict[tuple[int, ...], int] = {}
    row_prompt = []
    for traj in trajectories:
        if traj.windowed:  # its later turns were sampled from shorter prompts than this row's
            raise ValueError(
                f"trajectory {traj.task_id} was sampled with a history window: train on its "
                "turn samples (Trajectory.turn_samples, rlvr.train.selection.training_group)"
            )
        key = traj.token_ids[: traj.prompt_length]
        row_prompt.append(prompts.setdefault(key, len(prompts)))
    prompt_cols = max(len(p) for p in prompts)
    prompt_ids = [[pad_token_id] * (prompt_cols - len(k)) + list(k) for k in prompts]
    prompt_mask = [[0] * (prompt_cols - len(k)) + [1] * len(k) for k in prompts]

    width = max(len(t.token_ids) - t.prompt_length for t in trajectories)
    completion_ids, completion_mask, mask, behaviour, advantages = [], [], [], [], []
    for traj, adv in zip(trajectories, token_advantages, strict=True):
        n_p = traj.prompt_length
        pad = width - (len(traj.token_ids) - n_p)
        completion_ids.append(list(traj.token_ids[n_p:]) + [pad_token_id] * pad)
        completion_mask.append([1] * (width - pad) + [0] * pad)
        mask.append([float(m) for m in traj.policy_mask[n_p:]] + [0.0] * pad)
        behaviour.append(list(traj.logprobs[n_p:]) + [0.0] * pad)
        advantages.append(list(adv) + [0.0] * pad)

    def longs(rows: list[Any]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=device)

    def floats(rows: list[list[float]]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.float32, device=device)

    mask_B_C = floats(mask)
    packed = None
    if pack:
        packed = pack_rows(
            [list(t.token_ids[: t.prompt_length]) for t in trajectories],
            [list(t.token_ids[t.prompt_length :]) for t in trajectories],
            width,
            torch.device("cpu") if device is None else torch.device(device),
        )
    return TrainBatch(
        longs(prompt_ids),
        longs(prompt_mask),
        longs(row_prompt),
        longs(completion_ids),
        longs(completion_mask),
        mask_B_C,
        floats(behaviour),
        # Selected, not multiplied: a non-finite advantage outside the mask must not survive as nan.
        torch.where(mask_B_C != 0, floats(advantages), 0.0),
        packed,
    )


def autocast_context(
    enabled: bool, device_type: str = "cpu"
) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on `device_type` ("cpu", or "cuda" under torchrun on GPUs) when `enabled`."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16)


def disable_dropout(model: Any) -> None:
    """Set every dropout probability of `model` to 0: nn.Dropout modules (LoRA's included) and the
    `attention_dropout` rate Llama-style attention reads from an attribute. The RL update optimises
    the policy that sampled, and the generator samples without dropout (eval mode); the update runs
    in train mode (gradient checkpointing only works there), so its dropout must be off by hand, or
    pi_theta would be another, random policy and the first ratio pi_theta / pi_old would not be 1."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def token_logprobs(
    model: Any,
    batch: TrainBatch,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    bf16: bool = False,
    share_prefix: bool = True,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, C) of the completion tokens under `model`, and optionally entropies (B, C).

    Logits are divided by the sampling temperature (as the generator did) and the softmax is taken in
    fp32 whatever the matmul dtype. The entropy is detached (a metric) unless `entropy_grad` asks for
    its gradient (an entropy bonus). `fused` goes from hidden states to per-token values a chunk at
    a time without the (B, C, V) logits (rlvr.train.fused_logprobs; its matmuls in bf16 with `bf16`).
    """
    logprobs_B_C, entropy_B_C, _ = token_distributions(
        model,
        batch,
        temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        bf16=bf16,
        share_prefix=share_prefix,
        with_full=False,
        fused=fused,
    )
    return logprobs_B_C, entropy_B_C


def token_distributions(
    model: Any,
    batch: TrainBatch,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    bf16: bool = False,
    share_prefix: bool = True,
    with_full: bool = True,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`token_logprobs` plus, when `with_full`, the whole next-token log-distribution (B, C, V) at each
    completion position (distillation compares it with a teacher's; that needs the plain path).

    The path: the shared-prompt one when `share_prefix` and it can run (`takes_shared_path`); else
    the padding-free one when the batch was collated with `pack` and the model keeps packed rows
    apart (rlvr.train.packing); else each row padded."""
    shared = takes_shared_path(model, share_prefix)
    packed = batch.packed if not shared and batch.packed is not None else None
    if packed is not None and not packing_is_exact(model):
        packed = None
    head_V_H = fusable_head(model) if fused and not with_full else None
    with autocast_context(bf16, batch.completion_ids_B_C.device.type):
        if shared:
            pieces = _shared_prefix_outputs(model, batch, hidden=head_V_H is not None)
        elif packed is not None:
            pieces = [packed_outputs(model, packed, hidden=head_V_H is not None)]
        else:
            pieces = [_plain_outputs(model, batch, hidden=head_V_H is not None)]
    targets_B_C = batch.completion_ids_B_C
    logprobs, entropies, fulls = [], [], []
    start = 0
    while pieces:
        piece = pieces.pop(0)  # dropped from the list, so it can be freed as soon as it is used
        width = piece.shape[1]
        target_B_c = targets_B_C[:, start : start + width]
        start += width
        if head_V_H is not None:
            logp_B_c, entropy_B_c = token_logprobs_from_hidden(
                piece, head_V_H, target_B_c, temperature, bf16=bf16
            )
            logprobs.append(logp_B_c)
            if with_entropy:
                grad = entropy_grad and torch.is_grad_enabled()
                entropies.append(entropy_B_c if grad else entropy_B_c.detach())
            continue
        # The logits are the largest tensors of the step (B x C x 49k floats for SmolLM2): each piece
        # is turned into per-token values at once and never concatenated; the temperature divides in
        # place (the lm_head's backward does not need its output).
        logits_B_c_V = piece.float()
        del piece
        if temperature != 1.0:
            logits_B_c_V = logits_B_c_V.div_(temperature)
        logprobs_B_c_V = torch.log_softmax(logits_B_c_V, dim=-1)
        del logits_B_c_V
        logprobs.append(logprobs_B_c_V.gather(2, target_B_c[:, :, None]).squeeze(2))
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropies.append(_entropy(logprobs_B_c_V))
        if with_full:
            fulls.append(logprobs_B_c_V)
    logprobs_B_C = torch.cat(logprobs, dim=1)
    entropy_B_C = torch.cat(entropies, dim=1) if with_entropy else None
    full_B_C_V = None
    if with_full:
        full_B_C_V = fulls[0] if len(fulls) == 1 else torch.cat(fulls, dim=1)
    return logprobs_B_C, entropy_B_C, full_B_C_V


def takes_shared_path(model: Any, share_prefix: bool) -> bool:
    """Whether a forward of `model` runs each prompt once (`share_prefix`). Gradient checkpointing
    makes HF drop the KV cache in training mode, so the shared prefix cannot be carried to the
    completions: the rows then run whole (padded, or packed)."""
    return share_prefix and not (model.training and _activation_checkpointing(model))


def _entropy(logprobs_B_c_V: torch.Tensor, rows_per_chunk: int = 4) -> torch.Tensor:
    """-sum p log p over the vocabulary, (B, c). As a metric (no gradient) it runs a few rows at a time,
    so p and p log p never exist for the whole micro-batch at once."""
    if torch.is_grad_enabled() and logprobs_B_c_V.requires_grad:
        return -(logprobs_B_c_V.exp() * logprobs_B_c_V).sum(dim=-1)
    return torch.cat(
        [
            -(chunk.exp() * chunk).sum(dim=-1)
            for chunk in logprobs_B_c_V.detach().split(rows_per_chunk, dim=0)
        ],
        dim=0,
    )


def _run(model: Any, hidden: bool, keep: int, **inputs: Any) -> torch.Tensor:
    """The model's last `keep` positions: logits (.., V), or with `hidden` the decoder's final hidden
    states (.., H) for the fused head (the lm_head is then not run here)."""
    if hidden:
        states = model.get_decoder()(**inputs).last_hidden_state
        return states[:, states.shape[1] - keep :, :]
    logits: torch.Tensor = model(**inputs, logits_to_keep=keep).logits
    return logits


def _plain_outputs(model: Any, batch: TrainBatch, hidden: bool) -> torch.Tensor:
    """Each row runs its own prompt + completion: the reference path. Returns (B, C, V) logits, or
    (B, C, H) hidden states, at the positions that predict the C completion tokens."""
    prompt_ids = batch.prompt_ids_P_Lp.index_select(0, batch.row_prompt_B)
    prompt_mask = batch.prompt_mask_P_Lp.index_select(0, batch.row_prompt_B)
    input_ids = torch.cat([prompt_ids, batch.completion_ids_B_C], dim=1)
    attention = torch.cat([prompt_mask, batch.completion_mask_B_C], dim=1)
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
    out = _run(
        model,
        hidden,
        batch.completion_width + 1,
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=positions,
        use_cache=False,
    )
    # Position j predicts token j+1: the last C+1 positions minus the final one score the C tokens.
    return out[:, :-1, :]


def _shared_prefix_outputs(model: Any, batch: TrainBatch, hidden: bool) -> list[torch.Tensor]:
    """Prompts once, their KV cache gathered per row, completions on top. Returns what scores the C
    completion tokens: hidden states, or logits, as one (B, C, .) piece; logits from a head that is
    not a plain linear layer (`plain_head`: the model runs its own) come in two pieces [(B, 1, .)
    from the prompt's last position, (B, C-1, .)]."""
    # One lm_head call over all C positions rather than one for the prompt's last position and one
    # for the rest: the prompt's call has one position per prompt, yet its weight gradient is a full
    # (V, H) outer product (28M numbers for SmolLM2), cast and accumulated on its own (~0.25 s of a
    # profiled bf16 update; unprofiled, the gain is within run-to-run noise: docs/performance.md).
    head = None if hidden else plain_head(model)
    states = hidden or head is not None  # the decoder's hidden states from both passes
    cache = DynamicCache()
    prompt_positions = (batch.prompt_mask_P_Lp.cumsum(dim=1) - 1).clamp(min=0)
    out_p = _run(
        model,
        states,
        1,
        input_ids=batch.prompt_ids_P_Lp,
        attention_mask=batch.prompt_mask_P_Lp,
        position_ids=prompt_positions,
        **{cache_kwarg(model): cache},
        use_cache=True,
    )
    if cache.get_seq_length() != batch.prompt_ids_P_Lp.shape[1]:
        # A model that ignored the cache would silently score completions without their prompt.
        raise RuntimeError(
            "the model did not fill its KV cache; use train.share_prompt_prefix=false"
        )
    # The gather is an index op, so gradients of every row flow back into the shared prompt pass.
    cache.batch_select_indices(batch.row_prompt_B)
    first_B_1 = out_p.index_select(0, batch.row_prompt_B)
    if batch.completion_width == 1:
        return [head(first_B_1) if head is not None else first_B_1]
    prompt_mask_B_Lp = batch.prompt_mask_P_Lp.index_select(0, batch.row_prompt_B)
    # The last completion token predicts nothing that is scored: it is not fed.
    width = batch.completion_width - 1
    attention = torch.cat([prompt_mask_B_Lp, batch.completion_mask_B_C[:, :width]], dim=1)
    positions = (
        prompt_mask_B_Lp.sum(dim=1, keepdim=True)
        + torch.arange(width, device=prompt_mask_B_Lp.device)[None, :]
    )
    out_c = _run(
        model,
        states,
        width,
        input_ids=batch.completion_ids_B_C[:, :width],
        attention_mask=attention,
        position_ids=positions,
        **{cache_kwarg(model): cache},
        use_cache=True,
    )
    if not states:
        return [first_B_1, out_c]
    states_B_C_H = torch.cat([first_B_1, out_c], dim=1)
    return [head(states_B_C_H) if head is not None else states_B_C_H]


def _activation_checkpointing(model: Any) -> bool:
    # transformers renamed is_gradient_checkpointing to is_activation_checkpointing (5.x); ask the new
    # name first so the old one's deprecation warning is not triggered.
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        value = getattr(model, name, None)
        if value is not None:
            return bool(value)
    return False
