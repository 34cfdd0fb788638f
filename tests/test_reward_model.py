"""Bradley-Terry reward model on the tiny model, and the reward function that serves it to a rubric."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from rlvr.build import build_rubric
from rlvr.config import RewardSpec
from rlvr.errors import ConfigError
from rlvr.offline import RewardModelConfig, load_reward_model, train_reward_model
from rlvr.offline.data import Example, collate
from rlvr.offline.reward_model import build_reward_model, reward_model, sequence_scores
from rlvr.records import Task, Trajectory
from rlvr.verifiers.judge import is_verifiable

# Runs the loop with model.bf16: auto, so its numbers depend on the CPU kind (tests/conftest.py).
pytestmark = pytest.mark.precision


def yes_no_pairs(n: int = 48, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "prompt": f"is {rng.randint(0, 99)} {rng.randint(0, 99)}?",
            "chosen": "yes",
            "rejected": "no",
        }
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    cfg = RewardModelConfig.model_validate(
        {
            "model": {"name": str(tiny_model_dir)},
            "output_dir": str(tmp_path_factory.mktemp("rm") / "out"),
            "data": {"heldout_fraction": 0.25},
            "eval_every": 5,
            "train": {
                "steps": 10,
                "batch_size": 8,
                "learning_rate": 1e-3,
                "lr_schedule": "constant",
                "max_length": 64,
            },
        }
    )
    return train_reward_model(cfg, rows=yes_no_pairs())


def test_reward_model_learns_a_clear_preference(trained: Any) -> None:
    assert trained.metrics["eval/accuracy"] > 0.9
    assert trained.metrics["eval/margin"] > 0
    assert trained.metrics["loss"] < trained.history[0]["loss"]
    for key in ("loss", "accuracy", "margin", "eval/loss"):
        assert key in trained.metrics
    config = load_reward_model(trained.output_dir).model.config
    assert config.num_labels == 1 and config.pad_token_id is not None


def test_reward_function_prefers_chosen_and_is_not_verifiable(trained: Any) -> None:
    path = str(trained.model_dir)
    for prompt in ("is 3 70?", [{"role": "user", "content": "is 12 5?"}]):
        assert reward_model("yes", path=path, prompt=prompt) > reward_model(
            "no", path=path, prompt=prompt
        )
    assert not is_verifiable(reward_model)
    # Through a config rubric: the task's prompt messages arrive as `prompt`.
    rubric = build_rubric(
        [RewardSpec(fn="rlvr.offline.reward_model:reward_model", options={"path": path})]
    )
    assert not is_verifiable(rubric.functions[0])
    messages = [{"role": "user", "content": "is 3 70?"}]
    trajectory = Trajectory("t", (1, 2), (0, 1), (0.0, 0.0), 1, "yes", "stop")
    score = rubric.score(trajectory, Task("t", tuple(messages)))
    assert score.ok
    assert score.total == pytest.approx(reward_model("yes", path=path, prompt=messages))
    # Called without a prompt it raises, never scores the reply out of context.
    with pytest.raises(ValueError, match="needs the prompt"):
        reward_model("yes", path=path)


def test_reward_function_is_thread_safe(trained: Any) -> None:
    path = str(trained.model_dir)
    jobs = [("yes", f"is {i} 1?") for i in range(8)] + [("no", f"is {i} 1?") for i in range(8)]
    alone = [reward_model(c, path=path, prompt=p) for c, p in jobs]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda job: reward_model(job[0], path=path, prompt=job[1]), jobs))
    assert threaded == pytest.approx(alone, abs=1e-6)


def test_score_is_read_at_the_last_real_token(tiny_model_dir: Path) -> None:
    model, tokenizer = build_reward_model(str(tiny_model_dir))
    model.eval()
    short = Example((5, 6, 7), (0, 0, 0))
    long = Example((5, 6, 7, 8, 9, 10, 11), (0,) * 7)
    pad = int(tokenizer.pad_token_id)
    with torch.no_grad():
        alone = sequence_scores(model, collate([[short]], pad))
        padded = sequence_scores(model, collate([[short], [long]], pad))
        # transformers' own pooling on the unpadded row reads the same last token
        reference = model(input_ids=torch.tensor([[5, 6, 7]])).logits[:, 0]
    assert torch.allclose(alone, padded[:1], atol=1e-5)
    assert torch.allclose(alone, reference, atol=1e-5)


def test_bad_reward_model_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a model directory"):
        load_reward_model(tmp_path)


def test_lora_reward_model_is_merged_and_loads(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = RewardModelConfig.model_validate(
        {
            "model": {"name": str(tiny_model_dir), "lora": {"enabled": True, "r": 4, "alpha": 8}},
            "output_dir": str(tmp_path / "lora"),
            "data": {"heldout_fraction": 0.0},
            "train": {"steps": 3, "batch_size": 4, "learning_rate": 1e-2, "max_length": 64},
        }
    )
    result = train_reward_model(cfg, rows=yes_no_pairs(12))
    assert not (result.model_dir / "adapter_config.json").exists()
    scorer = load_reward_model(result.model_dir)
    # The trained head (saved next to the adapters, then merged) moved the scores apart.
    assert scorer.score("is 1 2?", "yes") > scorer.score("is 1 2?", "no")
