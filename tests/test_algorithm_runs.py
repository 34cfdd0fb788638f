"""Every `algorithm:` runs end to end on the tiny model: finite loss, every trainable weight moves;
PPO's critic learns; KL-in-reward, truncated IS and overlong shaping reach the metrics; PPO and RLOO
learn the tiny task (slow)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlvr.algorithms import ALGORITHMS
from rlvr.config import RunConfig, load_config
from rlvr.observe.tracking import read_metrics
from rlvr.train.loop import train

# Runs the loop with model.bf16: auto, so its numbers depend on the CPU kind (tests/conftest.py).
pytestmark = pytest.mark.precision

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
QUICK = ["train.steps=2", "eval.at_start=false", "eval.at_end=false", "tracking.progress=false"]


def tiny_cfg(config_dir: Path, model_dir: Path, out: Path, *overrides: str) -> RunConfig:
    return load_config(
        config_dir / "tiny.yaml", [f"model.name={model_dir}", f"output_dir={out}", *overrides]
    )


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny model after 30 SFT steps on examples/tiny_sft.jsonl (it answers in digits): same
    tokenizer as the student, a clearly different and learnable distribution to distil."""
    from rlvr.offline import train_sft
    from rlvr.offline.config import SFTConfig

    result = train_sft(
        SFTConfig.model_validate(
            {
                "model": {"name": str(tiny_model_dir)},
                "data": {"path": str(EXAMPLES / "tiny_sft.jsonl"), "heldout_fraction": 0.0},
                "train": {
                    "steps": 30,
                    "batch_size": 16,
                    "micro_batch_size": 16,
                    "learning_rate": 3e-3,
                    "max_length": 64,
                },
                "output_dir": str(tmp_path_factory.mktemp("teacher") / "sft"),
            }
        )
    )
    return result.model_dir


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_moves_every_weight_with_a_finite_loss(
    algorithm: str,
    tiny_config_dir: Path,
    tiny_model_dir: Path,
    teacher_dir: Path,
    tmp_path: Path,
) -> None:
    extra = [f"distill.teacher={teacher_dir}"] if algorithm == "distill" else []
    cfg = tiny_cfg(
        tiny_config_dir,
        tiny_model_dir,
        tmp_path / algorithm,
        f"algorithm={algorithm}",
        *QUICK,
        *extra,
    )
    before = {k: v.clone() for k, v in _weights(tiny_model_dir).items()}
    summary = train(cfg, config_dir=tiny_config_dir)
    rows = [m for m in read_metrics(summary.run_dir) if "loss" in m]
    assert len(rows) == 2
    assert all(math.isfinite(m["loss"]) for m in rows), rows
    after = _weights(summary.run_dir / "checkpoints" / "step-000002" / "model")
    unchanged = [k for k, v in after.items() if torch.equal(v, before[k])]
    assert not unchanged, f"{algorithm}: {unchanged} did not change"
    if algorithm == "ppo":
        assert all(math.isfinite(m["critic/value_loss"]) for m in rows)
    if algorithm == "distill":
        assert all(m["distill/reverse_kl"] > 0 for m in rows)


def test_kl_in_the_reward_is_measured_and_lowers_the_advantage_input(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = tiny_cfg(
        tiny_config_dir,
        tiny_model_dir,
        tmp_path / "klr",
        "algorithm=reinforce_pp",
        "objective.beta=0.5",
        *QUICK,
        "train.steps=3",
    )
    assert cfg.objective.kl_in_reward
    summary = train(cfg, config_dir=tiny_config_dir)
    rows = [m for m in read_metrics(summary.run_dir) if "loss" in m]
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-4)  # step 1: policy == reference
    assert rows[-1]["kl"] > 0


