"""`rlvr pipeline`: stages chain their models, finished stages are skipped on a rerun, a reward
model trained in one stage scores another, offline distillation, and config errors are one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from rlvr.cli import app
from rlvr.errors import ConfigError
from rlvr.observe.tracking import read_metrics
from rlvr.pipeline import PipelineConfig, load_pipeline_config, run_pipeline

# Runs the loop with model.bf16: auto, so its numbers depend on the CPU kind (tests/conftest.py).
pytestmark = pytest.mark.precision

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture()
def pipeline_dir(tmp_path: Path, tiny_model_dir: Path) -> Path:
    for name in ("tiny_pipeline.yaml", "tiny_sft.jsonl", "tiny_pairs.jsonl", "tiny_rewards.py"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
    data = yaml.safe_load((tmp_path / "tiny_pipeline.yaml").read_text())
    data["model"] = str(tiny_model_dir)
    data["output_dir"] = str(tmp_path / "run")
    (tmp_path / "tiny_pipeline.yaml").write_text(yaml.safe_dump(data))
    return tmp_path


def test_tiny_pipeline_chains_sft_dpo_grpo_and_resumes(pipeline_dir: Path) -> None:
    """examples/tiny_pipeline.yaml: each stage starts from the last one's model; the digits reward
    on held-out prompts rises from the random model's ~0 to nearly 1; a rerun trains nothing."""
    cfg = load_pipeline_config(pipeline_dir / "tiny_pipeline.yaml")
    rows = run_pipeline(cfg, config_dir=pipeline_dir, echo=lambda _: None)
    by_stage = {r["stage"]: r for r in rows}
    assert list(by_stage) == ["start", "sft", "dpo", "grpo"]
    run = pipeline_dir / "run"
    # Chaining: DPO started from SFT's model, GRPO from DPO's.
    dpo_cfg = json.loads((run / "dpo" / "config.json").read_text())
    assert dpo_cfg["model"]["name"] == by_stage["sft"]["model_dir"] == str(run / "sft" / "model")
    grpo_cfg = yaml.safe_load((run / "grpo" / "config.yaml").read_text())
    assert grpo_cfg["model"]["name"] == by_stage["dpo"]["model_dir"]
    # What each stage bought, on the GRPO stage's held-out tasks (digit fraction of the answer).
    assert by_stage["start"]["heldout_accuracy"] < 0.3
    assert by_stage["sft"]["heldout_accuracy"] > 0.8
    assert by_stage["grpo"]["heldout_accuracy"] > 0.8
    # SFT loss fell; DPO separates chosen from rejected on held-out pairs.
    sft_losses = [m["loss"] for m in read_metrics(run / "sft") if "loss" in m]
    assert sft_losses[-1] < sft_losses[0] * 0.6
    assert by_stage["dpo"]["metrics"]["eval/rewards/accuracies"] > 0.9

    # A rerun skips every finished stage.
    said: list[str] = []
    grpo_steps = len(read_metrics(run / "grpo"))
    rows_again = run_pipeline(cfg, config_dir=pipeline_dir, echo=said.append)
    assert all("done earlier" in line for line in said) and len(said) == 3
    assert [r["stage"] for r in rows_again] == ["start", "sft", "dpo", "grpo"]
    # An interrupted RL stage (no marker, checkpoints present) resumes instead of starting over.
    (run / "grpo" / "stage.json").unlink()
    run_pipeline(cfg, config_dir=pipeline_dir, echo=lambda _: None)
    steps = [m["step"] for m in read_metrics(run / "grpo") if "loss" in m]
    assert steps == list(range(1, 11)), "the resumed stage must not train its steps again"
    assert len(read_metrics(run / "grpo")) >= grpo_steps


def test_reward_model_stage_scores_a_later_rl_stage_as_non_verifiable(
    pipeline_dir: Path, tiny_model_dir: Path
) -> None:
    cfg = PipelineConfig.model_validate(
        {
            "model": str(tiny_model_dir),
            "output_dir": str(pipeline_dir / "rm_run"),
            "eval": {"each_stage": False},
            "stages": [
                {
                    "name": "rm",
                    "kind": "reward_model",
                    "config": {
                        "data": {"path": "tiny_pairs.jsonl"},
                        "train": {
                            "steps": 10,
                            "batch_size": 16,
                            "micro_batch_size": 16,
                            "learning_rate": 1e-3,
                            "max_length": 64,
                        },
                    },
                },
                {
                    "name": "ppo",
                    "kind": "rl",
                    "config": {
                        "algorithm": "ppo",
                        "task": {"source": "arithmetic", "arithmetic": {"digits": 1}},
                        "rewards": [
                            {
                                "fn": "rlvr.offline.reward_model:reward_model",
                                "name": "rm",
                                "options": {"path": "{stage:rm}", "max_length": 64},
                            },
                            {"fn": "numeric_match", "name": "correct", "weight": 0.0},
                        ],
                        "sampling": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8},
                        "train": {"steps": 2},
                        "eval": {"at_start": False, "at_end": False},
                        "tracking": {"trackio": False, "progress": False},
                    },
                },
            ],
        }
    )
    rows = run_pipeline(cfg, config_dir=pipeline_dir, echo=lambda _: None)
    by_stage = {r["stage"]: r for r in rows}
    assert by_stage["rm"]["model_dir"] == str(pipeline_dir / "rm_run" / "rm" / "model")
    # The RL stage started from the base model, not from the reward model.
    ppo_cfg = yaml.safe_load((pipeline_dir / "rm_run" / "ppo" / "config.yaml").read_text())
    assert ppo_cfg["model"]["name"] == str(tiny_model_dir)
    assert ppo_cfg["rewards"][0]["options"]["path"] == by_stage["rm"]["model_dir"]
    steps = [m for m in read_metrics(pipeline_dir / "rm_run" / "ppo") if "loss" in m]
    assert len(steps) == 2
    assert all(m["rewards/rm/verifiable"] == 0.0 for m in steps)
    assert all("reward/non_verifiable" in m for m in steps)


