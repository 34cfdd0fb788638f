"""Checkpoints that resume a run exactly: weights (or adapter), optimizer, scheduler, every RNG, the
task sampler's position and the config.

Layout: RUN_DIR/checkpoints/step-000040/{model/, optimizer.pt, scheduler.pt, rng.pt, rng.json,
state.json}. `model/` is a normal HF (or peft adapter) directory, so `rlvr eval` and `from_pretrained`
read it.

Under torchrun every rank samples with its own RNGs (seeded per rank), so each rank r > 0 adds
rng-rank{r}.pt / rng-rank{r}.json and a resume restores every rank's own. Under fsdp the optimizer
state is sharded: `optimizer/` holds it as a torch.distributed.checkpoint (each rank writes its
shard; a resume reshards it to the new world size), in place of optimizer.pt.

Run files are data, not code: every .pt file here holds only tensors, numbers, strings and
containers, and is read with `torch.load(weights_only=True)`, which refuses anything else. A
pickle can run arbitrary code when loaded, and run directories get copied between machines and
people. So the RNG states that are Python objects (random's tuple, numpy's array) go to rng.json,
and rng.pt holds only torch's RNG byte tensors.
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlvr.errors import ConfigError
from rlvr.scale.torch_dist import DistContext


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
    dist: DistContext | None = None,
    sharded_model: Any = None,
    model_state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write step's checkpoint atomically; `save_extra(dir)` adds more state (ppo's critic); under
    torchrun every rank calls it, and it writes its files on rank 0 (or its shards, fsdp).

    Single process: everything here. Under torchrun (`dist`) every rank calls it: rank 0 writes the
    weights (`model`, gathered by the caller under fsdp) and the run state, each rank its RNGs, and
    under fsdp (`sharded_model`: the sharded policy the optimizer holds) every rank its optimizer
    shard; rank 0 renames the directory into place once all have written. `model_state`: the
    weights to write when `model`'s own are shards (gathered by the caller on every rank)."""
    final = run_dir / "checkpoints" / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    main = dist is None or dist.is_main
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp / "model", state_dict=model_state)
        tokenizer.save_pretrained(tmp / "model")
        if sharded_model is None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "state.json").write_text(
            json.dumps({"step": step, "sampler": sampler_state, **extra_state}, indent=1)
        )
    if dist is not None:
        dist.barrier()  # the directory exists before the other ranks write into it
    if save_extra is not None:
        save_extra(tmp)  # on every rank: it may gather (fsdp); it writes on rank 0 only
    rank = dist.rank if dist is not None else 0
    torch.save(
        {"torch": torch.get_rng_state(), "generator": generator_rng}, tmp / _rng_name(rank, "pt")
    )
    (tmp / _rng_name(rank, "json")).write_text(json.dumps(rng_to_json()))
    if sharded_model is not None:
        save_sharded_optimizer(tmp, optimizer, sharded_model)
    if dist is not None:
        dist.barrier()  # every rank's part is on disk
    if main:
        # Rename last: a crash mid-save leaves a .tmp directory, never a checkpoint that looks
        # complete.
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in checkpoint_dirs(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    if dist is not None:
        dist.barrier()  # no rank reads or resumes from the checkpoint before it is in place
    return final


def _rng_name(rank: int, suffix: str) -> str:
    return f"rng.{suffix}" if rank == 0 else f"rng-rank{rank}.{suffix}"


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
    checkpoint: Path,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    rank: int = 0,
    sharded_model: Any = None,
) -> tuple[dict[str, Any], torch.Tensor]:
    """Restore optimizer, scheduler and global RNGs; return (state.json contents, generator RNG state).
    `rank`: this rank's own RNGs (rank 0's where the checkpoint has none for it: a run saved by
    fewer ranks). `sharded_model` (fsdp): the optimizer state is read from the sharded checkpoint,
    resharded to this job's ranks (a collective: every rank calls it)."""
    if not (checkpoint / "rng.json").is_file():
        raise ConfigError(
            f"checkpoint {checkpoint} has no rng.json: it was written by an older rlvr, whose "
            "pickled RNG state is not loaded (start a new run)"
        )
    if sharded_model is not None:
        load_sharded_optimizer(checkpoint, optimizer, sharded_model)
    else:
        if not (checkpoint / "optimizer.pt").is_file():
            raise ConfigError(
                f"checkpoint {checkpoint} holds a sharded optimizer (an fsdp run): resume it with "
                "distributed.strategy fsdp under torchrun"
            )
        optimizer.load_state_dict(load_data(checkpoint / "optimizer.pt"))
    scheduler.load_state_dict(load_data(checkpoint / "scheduler.pt"))
    own = (checkpoint / _rng_name(rank, "json")).is_file()
    rng_json = checkpoint / _rng_name(rank if own else 0, "json")
    rng = load_data(checkpoint / _rng_name(rank if own else 0, "pt"))
    rng_from_json(json.loads(rng_json.read_text()))
    torch.set_rng_state(rng["torch"])
    state = json.loads((checkpoint / "state.json").read_text())
    return state, rng["generator"]


def save_sharded_optimizer(directory: Path, optimizer: torch.optim.Optimizer, model: Any) -> None:
    """The fsdp optimizer state of `model` (sharded DTensors) as a torch.distributed.checkpoint in
    `directory/optimizer`, each rank writing its shard. A collective: every rank calls it."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer)
    save({"optimizer": state}, checkpoint_id=str(directory / "optimizer"))


def load_sharded_optimizer(checkpoint: Path, optimizer: torch.optim.Optimizer, model: Any) -> None:
    """The fsdp optimizer state from `checkpoint/optimizer` (torch.distributed.checkpoint) into this
    rank's shard of it, resharded to this job's ranks. A collective: every rank calls it."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    if not (checkpoint / "optimizer").is_dir():
        raise ConfigError(
            f"checkpoint {checkpoint} has no sharded optimizer state (optimizer/): it was saved by "
            "a single process or ddp; resume it the way it was run"
        )
    # The state's structure (its tensors sharded as this job shards them), then filled from disk.
    state = get_optimizer_state_dict(model, optimizer)
    load({"optimizer": state}, checkpoint_id=str(checkpoint / "optimizer"))
    set_optimizer_state_dict(model, optimizer, state)


def load_data(path: Path) -> Any:
    """`torch.load` of a run file that may hold tensors and plain containers only (never code)."""
    try:
        # On the host: the optimizer, critic and RNG loaders move what they need to its device
        # (a run saved on cuda:1 resumes on a machine with one GPU, or none).
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else "not plain data"
        raise ConfigError(
            f"{path} holds more than tensors and plain data, so it is not loaded ({first[:200]})"
        ) from None
    except (OSError, RuntimeError) as err:
        raise ConfigError(f"{path} could not be read: {str(err).splitlines()[0][:200]}") from None


def rng_to_json() -> dict[str, Any]:
    """Python's and numpy's global RNG states as JSON (exact: ints, and floats round-trip by repr)."""
    version, internal, gauss = random.getstate()
    algorithm, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "python": [version, list(internal), gauss],
        "numpy": {
            "algorithm": algorithm,
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }


def rng_from_json(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    keys = np.array(n["keys"], dtype=np.uint32)
    np.random.set_state((n["algorithm"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