def test_truncated_importance_sampling_weights_are_logged(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = tiny_cfg(
        tiny_config_dir, tiny_model_dir, tmp_path / "tis", "objective.tis_cap=2.0", *QUICK
    )
    summary = train(cfg, config_dir=tiny_config_dir)
    rows = [m for m in read_metrics(summary.run_dir) if "loss" in m]
    # Generator and trainer are the same model in fp32: pi_old / pi_behaviour ~ 1, never capped.
    assert all(m["update/tis_weight_mean"] == pytest.approx(1.0, abs=1e-3) for m in rows)
    assert all(m["update/tis_capped_frac"] == 0.0 for m in rows)


def test_dapo_overlong_shaping_and_filtering(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # A random char model rarely stops on its own within 16 tokens: most rows are cut off.
    cfg = tiny_cfg(
        tiny_config_dir,
        tiny_model_dir,
        tmp_path / "dapo",
        "algorithm=dapo",
        "objective.mask_truncated=true",
        "filter.dynamic_sampling=false",
        *QUICK,
    )
    summary = train(cfg, config_dir=tiny_config_dir)
    rows = [m for m in read_metrics(summary.run_dir) if "overlong/penalty_mean" in m]
    assert rows and all(m["overlong/penalty_mean"] < 0 for m in rows)
    assert all(m["overlong/penalised_frac"] > 0.5 for m in rows)
    # Truncated rows got no loss: fewer rows trained than sampled.
    batch = cfg.sampling.group_size * cfg.sampling.prompts_per_step
    assert all(m.get("update/rows_trained", 0) < batch for m in rows)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ppo", "rloo"])
def test_ppo_and_rloo_learn_the_tiny_task(
    algorithm: str, tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Seeded, like the GRPO learning test: the digit-fraction reward must rise by a wide margin."""
    cfg = tiny_cfg(
        tiny_config_dir,
        tiny_model_dir,
        tmp_path / algorithm,
        f"algorithm={algorithm}",
        "train.seed=1",
        "tracking.progress=false",
        "critic.learning_rate=3e-3",
    )
    summary = train(cfg, config_dir=tiny_config_dir)
    steps = [m for m in read_metrics(summary.run_dir) if "reward" in m]
    first = sum(m["reward"] for m in steps[:5]) / 5
    last = sum(m["reward"] for m in steps[-5:]) / 5
    assert first < 0.3
    assert last > first + 0.4, (algorithm, first, last)
    before, after = summary.eval_history[0][1], summary.eval_history[-1][1]
    assert after["eval/accuracy"] > before["eval/accuracy"] + 0.3


def test_ppo_resume_restores_the_critic_exactly(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A ppo run stopped at step 2 and resumed ends with the same critic and metrics as one that
    never stopped (critic weights and its optimizer live in the checkpoint)."""
    common = ("algorithm=ppo", "train.steps=4", "checkpoint.every=2", *QUICK[1:])

    class Stop(Exception):
        pass

    def stop_after_2(step: int, _metrics: dict[str, object]) -> None:
        if step == 2:
            raise Stop

    full = train(
        tiny_cfg(tiny_config_dir, tiny_model_dir, tmp_path / "full", *common),
        config_dir=tiny_config_dir,
    )
    cfg = tiny_cfg(tiny_config_dir, tiny_model_dir, tmp_path / "split", *common)
    with pytest.raises(Stop):
        train(cfg, config_dir=tiny_config_dir, on_step_end=stop_after_2)
    train(cfg, resume=True, config_dir=tiny_config_dir)

    def critic_loss(run: Path) -> list[float]:
        return [m["critic/value_loss"] for m in read_metrics(run) if "critic/value_loss" in m]

    assert critic_loss(full.run_dir) == critic_loss(tmp_path / "split")
    last = Path("checkpoints") / "step-000004" / "critic" / "critic.safetensors"
    a, b = load_file(str(full.run_dir / last)), load_file(str(tmp_path / "split" / last))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_on_policy_distillation_pulls_the_student_towards_the_teacher(
    tiny_config_dir: Path, tiny_model_dir: Path, teacher_dir: Path, tmp_path: Path
) -> None:
    """The reverse KL to the teacher, measured on the student's own samples, falls by more than half."""
    cfg = tiny_cfg(
        tiny_config_dir,
        tiny_model_dir,
        tmp_path / "distill",
        "algorithm=distill",
        f"distill.teacher={teacher_dir}",
        "train.steps=12",
        "train.seed=1",
        *QUICK[1:],
    )
    summary = train(cfg, config_dir=tiny_config_dir)
    rows = [m for m in read_metrics(summary.run_dir) if "loss" in m]
    kl = [m["distill/reverse_kl"] for m in rows]
    assert len(kl) == 12
    # Measured: 1.55 -> 0.27 over the 12 steps.
    assert sum(kl[-3:]) / 3 < 0.5 * sum(kl[:3]) / 3, kl
    # The teacher answers in digits; so, now, does the student (the task reward, never optimised).
    reward = [m["reward"] for m in rows]
    assert sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.2, reward


def test_ppo_runs_on_multi_turn_episodes_with_observations_masked(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    for name in ("tiny_multiturn.yaml", "tiny_envs.py"):
        (tmp_path / name).write_text((EXAMPLES / name).read_text())
    cfg = load_config(
        tmp_path / "tiny_multiturn.yaml",
        [
            f"model.name={tiny_model_dir}",
            f"output_dir={tmp_path / 'run'}",
            "algorithm=ppo",
            "objective.credit=trajectory",
            *QUICK,
        ],
    )
    summary = train(cfg, config_dir=tmp_path)
    rows = [m for m in read_metrics(summary.run_dir) if "loss" in m]
    assert all(m["turns/mean"] > 2.5 for m in rows)
    assert all(math.isfinite(m["critic/value_loss"]) and math.isfinite(m["loss"]) for m in rows)
