"""Checkpoints that resume a run exactly: weights (or adapter), optimizer, scheduler, every RNG, the
task sampler's position and the config.

Layout: RUN_DIR/checkpoints/step-000040/{model/, optimizer.pt, scheduler.pt, rng.pt, state.json}.
`model/` is a normal HF (or peft adapter) directory, so `rlvr eval` and `from_pretrained` read it.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlvr.errors import ConfigError


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith("step-") and (p / "state.json").exists()
    )


def latest_checkpoint(run_dir: Path) -> Path:
    found = checkpoint_dirs(run_dir)
    if not found:
        raise ConfigError(f"no checkpoint to resume from in '{run_dir}/checkpoints'")
    return found[-1]


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    generator_rng: torch.Tensor,
    sampler_state: dict[str, Any],
    extra_state: dict[str, Any],
    keep_last: int,
    save_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write step's checkpoint atomically; `save_extra(dir)` adds more state (ppo's critic)."""
    final = run_dir / "checkpoints" / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(
        {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "generator": generator_rng,
        },
        tmp / "rng.pt",
    )
    (tmp / "state.json").write_text(
        json.dumps({"step": step, "sampler": sampler_state, **extra_state}, indent=1)
    )
    if save_extra is not None:
        save_extra(tmp)
    # Rename last: a crash mid-save leaves a .tmp directory, never a checkpoint that looks complete.
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in checkpoint_dirs(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_weights_into(model: Any, checkpoint: Path, lora: bool) -> None:
    """Load the checkpoint's trained weights into an already built policy (base + adapters if LoRA)."""
    from safetensors.torch import load_file

    model_dir = checkpoint / "model"
    if lora:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(
            model, load_file(str(model_dir / "adapter_model.safetensors"))
        )
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise ConfigError(
                f"checkpoint {checkpoint}: adapter does not match the LoRA config (unexpected {unexpected[:3]})"
            )
        return
    state: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(file)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied embeddings are saved once; anything else missing means the checkpoint does not fit the model.
    real_missing = [k for k in missing if "lm_head" not in k]
    if real_missing or unexpected:
        raise ConfigError(
            f"checkpoint {checkpoint} does not match the model: missing {real_missing[:3]}, unexpected {unexpected[:3]}"
        )


def load_training_state(
    checkpoint: Path, optimizer: torch.optim.Optimizer, scheduler: Any
) -> tuple[dict[str, Any], torch.Tensor]:
    """Restore optimizer, scheduler and global RNGs; return (state.json contents, generator RNG state)."""
    optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt", weights_only=False))
    scheduler.load_state_dict(torch.load(checkpoint / "scheduler.pt", weights_only=False))
    rng = torch.load(checkpoint / "rng.pt", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    state = json.loads((checkpoint / "state.json").read_text())
    return state, rng["generator"]
