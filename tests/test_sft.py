"""SFT on the tiny model: it learns, trains only assistant tokens, resumes exactly, merges LoRA;
and teacher (distillation) data feeds it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rlvr.algorithms.preference import sft_loss
from rlvr.errors import ConfigError
from rlvr.models import load_policy
from rlvr.observe.tracking import Tracker
from rlvr.offline import DistillDataConfig, SFTConfig, generate_teacher_data, train_sft
from rlvr.offline.common import forward_logprobs
from rlvr.offline.data import collate, sft_examples

# Runs the loop with model.bf16: auto, so its numbers depend on the CPU kind (tests/conftest.py).
pytestmark = pytest.mark.precision

WORDS = ["cat", "dog", "sun", "red", "blue", "tree", "fish", "bird", "moon", "star", "rain", "leaf"]


def chat_rows(n: int = 24) -> list[dict[str, Any]]:
    return [
        {
            "messages": [
                {"role": "system", "content": "Repeat the word."},
                {"role": "user", "content": f"say {WORDS[i % len(WORDS)]}"},
                {"role": "assistant", "content": WORDS[i % len(WORDS)]},
            ]
        }
        for i in range(n)
    ]


def sft_config(model_dir: Path, out: Path, **overrides: Any) -> SFTConfig:
    data: dict[str, Any] = {
        "model": {"name": str(model_dir)},
        "output_dir": str(out),
        "data": {"heldout_fraction": 0.2},
        "train": {
            "steps": 12,
            "batch_size": 8,
            "micro_batch_size": 4,
            "learning_rate": 3e-3,
            "max_length": 128,
        },
    }
    data.update(overrides)
    return SFTConfig.model_validate(data)


def test_sft_loss_falls_and_writes_a_plain_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    train = {"steps": 20, "batch_size": 8, "micro_batch_size": 4, "max_length": 128}
    cfg = sft_config(
        tiny_model_dir,
        tmp_path / "sft",
        eval_every=10,
        packing=True,
        train={**train, "learning_rate": 3e-3, "lr_schedule": "constant"},
    )
    result = train_sft(cfg, rows=chat_rows())
    losses = [h["loss"] for h in result.history]
    assert len(losses) == 20
    assert sum(losses[-2:]) < 0.6 * sum(losses[:2])
    evals = [h["eval/loss"] for h in result.history if "eval/loss" in h]
    assert len(evals) == 2 and evals[1] < evals[0]
    for key in ("loss", "mean_token_accuracy", "eval/loss", "eval/mean_token_accuracy"):
        assert key in result.metrics
    done = json.loads((tmp_path / "sft" / "DONE.json").read_text())
    assert done["metrics"] == pytest.approx(result.metrics)
    assert result.model_dir == tmp_path / "sft" / "model"
    assert load_policy(str(result.model_dir)).model.config.num_hidden_layers == 2


def test_non_assistant_tokens_carry_no_loss(tiny_model_dir: Path) -> None:
    policy = load_policy(str(tiny_model_dir))
    examples = sft_examples(
        policy.tokenizer,
        chat_rows(4),
        source="rows",
        max_length=128,
        truncate=False,
        assistant_only=True,
    )
    batch = collate([[e] for e in examples], int(policy.tokenizer.pad_token_id))
    # Scramble every target the mask excludes (system, user, template tokens, padding).
    scrambled_targets = batch.targets_B_T.clone()
    untrained = batch.loss_mask_B_T == 0
    scrambled_targets[untrained] = torch.randint(4, 100, (int(untrained.sum()),))
    scrambled = type(batch)(
        batch.input_ids_B_T,
        batch.position_ids_B_T,
        batch.attention_mask,
        scrambled_targets,
        batch.loss_mask_B_T,
    )
    grads = []
    for b in (batch, scrambled):
        policy.model.zero_grad()
        loss = sft_loss(forward_logprobs(policy.model, b, bf16=False), b.loss_mask_B_T)
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in policy.model.parameters()]))
    assert grads[0][0] == grads[1][0]
    assert all(torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1], strict=True))


def test_resume_matches_an_uninterrupted_run(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides = {
        "checkpoint_every": 2,
        "train": {
            "steps": 4,
            "batch_size": 4,
            "learning_rate": 1e-3,
            "lr_schedule": "linear",
            "warmup_steps": 1,
            "max_length": 128,
        },
    }
    whole = train_sft(sft_config(tiny_model_dir, tmp_path / "whole", **overrides), rows=chat_rows())

    # Crash while logging step 3: the step-2 checkpoint exists, step 3's update is lost.
    original_log = Tracker.log

    def crash_at_step_3(self: Tracker, metrics: dict[str, Any], step: int) -> None:
        if step == 3:
            raise KeyboardInterrupt
        original_log(self, metrics, step)

    cfg = sft_config(tiny_model_dir, tmp_path / "split", **overrides)
    monkeypatch.setattr(Tracker, "log", crash_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        train_sft(cfg, rows=chat_rows())
    monkeypatch.setattr(Tracker, "log", original_log)
    assert not (tmp_path / "split" / "DONE.json").exists()
    before = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    assert len(before) == 2
    resumed = train_sft(cfg, rows=chat_rows(), resume=True)

    # Steps 1-2 were not redone (their lines, timestamps included, are the pre-crash ones).
    assert (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()[:2] == before
    assert [h["step"] for h in resumed.history] == [1, 2, 3, 4]
    assert [h["loss"] for h in resumed.history] == pytest.approx(
        [h["loss"] for h in whole.history], abs=1e-6
    )
    a = load_file(str(whole.model_dir / "model.safetensors"))
    b = load_file(str(resumed.model_dir / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)

    # Finished: resuming again returns the stored result without loading a model.
    monkeypatch.setattr("rlvr.offline.sft.load_policy", lambda *a, **k: pytest.fail("trained"))
    again = train_sft(cfg, resume=True)
    assert again.metrics == pytest.approx(resumed.metrics)
    with pytest.raises(ConfigError, match="already holds a run"):
        train_sft(cfg, rows=chat_rows())


def test_lora_sft_saves_a_merged_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = sft_config(
        tiny_model_dir,
        tmp_path / "lora",
        model={"name": str(tiny_model_dir), "lora": {"enabled": True, "r": 4, "alpha": 8}},
        train={"steps": 2, "batch_size": 4, "learning_rate": 1e-2, "max_length": 128},
    )
    result = train_sft(cfg, rows=chat_rows(8))
    assert not (result.model_dir / "adapter_config.json").exists()
    merged = load_policy(str(result.model_dir)).model
    base = load_policy(str(tiny_model_dir)).model
    changed = [
        name
        for (name, p), (_, q) in zip(
            merged.named_parameters(), base.named_parameters(), strict=True
        )
        if not torch.equal(p, q)
    ]
    assert changed and all("proj" in name for name in changed)  # LoRA targets the projections


def test_teacher_data_feeds_sft(tiny_model_dir: Path, tmp_path: Path) -> None:
    prompts = [{"prompt": f"say {w}", "answer": w} for w in WORDS[:6]]
    cfg = DistillDataConfig(
        teacher=str(tiny_model_dir),
        prompts_path="unused.jsonl",
        samples_per_prompt=2,
        max_new_tokens=6,
        drop_truncated=False,  # a random teacher rarely ends its turn
        output_path=str(tmp_path / "teacher.jsonl"),
    )
    path = generate_teacher_data(cfg, rows=prompts)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 12
    assert rows[0]["messages"][0] == {"role": "user", "content": "say cat"}
    assert rows[0]["messages"][-1]["role"] == "assistant"
    result = train_sft(
        sft_config(
            tiny_model_dir,
            tmp_path / "student",
            data={"path": str(path), "heldout_fraction": 0.0},
            train={"steps": 2, "batch_size": 4, "max_length": 128},
        )
    )
    assert len(result.history) == 2 and "eval/loss" not in result.metrics


def test_teacher_rejection_sampling_keeps_only_passing_samples(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    reward_file = tmp_path / "even.py"
    reward_file.write_text(
        "def even(completion, answer):\n    return float(len(completion) % 2 == 0)\n"
    )
    cfg = DistillDataConfig.model_validate(
        {
            "teacher": str(tiny_model_dir),
            "prompts_path": "unused.jsonl",
            "samples_per_prompt": 4,
            "max_new_tokens": 5,
            "drop_truncated": False,
            "reward": {"fn": f"{reward_file}:even"},
            "min_reward": 1.0,
            "output_path": str(tmp_path / "kept.jsonl"),
        }
    )
    prompts = [{"prompt": f"say {w}", "answer": w} for w in WORDS[:6]]
    path = generate_teacher_data(cfg, rows=prompts)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    stats = json.loads((tmp_path / "kept.jsonl.stats.json").read_text())
    assert stats["kept"] == len(rows) > 0 and stats["below_min_reward"] > 0
    assert stats["kept"] + stats["below_min_reward"] == 24
    assert all(len(r["messages"][-1]["content"]) % 2 == 0 and r["reward"] == 1.0 for r in rows)


def test_a_non_finite_gradient_skips_the_step_and_is_counted(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rlvr.offline.common as common

    real_clip = torch.nn.utils.clip_grad_norm_
    calls = {"n": 0}

    def clip_nan_on_step_2(params: Any, max_norm: float) -> torch.Tensor:
        calls["n"] += 1
        norm = real_clip(params, max_norm)
        return torch.tensor(float("nan")) if calls["n"] == 2 else norm

    monkeypatch.setattr(common.torch.nn.utils, "clip_grad_norm_", clip_nan_on_step_2)
    cfg = sft_config(tiny_model_dir, tmp_path / "nan", data={"heldout_fraction": 0.0})
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 3})})
    train_sft(cfg, rows=chat_rows())
    rows = [
        json.loads(line) for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["skipped_nonfinite"] for r in rows] == [0.0, 1.0, 0.0]
