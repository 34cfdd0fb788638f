"""DPO on the tiny model: a clear preference is learned, the reference is scored once, variants run."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest

from rlvr.errors import ConfigError
from rlvr.models import make_tiny_model_dir
from rlvr.offline import DPOConfig, train_dpo
from rlvr.offline import dpo as dpo_module

# Runs the loop with model.bf16: auto, so its numbers depend on the CPU kind (tests/conftest.py).
pytestmark = pytest.mark.precision


def yes_no_pairs(n: int = 48, seed: int = 0) -> list[dict[str, str]]:
    """Varied prompts; the chosen answer is always "yes", the rejected always "no"."""
    rng = random.Random(seed)
    return [
        {
            "prompt": f"is {rng.randint(0, 99)} {rng.randint(0, 99)}?",
            "chosen": "yes",
            "rejected": "no",
        }
        for _ in range(n)
    ]


def dpo_config(model_dir: Path, out: Path, **overrides: Any) -> DPOConfig:
    data: dict[str, Any] = {
        "model": {"name": str(model_dir)},
        "output_dir": str(out),
        "data": {"heldout_fraction": 0.25},
        "train": {
            "steps": 10,
            "batch_size": 8,
            "learning_rate": 1e-3,
            "lr_schedule": "constant",
            "max_length": 64,
        },
    }
    data.update(overrides)
    return DPOConfig.model_validate(data)


def test_dpo_learns_a_clear_preference(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    original = dpo_module.pair_logps

    def counting(model: Any, pairs: list[Any], **kw: Any) -> Any:
        calls.append(len(pairs))
        return original(model, pairs, **kw)

    monkeypatch.setattr(dpo_module, "pair_logps", counting)
    result = train_dpo(
        dpo_config(tiny_model_dir, tmp_path / "dpo", eval_every=5), rows=yes_no_pairs()
    )
    first = result.history[0]
    # Step 1: the policy is the reference, so every implicit reward is 0 and the loss is
    # -log sigmoid(0) = ln 2, and no pair is "won" (accuracy counts chosen > rejected strictly).
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert first["rewards/accuracies"] == 0.0
    assert result.metrics["eval/rewards/accuracies"] > 0.9
    assert result.metrics["eval/rewards/margins"] > 0
    assert result.metrics["loss"] < first["loss"]
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert key in result.metrics and f"eval/{key}" in result.metrics
    # The reference was scored once for all 36 train and 12 held-out pairs, not per step.
    assert calls == [36, 12]
    assert (tmp_path / "dpo" / dpo_module.REFERENCE_FILE).is_file()


@pytest.mark.parametrize(
    ("loss_type", "first_loss"),
    [
        ("ipo", 25.0),  # (h - 1/(2 beta))^2 with h = 0, beta = 0.1: (1/0.2)^2 = 25
        ("hinge", 1.0),  # max(0, 1 - beta * 0) = 1
    ],
)
def test_dpo_variants_with_lora(
    tiny_model_dir: Path, tmp_path: Path, loss_type: str, first_loss: float
) -> None:
    cfg = dpo_config(
        tiny_model_dir,
        tmp_path / loss_type,
        loss_type=loss_type,
        model={"name": str(tiny_model_dir), "lora": {"enabled": True, "r": 4, "alpha": 8}},
        train={"steps": 3, "batch_size": 4, "learning_rate": 1e-2, "max_length": 64},
    )
    result = train_dpo(cfg, rows=yes_no_pairs(16))
    assert result.history[0]["loss"] == pytest.approx(first_loss, abs=1e-4)
    assert result.metrics["loss"] < first_loss
    assert not (result.model_dir / "adapter_config.json").exists()  # merged into a plain model


def test_dpo_switches_dropout_off(tmp_path: Path) -> None:
    # With attention and LoRA dropout at 0.5, a policy equal to its reference would still score
    # pairs differently from it at step 1; with dropout off the loss is exactly ln 2.
    model_dir = make_tiny_model_dir(tmp_path / "dropout-model", attention_dropout=0.5)
    cfg = dpo_config(
        model_dir,
        tmp_path / "dpo",
        model={"name": str(model_dir), "lora": {"enabled": True, "r": 4, "dropout": 0.5}},
        train={"steps": 1, "batch_size": 8, "max_length": 64},
    )
    result = train_dpo(cfg, rows=yes_no_pairs(16))
    assert result.history[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_dpo_config_and_data_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="label_smoothing applies"):
        dpo_config(tiny_model_dir, tmp_path / "x", loss_type="ipo", label_smoothing=0.1)
    bad = [*yes_no_pairs(4), {"prompt": "p", "chosen": "yes"}]
    with pytest.raises(ConfigError, match="in-memory data row 5: no 'rejected'"):
        train_dpo(dpo_config(tiny_model_dir, tmp_path / "bad"), rows=bad)
