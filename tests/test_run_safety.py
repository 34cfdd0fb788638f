"""No run lost, none mixed: run files are data (never unpickled code), a run directory is never
reused by accident, an interrupted run saves a checkpoint and resumes exactly, and the DPO
reference cache is only reused for the model and loss it was computed for."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rlvr.config import RunConfig, load_config
from rlvr.errors import ConfigError
from rlvr.observe.metrics import WALL_CLOCK_METRICS
from rlvr.observe.tracking import read_metrics
from rlvr.train.loop import train

SRC = Path(__file__).resolve().parent.parent / "src"
RLVR = Path(sys.executable).parent / "rlvr"


def tiny_cfg(config_dir: Path, model_dir: Path, out: Path, *overrides: str) -> RunConfig:
    return load_config(
        config_dir / "tiny.yaml",
        [f"model.name={model_dir}", f"output_dir={out}", "tracking.progress=false", *overrides],
    )


def by_step(run: Path) -> dict[int, dict[str, Any]]:
    """metrics.jsonl merged per step, without the wall-clock metrics and without event rows."""
    rows: dict[int, dict[str, Any]] = {}
    for m in read_metrics(run):
        if "event" in m:
            continue
        rows.setdefault(m["step"], {}).update(
            {k: v for k, v in m.items() if k not in WALL_CLOCK_METRICS}
        )
    return rows


# ---------------------------------------------------------------------------------------------- data
def test_no_source_file_unpickles_code() -> None:
    """`torch.load(..., weights_only=False)` runs whatever a pickle says; no run file is read so."""
    offenders = [
        f"{path.relative_to(SRC)}:{i}"
        for path in SRC.rglob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"weights_only\s*=\s*False", line) or re.search(r"pickle\.loads?\(", line)
    ]
    assert offenders == []


def test_checkpoint_files_are_plain_data_and_resume_loads_them(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = tiny_cfg(
        tiny_config_dir,
        tiny_model_dir,
        tmp_path / "run",
        "train.steps=2",
        "checkpoint.every=1",
        "eval.at_start=false",
        "eval.at_end=false",
    )
    train(cfg, config_dir=tiny_config_dir)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    for name in ("optimizer.pt", "scheduler.pt", "rng.pt"):
        torch.load(checkpoint / name, weights_only=True)  # raises on anything but plain data
    rng = torch.load(checkpoint / "rng.pt", weights_only=True)
    assert rng["torch"].dtype == torch.uint8
    json_state = json.loads((checkpoint / "rng.json").read_text())
    assert set(json_state) == {"python", "numpy"}

    # A planted pickle payload is refused with a one-line error, never executed.
    class Boom:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    torch.save({"torch": Boom()}, checkpoint / "rng.pt")
    with pytest.raises(ConfigError, match=r"rng\.pt holds more than tensors"):
        train(cfg, resume=True, config_dir=tiny_config_dir)
    assert not (tmp_path / "pwned").exists()


def test_dpo_reference_cache_is_keyed_on_model_and_averaging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlvr.models import load_policy, make_tiny_model_dir
    from rlvr.offline import dpo as dpo_module
    from rlvr.offline.data import pair_examples

    rows = [{"prompt": f"q{i}", "chosen": "yes", "rejected": "no"} for i in range(4)]
    calls: list[str] = []
    original = dpo_module.pair_logps

    def counting(model: Any, pairs: list[Any], **kw: Any) -> Any:
        calls.append(f"average={kw['average']}")
        return original(model, pairs, **kw)

    monkeypatch.setattr(dpo_module, "pair_logps", counting)
    cache = tmp_path / dpo_module.REFERENCE_FILE

    def reference(model_dir: Path, average: bool) -> dict[str, Any]:
        policy = load_policy(str(model_dir))
        pairs = pair_examples(policy.tokenizer, rows, source="mem", max_length=64, truncate=False)
        return dpo_module.reference_logps(
            cache,
            policy,
            {"train": pairs},
            model_name=str(model_dir),
            pad_id=int(policy.tokenizer.pad_token_id),
            micro=4,
            bf16=False,
            average=average,
        )

    model_dir = make_tiny_model_dir(tmp_path / "model", seed=0)
    summed = reference(model_dir, average=False)
    assert calls == ["average=False"]
    assert torch.equal(reference(model_dir, average=False)["train"][0], summed["train"][0])
    assert calls == ["average=False"]  # same model, same loss: read from the cache
    averaged = reference(model_dir, average=True)  # sigmoid -> ipo in the same output dir
    assert calls == ["average=False", "average=True"]
    assert not torch.equal(averaged["train"][0], summed["train"][0])
    # Other weights under the same model path (a retrained model, same architecture): recomputed.
    other = make_tiny_model_dir(model_dir, seed=1, vocab_size=128)  # an override forces a rewrite
    other_logps = reference(other, average=True)
    assert calls == ["average=False", "average=True", "average=True"]
    assert not torch.equal(other_logps["train"][0], averaged["train"][0])
    torch.load(cache, weights_only=True)  # the cache itself is plain data
