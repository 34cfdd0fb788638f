"""Direct preference optimisation on (prompt, chosen, rejected) pairs (Rafailov et al. 2023).

    L = -log sigmoid(beta * [(log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))])

and the IPO / SLiC-HF variants (`loss_type`, see rlvr.algorithms.preference.dpo_loss). How this departs
from a textbook reading, and why:
- The reference is the initial model, and it never changes, so its log-probs are computed once for
  every pair before training and cached in OUTPUT_DIR/reference_logps.pt (a resumed run reads them
  back). With LoRA they come from the base with adapters disabled; with full fine-tuning from the
  model before its first update, so no frozen copy is ever held in memory. The cache is keyed on the
  pairs' tokens, the model (its name, config and a sample of its base weights), whether log-probs
  are summed (sigmoid, hinge) or averaged (ipo) and bf16: a change to any of them recomputes.
- Dropout is switched off (as TRL's disable_dropout; LoRA dropout too): with dropout, pi and pi_ref
  differ at step 0 and the implicit rewards start from noise.
- A completion's log-prob is the sum over its tokens; for IPO the per-token mean, as in the paper.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any

import torch

from rlvr.algorithms.preference import dpo_loss, sequence_logps
from rlvr.build import use_bf16
from rlvr.devices import device_of
from rlvr.models import load_policy
from rlvr.offline.common import (
    StageResult,
    begin_stage,
    chunks,
    disable_dropout,
    forward_logprobs,
    lora_settings,
    run_stage,
)
from rlvr.offline.config import DPOConfig
from rlvr.offline.data import PairExample, collate_pairs, pair_examples, train_and_heldout
from rlvr.train.checkpoint import load_data

REFERENCE_FILE = "reference_logps.pt"


def _fingerprint(pairs: list[PairExample]) -> str:
    digest = hashlib.sha256()
    for pair in pairs:
        for side in (pair.chosen, pair.rejected):
            digest.update(repr((side.input_ids, side.loss_mask)).encode())
    return digest.hexdigest()


def model_fingerprint(model: Any) -> str:
    """A hash of the reference model: its config and a strided sample of every base weight (LoRA
    adapters left out: the reference runs with them disabled). Two checkpoints of one architecture
    differ in their weights, so the name alone would not do; a sample keeps this to milliseconds."""
    digest = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        digest.update(config.to_json_string(use_diff=False).encode())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                continue
            flat = param.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 1024)].float().cpu()
            digest.update(f"{name}{tuple(param.shape)}".encode())
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def pair_logps(
    model: Any, pairs: list[PairExample], pad_id: int, micro: int, bf16: bool, average: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen_logps_B, rejected_logps_B) of `pairs` under `model`, without gradient."""
    chosen, rejected = [], []
    with torch.no_grad():
        for chunk in chunks(list(range(len(pairs))), micro):
            batch = collate_pairs([pairs[i] for i in chunk], pad_id)
            logps_2B = sequence_logps(
                forward_logprobs(model, batch, bf16), batch.loss_mask_B_T, average
            )
            chosen.append(logps_2B[: len(chunk)])
            rejected.append(logps_2B[len(chunk) :])
    if not chosen:
        empty = torch.zeros(0, device=device_of(model))
        return empty, empty.clone()
    return torch.cat(chosen), torch.cat(rejected)