def test_offline_distillation_stage_trains_on_teacher_samples(
    pipeline_dir: Path, tiny_model_dir: Path
) -> None:
    prompts = pipeline_dir / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"What is {a} + 1?"}) + "\n" for a in range(8))
    )
    cfg = PipelineConfig.model_validate(
        {
            "model": str(tiny_model_dir),
            "output_dir": str(pipeline_dir / "distill_run"),
            "eval": {"each_stage": False},
            "stages": [
                {
                    "name": "teacher",
                    "kind": "sft",
                    "config": {
                        "data": {"path": "tiny_sft.jsonl"},
                        "train": {
                            "steps": 20,
                            "batch_size": 16,
                            "micro_batch_size": 16,
                            "learning_rate": 3e-3,
                            "max_length": 64,
                        },
                    },
                },
                {
                    "name": "distill",
                    "kind": "distill",
                    "from": "start" if False else None,
                    "teacher_data": {
                        "teacher": "{stage:teacher}",
                        "prompts_path": "prompts.jsonl",
                        "samples_per_prompt": 2,
                        "max_new_tokens": 8,
                        "drop_truncated": False,
                    },
                    "config": {
                        "data": {"heldout_fraction": 0.0},
                        "train": {
                            "steps": 3,
                            "batch_size": 8,
                            "micro_batch_size": 8,
                            "max_length": 64,
                        },
                    },
                },
            ],
        }
    )
    rows = run_pipeline(cfg, config_dir=pipeline_dir, echo=lambda _: None)
    samples = pipeline_dir / "distill_run" / "distill" / "teacher_samples.jsonl"
    assert len(samples.read_text().splitlines()) == 16
    assert rows[-1]["model_dir"] == str(pipeline_dir / "distill_run" / "distill" / "sft" / "model")


def _stages(*stages: dict[str, Any]) -> dict[str, Any]:
    return {"model": "tiny-random", "output_dir": "x", "stages": list(stages)}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_stages({"name": "a", "kind": "sft"}, {"name": "a", "kind": "dpo"}), "unique"),
        (_stages({"name": "a", "kind": "sft", "from": "b"}), "from 'b' is not an earlier stage"),
        (
            _stages(
                {
                    "name": "a",
                    "kind": "rl",
                    "config": {"rewards": [{"fn": "x", "options": {"p": "{stage:z}"}}]},
                }
            ),
            "{stage:z} does not name an earlier stage",
        ),
        (
            _stages({"name": "a", "kind": "sft", "config": {"model": {"name": "m"}}}),
            "model.name is set by",
        ),
        (_stages({"name": "a", "kind": "distill"}), "needs teacher_data"),
        (_stages({"name": "a", "kind": "ppo"}), "'stages.0.kind' = 'ppo' is not allowed"),
    ],
)
def test_pipeline_config_errors_are_one_line(
    tmp_path: Path, data: dict[str, Any], message: str
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        load_pipeline_config(path)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_pipeline_cli_prints_the_stage_table(pipeline_dir: Path) -> None:
    result = CliRunner().invoke(
        app,
        [
            "pipeline",
            str(pipeline_dir / "tiny_pipeline.yaml"),
            "--set",
            "stages.0.config.train.steps=5",
        ],
    )
    assert result.exit_code == 0, result.output
    for word in ("start", "sft", "dpo", "grpo", "held-out accuracy"):
        assert word in result.output


def test_a_monitor_that_stops_an_rl_stage_stops_the_pipeline(
    pipeline_dir: Path, tiny_model_dir: Path
) -> None:
    (pipeline_dir / "const.py").write_text("def const(completion, **_):\n    return 1.0\n")
    rl = {
        "task": {"source": "arithmetic", "arithmetic": {"digits": 1}},
        "rewards": [{"fn": "const.py:const", "name": "const"}],
        "sampling": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 4},
        "train": {"steps": 12},
        "eval": {"at_start": False, "at_end": False},
        "monitors": {"echo_trap": {"action": "stop"}},
        "tracking": {"trackio": False, "progress": False},
    }
    cfg = PipelineConfig.model_validate(
        {
            "model": str(tiny_model_dir),
            "output_dir": str(pipeline_dir / "stop_run"),
            "eval": {"each_stage": False},
            "stages": [{"name": "rl", "kind": "rl", "config": rl}],
        }
    )
    with pytest.raises(ConfigError, match="stopped by a monitor") as err:
        run_pipeline(cfg, config_dir=pipeline_dir, echo=lambda _: None)
    assert "echo_trap/zero_variance" in str(err.value)
    assert not (pipeline_dir / "stop_run" / "rl" / "stage.json").exists()


def test_a_typo_in_a_late_stage_fails_before_anything_trains(pipeline_dir: Path) -> None:
    data = yaml.safe_load((pipeline_dir / "tiny_pipeline.yaml").read_text())
    data["stages"][2]["config"]["train"]["stepz"] = 3
    (pipeline_dir / "typo.yaml").write_text(yaml.safe_dump(data))
    cfg = load_pipeline_config(pipeline_dir / "typo.yaml")
    with pytest.raises(ConfigError, match=r"stage 'grpo': unknown key 'train\.stepz'"):
        run_pipeline(cfg, config_dir=pipeline_dir, echo=lambda _: None)
    assert not (pipeline_dir / "run" / "sft").exists()
