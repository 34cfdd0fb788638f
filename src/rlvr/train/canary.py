"""The weight-sync canary, scored: the trainer's side of `sync/canary_logprob_abs_diff`.

After each weight sync to a server, rlvr.train.rollouts asks the server to sample a fixed short
prompt (rlvr.observe.mismatch: `CANARY_TEXT`, `CANARY_SEED`) and scores the returned tokens with the
update's own forward (`token_logprobs`). The gap is a metric; the `sampler_mismatch` monitor in
rlvr.observe.mismatch reads it and chooses the threshold. The scoring lives here, with the trainer,
because it needs the trainer's forward; the monitor only reads numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlvr.devices import device_of
from rlvr.observe.mismatch import CANARY_SAMPLES, CANARY_TEXT, CANARY_TOKENS
from rlvr.records import Trajectory
from rlvr.train.batch import collate, token_logprobs


def canary_prompt(tokenizer: Any) -> list[int]:
    """The canary's prompt ids (special tokens as the tokenizer adds them, e.g. a BOS)."""
    return [int(t) for t in tokenizer(CANARY_TEXT)["input_ids"]][:32]


def sample_canary(generator: Any, tokenizer: Any) -> list[Any]:
    """The server's samples of the canary prompt (fixed seed, temperature 1)."""
    return list(
        generator.canary(canary_prompt(tokenizer), n=CANARY_SAMPLES, max_tokens=CANARY_TOKENS)
    )


@torch.no_grad()
def canary_gap(
    generator: Any, policy: Any, *, bf16: bool, completions: Sequence[Any] | None = None
) -> float:
    """Mean |server - trainer| log-prob over the canary's sampled tokens. `generator` is a
    ServerGenerator (its `canary` samples the prompt at temperature 1 with a fixed seed); the trainer
    scores the same tokens with the update's forward (bf16 autocast as the update uses it).
    `completions`: the canary's samples already drawn (`sample_canary`; under torchrun rank 0 draws
    them and every rank scores them, since an fsdp forward is a collective)."""
    prompt = canary_prompt(policy.tokenizer)
    if completions is None:
        completions = sample_canary(generator, policy.tokenizer)
    rows = [
        Trajectory(
            task_id="canary",
            token_ids=(*prompt, *c.token_ids),
            policy_mask=(0,) * len(prompt) + (1,) * len(c.token_ids),
            logprobs=(0.0,) * len(prompt) + tuple(c.logprobs),
            prompt_length=len(prompt),
            completion_text="",
            finish_reason=c.finish_reason,
        )
        for c in completions
        if c.token_ids
    ]
    if not rows:
        return float("nan")
    model = policy.model
    batch = collate(rows, _zeros(rows), int(policy.tokenizer.pad_token_id), device_of(model))
    training = model.training
    model.eval()
    try:
        trainer, _ = token_logprobs(model, batch, 1.0, bf16=bf16)
    finally:
        model.train(training)
    mask = batch.mask_B_C
    return float(((trainer - batch.behaviour_logprobs_B_C).abs() * mask).sum() / mask.sum())


def _zeros(rows: Sequence[Any]) -> list[list[float]]:
    return [[0.0] * (len(t.token_ids) - t.prompt_length) for t in rows]
