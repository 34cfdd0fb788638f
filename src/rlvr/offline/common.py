"""What every offline stage shares: the output directory, the step loop, checkpoints and the final model.

OUTPUT_DIR layout:
- config.json                       the stage config as run
- metrics.jsonl                     one JSON line per optimizer step (held-out metrics on eval steps)
- checkpoints/step-000040/          model (or adapter), optimizer, scheduler, RNGs (rlvr.train.checkpoint)
- model/                            the final model as a plain HF directory plus tokenizer; LoRA
                                    adapters are merged, so the next stage loads an ordinary model
- DONE.json                         written last, with the final metrics: the stage is complete

Data order is a function of (seed, step) alone: the example stream is the concatenation of one seeded
permutation per epoch and step k takes items [(k-1)*batch, k*batch) of it. A resumed run therefore
sees exactly the batches the uninterrupted run would have, with nothing extra to checkpoint.
"""

from __future__ import annotations

import functools
import json
import math
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlvr.algorithms.preference import target_logprobs
from rlvr.devices import device_of
from rlvr.errors import ConfigError
from rlvr.models import LoraSettings
from rlvr.observe.progress import Progress
from rlvr.observe.tracking import Tracker, read_metrics
from rlvr.offline.config import OfflineTrainConfig, _StageConfig
from rlvr.offline.data import TokenBatch
from rlvr.optim import adamw
from rlvr.train.batch import autocast_context
from rlvr.train.checkpoint import (
    checkpoint_dirs,
    latest_checkpoint,
    load_training_state,
    load_weights_into,
    save_checkpoint,
)
from rlvr.train.run_dir import StopSignals

DONE_FILE = "DONE.json"
MODEL_DIR = "model"


@dataclass
class StageResult:
    """A finished stage: where it wrote, its final model, final metrics and per-step history."""

    output_dir: Path
    model_dir: Path
    metrics: dict[str, float]
    history: list[dict[str, Any]] = field(default_factory=list)


def finished_result(output_dir: Path) -> StageResult | None:
    """The stored result when OUTPUT_DIR holds a finished stage (DONE.json), else None."""
    done = output_dir / DONE_FILE
    if not done.is_file():
        return None
    stored = json.loads(done.read_text())
    return StageResult(
        output_dir=output_dir,
        model_dir=output_dir / stored.get("model_dir", MODEL_DIR),
        metrics={k: float(v) for k, v in stored["metrics"].items()},
        history=read_metrics(output_dir) if (output_dir / "metrics.jsonl").exists() else [],
    )


def begin_stage(cfg: _StageConfig, resume: bool) -> StageResult | None:
    """Check OUTPUT_DIR, write config.json and seed every RNG; returns the stored result when the
    stage already finished and `resume` asks for it.

    Without `resume`, a directory holding a finished stage or checkpoints is an error, so a rerun
    never mixes its metrics and checkpoints into an older run's.
    """
    output_dir = Path(cfg.output_dir)
    if resume:
        done = finished_result(output_dir)
        if done is not None:
            return done
    elif (output_dir / DONE_FILE).exists() or checkpoint_dirs(output_dir):
        raise ConfigError(
            f"output_dir '{output_dir}' already holds a run; resume it or choose another output_dir"
        )
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config.json").write_text(json.dumps(cfg.model_dump(mode="json"), indent=1))
    # Before any model is built: LoRA adapters and a reward head are initialised from these RNGs.
    seed_everything(cfg.train.seed)
    return None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lora_settings(cfg: _StageConfig) -> LoraSettings | None:
    lo = cfg.model.lora
    if not lo.enabled:
        return None
    return LoraSettings(
        r=lo.r, alpha=lo.alpha, dropout=lo.dropout, target_modules=lo.target_modules
    )


def total_steps(train: OfflineTrainConfig, num_items: int) -> int:
    if train.steps is not None:
        return train.steps
    return max(1, math.ceil(train.epochs * num_items / train.batch_size))


@functools.lru_cache(maxsize=8)
def _epoch_order(num_items: int, seed: int, epoch: int) -> tuple[int, ...]:
    generator = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + epoch)  # host indices
    return tuple(torch.randperm(num_items, generator=generator, device="cpu").tolist())


def step_indices(step: int, batch_size: int, num_items: int, seed: int) -> list[int]:
    """Item indices of optimizer step `step` (1-based): a slice of the seeded per-epoch stream."""
    out = []
    for position in range((step - 1) * batch_size, step * batch_size):
        epoch, i = divmod(position, num_items)
        out.append(_epoch_order(num_items, seed, epoch)[i])
    return out


def chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def build_optimizer(
    params: list[torch.nn.Parameter], train: OfflineTrainConfig, learning_rate: float, steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with linear warmup, then a constant, linear-to-zero or cosine-to-zero schedule."""
    optimizer = adamw(
        params, lr=learning_rate, betas=train.adam_betas, weight_decay=train.weight_decay
    )

    def lr_factor(step: int) -> float:
        if step < train.warmup_steps:
            return (step + 1) / (train.warmup_steps + 1)
        progress = (step - train.warmup_steps) / max(1, steps - train.warmup_steps)
        if train.lr_schedule == "linear":
            return max(0.0, 1.0 - progress)
        if train.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def forward_logits(model: Any, batch: TokenBatch, bf16: bool) -> torch.Tensor:
    """Logits (B, T-1, V) at the positions that predict `batch.targets_B_T` (the batch moved to
    the model's device)."""
    device = device_of(model)
    batch = batch.to(device)
    with autocast_context(bf16, device.type):
        out = model(
            input_ids=batch.input_ids_B_T,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids_B_T,
            use_cache=False,
        )
    return out.logits[:, :-1, :]


def forward_logprobs(model: Any, batch: TokenBatch, bf16: bool) -> torch.Tensor:
    """Log-probs (B, T-1) of each target token, in fp32, on the model's device."""
    logits = forward_logits(model, batch, bf16)
    return target_logprobs(logits, batch.targets_B_T.to(logits.device))


def disable_dropout(model: Any) -> None:
    """Zero every dropout probability (nn.Dropout modules, LoRA's included, and the attention
    dropout rate that Llama-style attention modules read from an attribute). The model stays in
    train mode, so gradient checkpointing, which only runs in train mode, still applies."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def attn_implementation(model: Any) -> str:
    return str(getattr(model.config, "_attn_implementation", None) or "sdpa")


StepFn = Callable[[list[int]], dict[str, float]]
EvalFn = Callable[[], dict[str, float]]


def run_stage(
    cfg: _StageConfig,
    *,
    model: Any,
    tokenizer: Any,
    lora: bool,
    num_items: int,
    train_step: StepFn,
    evaluate: EvalFn | None,
    resume: bool,
) -> StageResult:
    """The optimizer-step loop shared by the stages.

    `train_step(indices)` runs forward and backward over the step's items (micro-batching inside)
    and returns the step's metrics; this loop clips, steps, schedules, logs, evaluates every
    `eval_every` steps and at the end, checkpoints every `checkpoint_every` steps, then writes the
    final model and DONE.json. SIGINT / SIGTERM finish the step, checkpoint it and raise
    `RunInterrupted` (rlvr.train.run_dir.StopSignals); the same call with `resume` continues.
    """
    output_dir = Path(cfg.output_dir)
    train = cfg.train
    steps = total_steps(train, num_items)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = build_optimizer(params, train, cfg.learning_rate(), steps)
    start = 0
    if resume and checkpoint_dirs(output_dir):
        checkpoint = latest_checkpoint(output_dir)
        load_weights_into(model, checkpoint, lora)
        state, _ = load_training_state(checkpoint, optimizer, scheduler)
        start = int(state["step"])
    tracker = Tracker(output_dir, project="", run_name="", config={}, resume_step=start)
    progress = Progress(total=steps, start=start, enabled=cfg.progress, label=output_dir.name)

    def save(step: int) -> None:
        save_checkpoint(
            output_dir,
            step,
            model=model,
            tokenizer=tokenizer,
            optimizer=optimizer,
            scheduler=scheduler,
            generator_rng=torch.get_rng_state(),
            sampler_state={},
            extra_state={"stage": type(cfg).__name__},
            keep_last=cfg.keep_last,
        )

    stop_signals = StopSignals()
    try:
        for step in range(start + 1, steps + 1):
            model.train()
            optimizer.zero_grad(set_to_none=True)
            metrics = train_step(step_indices(step, train.batch_size, num_items, train.seed))
            grad_norm = torch.nn.utils.clip_grad_norm_(params, train.max_grad_norm)
            # A non-finite gradient would poison the weights: skip the step and count it.
            finite = math.isfinite(float(grad_norm))
            if finite:
                optimizer.step()
            metrics["skipped_nonfinite"] = float(not finite)
            metrics["grad_norm"] = float(grad_norm)
            metrics["learning_rate"] = float(scheduler.get_last_lr()[0])
            metrics["epoch"] = step * train.batch_size / num_items
            scheduler.step()
            if evaluate is not None and (
                step == steps or (cfg.eval_every and step % cfg.eval_every == 0)
            ):
                model.eval()
                with torch.no_grad():
                    metrics.update(evaluate())
            tracker.log(metrics, step=step)
            progress.update(step, metrics)
            saved = bool(cfg.checkpoint_every) and step % cfg.checkpoint_every == 0 and step < steps
            # Ctrl-C / SIGTERM: this step is done; checkpoint it (unless it is the last) and stop.
            interrupted = stop_signals.requested() and step < steps
            if saved or interrupted:
                save(step)
            if interrupted:
                raise stop_signals.interrupted(step, output_dir)
    finally:
        stop_signals.restore()
        progress.close()
        tracker.close()
    history = read_metrics(output_dir)
    final = {
        k: float(v) for k, v in history[-1].items() if k not in ("step", "time") and v is not None
    }
    model_dir = save_final_model(model, tokenizer, output_dir, lora)
    done = {"metrics": final, "model_dir": MODEL_DIR, "steps": steps}
    (output_dir / DONE_FILE).write_text(json.dumps(done, indent=1))
    return StageResult(output_dir, model_dir, final, history)


def save_final_model(model: Any, tokenizer: Any, output_dir: Path, lora: bool) -> Path:
    """OUTPUT_DIR/model as a plain HF directory; LoRA adapters are merged into the weights first."""
    model.eval()
    plain = model.merge_and_unload() if lora else model
    target = output_dir / MODEL_DIR
    tmp = output_dir / (MODEL_DIR + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    # Rename last: a crash mid-save never leaves a model/ that looks complete.
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
