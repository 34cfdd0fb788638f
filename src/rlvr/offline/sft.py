"""Supervised fine-tuning on chat data: next-token NLL on the assistant tokens.

    L = -sum_{trained tokens t} log pi(y_t | y_<t) / N

N counts the trained tokens of the whole optimizer step (not of each micro-batch, not of each
example), so every assistant token weighs the same whatever the batching or packing; this is the
token-mean TRL and open-instruct use. Packing puts several examples into one row with positions
restarting per example and a block-diagonal causal mask, so a packed row computes exactly what the
examples would alone.
"""

from __future__ import annotations

from typing import Any

import torch

from rlvr.algorithms.preference import sft_loss, target_logprobs
from rlvr.build import use_bf16
from rlvr.models import load_policy
from rlvr.offline.common import (
    StageResult,
    attn_implementation,
    begin_stage,
    chunks,
    forward_logits,
    lora_settings,
    run_stage,
)
from rlvr.offline.config import SFTConfig
from rlvr.offline.data import Example, collate, pack_examples, sft_examples, train_and_heldout


def train_sft(cfg: SFTConfig, *, rows: Any = None, resume: bool = False) -> StageResult:
    """Fine-tune `cfg.model` on chat rows (`rows` in memory, else `cfg.data.path`).

    With `resume`, a finished stage (DONE.json) returns its stored result and an unfinished one
    continues from its latest checkpoint (from scratch when there is none).
    """
    done = begin_stage(cfg, resume)
    if done is not None:
        return done
    policy = load_policy(
        cfg.model.name,
        lora=lora_settings(cfg),
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        device=cfg.model.device,
        attn_implementation=cfg.model.attn_implementation,
    )
    model, tokenizer = policy.model, policy.tokenizer
    train = cfg.train

    def tokenize(source_rows: list[dict[str, Any]], source: str) -> list[Example]:
        return sft_examples(
            tokenizer,
            source_rows,
            source=source,
            max_length=train.max_length,
            truncate=train.truncate,
            assistant_only=cfg.assistant_only_loss,
        )

    examples, heldout = train_and_heldout(cfg.data, rows, train.seed, tokenize)
    items = pack_examples(examples, train.max_length) if cfg.packing else [[e] for e in examples]
    bf16 = use_bf16(cfg.model)
    attn = attn_implementation(model)
    pad_id = int(tokenizer.pad_token_id)

    def token_sums(rows_: list[list[Example]], num_tokens: float, backward: bool) -> list[float]:
        """[loss, correct tokens] over `rows_` in micro-batches; loss divided by num_tokens."""
        loss_sum, correct = 0.0, 0.0
        for chunk in chunks(list(range(len(rows_))), train.micro_batch_size):
            batch = collate([rows_[i] for i in chunk], pad_id, attn)
            logits_B_T_V = forward_logits(model, batch, bf16)
            logprobs_B_T = target_logprobs(logits_B_T_V, batch.targets_B_T)
            loss = sft_loss(logprobs_B_T, batch.loss_mask_B_T, num_tokens)
            if backward:
                loss.backward()
            loss_sum += float(loss.detach())
            with torch.no_grad():
                hits_B_T = logits_B_T_V.argmax(dim=-1) == batch.targets_B_T
                correct += float((hits_B_T * batch.loss_mask_B_T).sum())
        return [loss_sum, correct]

    def train_step(indices: list[int]) -> dict[str, float]:
        step_rows = [items[i] for i in indices]
        num_tokens = float(sum(sum(e.loss_mask) for row in step_rows for e in row))
        loss, correct = token_sums(step_rows, num_tokens, backward=True)
        return {
            "loss": loss,
            "mean_token_accuracy": correct / num_tokens,
            "num_loss_tokens": num_tokens,
        }

    def evaluate() -> dict[str, float]:
        rows_ = [[e] for e in heldout]
        num_tokens = float(sum(sum(e.loss_mask) for e in heldout))
        loss, correct = token_sums(rows_, num_tokens, backward=False)
        return {"eval/loss": loss, "eval/mean_token_accuracy": correct / num_tokens}

    return run_stage(
        cfg,
        model=model,
        tokenizer=tokenizer,
        lora=policy.lora,
        num_items=len(items),
        train_step=train_step,
        evaluate=evaluate if heldout else None,
        resume=resume,
    )