def reference_logps(
    path: Path, policy: Any, splits: dict[str, list[PairExample]], *, model_name: str, **kw: Any
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Reference (chosen, rejected) log-probs per split, from the cache file when it was computed
    for these pairs, this model and this averaging (see the module docstring); else computed."""
    data = _fingerprint([p for pairs in splits.values() for p in pairs])
    model = model_fingerprint(policy.model)
    fingerprint = (
        f"data={data} model={model_name}:{model} average={kw['average']} bf16={kw['bf16']}"
    )
    if path.is_file():
        # Plain data only (tensors, strings): a run file is never unpickled as code.
        stored = load_data(path)
        if isinstance(stored, dict) and stored.get("fingerprint") == fingerprint:
            return {name: (pair[0], pair[1]) for name, pair in stored["logps"].items()}
    policy.model.eval()
    with policy.reference() if policy.lora else contextlib.nullcontext(policy.model) as reference:
        logps = {name: pair_logps(reference, pairs, **kw) for name, pairs in splits.items()}
    torch.save({"fingerprint": fingerprint, "logps": logps}, path)
    return logps


def train_dpo(cfg: DPOConfig, *, rows: Any = None, resume: bool = False) -> StageResult:
    """Train `cfg.model` with DPO on preference pairs (`rows` in memory, else `cfg.data.path`).

    `resume` as in `train_sft`: a finished stage returns its stored result; an unfinished one
    continues from its latest checkpoint.
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
    disable_dropout(model)
    train = cfg.train

    def tokenize(source_rows: list[dict[str, Any]], source: str) -> list[PairExample]:
        return pair_examples(
            tokenizer,
            source_rows,
            source=source,
            max_length=train.max_length,
            truncate=train.truncate,
        )

    pairs, heldout = train_and_heldout(cfg.data, rows, train.seed, tokenize)
    bf16 = use_bf16(cfg.model)
    pad_id = int(tokenizer.pad_token_id)
    average = cfg.loss_type == "ipo"
    splits = {"train": pairs, "heldout": heldout}
    ref = reference_logps(
        Path(cfg.output_dir) / REFERENCE_FILE,
        policy,
        splits,
        model_name=cfg.model.name,
        pad_id=pad_id,
        micro=train.micro_batch_size,
        bf16=bf16,
        average=average,
    )

    def pair_metrics(name: str, indices: list[int], backward: bool) -> dict[str, float]:
        split = splits[name]
        ref_chosen_B, ref_rejected_B = ref[name]
        sums = dict.fromkeys(_METRICS, 0.0)
        for chunk in chunks(indices, train.micro_batch_size):
            batch = collate_pairs([split[i] for i in chunk], pad_id)
            logps_2B = sequence_logps(
                forward_logprobs(model, batch, bf16), batch.loss_mask_B_T, average
            )
            chosen_B, rejected_B = logps_2B[: len(chunk)], logps_2B[len(chunk) :]
            index = torch.tensor(chunk, device=ref_chosen_B.device)
            loss, chosen_rewards_B, rejected_rewards_B = dpo_loss(
                chosen_B,
                rejected_B,
                ref_chosen_B[index].to(chosen_B.device),
                ref_rejected_B[index].to(chosen_B.device),
                beta=cfg.beta,
                loss_type=cfg.loss_type,
                label_smoothing=cfg.label_smoothing,
            )
            share = len(chunk) / len(indices)  # the step's loss is the mean over all its pairs
            if backward:
                (loss * share).backward()
            sums["loss"] += float(loss.detach()) * share
            sums["rewards/chosen"] += float(chosen_rewards_B.sum())
            sums["rewards/rejected"] += float(rejected_rewards_B.sum())
            sums["rewards/margins"] += float((chosen_rewards_B - rejected_rewards_B).sum())
            sums["rewards/accuracies"] += float((chosen_rewards_B > rejected_rewards_B).sum())
            sums["logps/chosen"] += float(chosen_B.detach().sum())
            sums["logps/rejected"] += float(rejected_B.detach().sum())
        return {k: v if k == "loss" else v / len(indices) for k, v in sums.items()}

    def train_step(indices: list[int]) -> dict[str, float]:
        return pair_metrics("train", indices, backward=True)

    def evaluate() -> dict[str, float]:
        found = pair_metrics("heldout", list(range(len(heldout))), backward=False)
        return {f"eval/{k}": v for k, v in found.items()}

    return run_stage(
        cfg,
        model=model,
        tokenizer=tokenizer,
        lora=policy.lora,
        num_items=len(pairs),
        train_step=train_step,
        evaluate=evaluate if heldout else None,
        resume=resume,
    )


_METRICS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)
