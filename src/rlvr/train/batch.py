"""From trajectories to padded tensors, and the trainer-side forward pass that yields token log-probs.

Layout of a (micro-)batch, chosen so logits are computed only where they are needed:

    [pad pad p p p p | c c c c c pad pad]     L = max_prompt + max_completion
     left-padded prompt  right-padded completion (sampled tokens and, multi-turn, observations)

Every row's completion starts at the same column, so the model is asked for the logits of the last
C + 1 positions only (`logits_to_keep`): the lm_head never runs over prompt tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlvr.records import Trajectory


@dataclass(frozen=True)
class TrainBatch:
    """Padded tensors for a micro-batch of B trajectories; C = longest completion.

    input_ids_B_L / attention_mask_B_L / position_ids_B_L: model inputs (L = prompt cols + C).
    targets_B_C: the completion tokens; mask_B_C: 1 where the policy sampled the token (the only
    positions that get gradient); behaviour_logprobs_B_C: generator log-probs; advantages_B_C.
    """

    input_ids_B_L: torch.Tensor
    attention_mask_B_L: torch.Tensor
    position_ids_B_L: torch.Tensor
    targets_B_C: torch.Tensor
    mask_B_C: torch.Tensor
    behaviour_logprobs_B_C: torch.Tensor
    advantages_B_C: torch.Tensor

    @property
    def completion_width(self) -> int:
        return int(self.targets_B_C.shape[1])


def collate(
    trajectories: Sequence[Trajectory], token_advantages: Sequence[Sequence[float]], pad_token_id: int
) -> TrainBatch:
    """Pad trajectories into the layout above. `token_advantages[i]` has one value per completion token."""
    prompt_cols = max(t.prompt_length for t in trajectories)
    width = max(len(t.token_ids) - t.prompt_length for t in trajectories)
    batch = len(trajectories)
    input_ids = torch.full((batch, prompt_cols + width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((batch, prompt_cols + width), dtype=torch.long)
    targets = torch.full((batch, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.float32)
    behaviour = torch.zeros((batch, width), dtype=torch.float32)
    advantages = torch.zeros((batch, width), dtype=torch.float32)
    for i, (traj, adv) in enumerate(zip(trajectories, token_advantages, strict=True)):
        n_p = traj.prompt_length
        n_c = len(traj.token_ids) - n_p
        ids = torch.tensor(traj.token_ids, dtype=torch.long)
        input_ids[i, prompt_cols - n_p : prompt_cols + n_c] = ids
        attention[i, prompt_cols - n_p : prompt_cols + n_c] = 1
        targets[i, :n_c] = ids[n_p:]
        mask[i, :n_c] = torch.tensor(traj.policy_mask[n_p:], dtype=torch.float32)
        behaviour[i, :n_c] = torch.tensor(traj.logprobs[n_p:], dtype=torch.float32)
        advantages[i, :n_c] = torch.tensor(list(adv), dtype=torch.float32)
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
    return TrainBatch(input_ids, attention, positions, targets, mask, behaviour, advantages * mask)


def autocast_context(enabled: bool) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast("cpu", dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def token_logprobs(
    model: Any,
    batch: TrainBatch,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    bf16: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, C) of the completion tokens under `model`, and optionally entropies (B, C).

    Logits are divided by the sampling temperature (as the generator did) and the softmax is taken in
    fp32 whatever the matmul dtype. The entropy is detached (a metric) unless `entropy_grad` asks for
    its gradient (an entropy bonus).
    """
    width = batch.completion_width
    with autocast_context(bf16):
        out = model(
            input_ids=batch.input_ids_B_L,
            attention_mask=batch.attention_mask_B_L,
            position_ids=batch.position_ids_B_L,
            use_cache=False,
            logits_to_keep=width + 1,
        )
    # Position j predicts token j+1: the last C+1 logits minus the final one score the C completion tokens.
    logits_B_C_V = out.logits[:, :-1, :].float() / temperature
    logprobs_B_C_V = torch.log_softmax(logits_B_C_V, dim=-1)
    logprobs_B_C = logprobs_B_C_V.gather(2, batch.targets_B_C[:, :, None]).squeeze(2)
    entropy_B_C = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy_B_C = -(logprobs_B_C_V.exp() * logprobs_B_C_V).sum(dim=-1)
    return logprobs_B_C, entropy_B_C
