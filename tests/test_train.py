"""End-to-end runs of the loop on the tiny model: learning, exact resume, LoRA and KL, eval of a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlvr.config import RunConfig, load_config
from rlvr.observe.metrics import WALL_CLOCK_METRICS
from rlvr.observe.tracking import read_metrics
from rlvr.train.loop import train

# Runs the loop with model.bf16: auto, so its numbers depend on the CPU kind (tests/conftest.py).
pytestmark = pytest.mark.precision

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TIMING_KEYS = WALL_CLOCK_METRICS


def tiny_cfg(config_dir: Path, model_dir: Path, out: Path, *overrides: str) -> RunConfig:
    return load_config(
        config_dir / "tiny.yaml",
        [f"model.name={model_dir}", f"output_dir={out}", "tracking.progress=false", *overrides],
    )


@pytest.mark.slow
def test_grpo_learns_the_tiny_task(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The tiny model is rewarded for answering in digits; 30 seeded GRPO steps must move reward a lot."""
    cfg = tiny_cfg(tiny_config_dir, tiny_model_dir, tmp_path / "run", "train.seed=1")
    summary = train(cfg, config_dir=tiny_config_dir)
    steps = [m for m in read_metrics(summary.run_dir) if "reward" in m]
    first = sum(m["reward"] for m in steps[:5]) / 5
    last = sum(m["reward"] for m in steps[-5:]) / 5
    # A random char-level model writes ~10% digits (10 of ~100 characters); learning must reach far more.
    assert first < 0.3
    assert last > first + 0.4, (first, last)
    before, after = summary.eval_history[0][1], summary.eval_history[-1][1]
    assert after["eval/accuracy"] > before["eval/accuracy"] + 0.4


def test_resume_reproduces_the_uninterrupted_run(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    common = ("train.steps=6", "checkpoint.every=3", "eval.every=0", "eval.n=4")
    full = train(
        tiny_cfg(tiny_config_dir, tiny_model_dir, tmp_path / "full", *common),
        config_dir=tiny_config_dir,
    )

    class Stop(Exception):
        pass

    def stop_after_3(step: int, _metrics: dict[str, object]) -> None:
        if step == 3:
            raise Stop

    cfg = tiny_cfg(tiny_config_dir, tiny_model_dir, tmp_path / "split", *common)
    with pytest.raises(Stop):
        train(cfg, config_dir=tiny_config_dir, on_step_end=stop_after_3)
    assert (tmp_path / "split" / "checkpoints" / "step-000003" / "optimizer.pt").exists()
    train(cfg, resume=True, config_dir=tiny_config_dir)

    def by_step(run: Path) -> dict[int, dict[str, object]]:
        rows: dict[int, dict[str, object]] = {}
        for m in read_metrics(run):
            rows.setdefault(m["step"], {}).update(
                {k: v for k, v in m.items() if k not in TIMING_KEYS}
            )
        return rows

    a, b = by_step(full.run_dir), by_step(tmp_path / "split")
    assert sorted(a) == sorted(b) == list(range(7))
    for step in (4, 5, 6):
        assert a[step] == b[step], f"step {step} differs after resume"
    # The final weights are identical too.
    wa = torch.load(
        full.run_dir / "checkpoints" / "step-000006" / "optimizer.pt", weights_only=False
    )
    wb = torch.load(
        tmp_path / "split" / "checkpoints" / "step-000006" / "optimizer.pt", weights_only=False
    )
    for sa, sb in zip(wa["state"].values(), wb["state"].values(), strict=True):
        assert torch.equal(sa["exp_avg"], sb["exp_avg"])


def test_full_finetune_with_kl_changes_every_parameter(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from rlvr.build import build_policy

    cfg = tiny_cfg(
        tiny_config_dir,
        tiny_model_dir,
        tmp_path / "kl",
        "train.steps=3",
        "objective.beta=0.1",
        "eval.at_start=false",
        "eval.at_end=false",
    )
    before = {k: v.clone() for k, v in build_policy(cfg).model.state_dict().items()}
    summary = train(cfg, config_dir=tiny_config_dir)
    rows = [m for m in read_metrics(summary.run_dir) if "loss" in m]
    assert all("kl" in m and m["kl"] >= 0 for m in rows)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # step 1: policy == reference
    assert rows[-1]["kl"] > 0
    from safetensors.torch import load_file

    after = load_file(
        str(summary.run_dir / "checkpoints" / "step-000003" / "model" / "model.safetensors")
    )
    for name, value in after.items():
        assert not torch.equal(value, before[name]), f"{name} did not change"


def test_lora_trains_adapters_only_and_uses_disabled_adapters_as_reference(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = tiny_cfg(
        tiny_config_dir,
        tiny_model_dir,
        tmp_path / "lora",
        "train.steps=3",
        "objective.beta=0.1",
        "model.lora.enabled=true",
        "model.lora.r=4",
        "train.learning_rate=1e-2",
        "eval.at_start=false",
        "eval.at_end=false",
    )
    summary = train(cfg, config_dir=tiny_config_dir)
    model_dir = summary.run_dir / "checkpoints" / "step-000003" / "model"
    assert (model_dir / "adapter_config.json").exists()
    assert not (model_dir / "model.safetensors").exists()  # only the adapter is saved
    rows = [m for m in read_metrics(summary.run_dir) if "loss" in m]
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # LoRA B starts at 0: policy == base
    assert rows[-1]["kl"] > 0


def test_eval_command_reads_a_run_directory(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlvr.evaluate_cli import run_eval

    cfg = tiny_cfg(
        tiny_config_dir, tiny_model_dir, tmp_path / "run", "train.steps=2", "eval.at_start=false"
    )
    summary = train(cfg, config_dir=tiny_config_dir)
    results = run_eval(
        str(summary.run_dir), task="arithmetic", n=4, k=2, max_new_tokens=8, temperature=1.0
    )
    assert 0.0 <= results["eval/accuracy"] <= 1.0
    assert "eval/mean@2" in results and "eval/pass@2" in results
    printed = capsys.readouterr().out
    assert json.loads(printed.strip().splitlines()[-1])["eval/n"] == 4.0


def test_train_on_an_in_memory_hf_dataset(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import datasets

    from rlvr.config import DatasetConfig
    from rlvr.tasks import dataset_tasks

    rows = datasets.Dataset.from_list(
        [{"question": f"Say {i}", "target": str(i), "id": f"q{i}"} for i in range(40)]
    )
    splits = dataset_tasks(
        DatasetConfig(path="in-memory", prompt_column="question", answer_column="target"), rows=rows
    )
    cfg = tiny_cfg(tiny_config_dir, tiny_model_dir, tmp_path / "ds", "train.steps=2", "eval.n=3")
    summary = train(cfg, config_dir=tiny_config_dir, tasks=splits)
    seen = {json.loads(line)["task_id"] for line in (summary.run_dir / "rollouts.jsonl").open()}
    assert seen and seen <= {t.id for t in splits.train}


def test_skipping_zero_advantage_rows_leaves_the_update_unchanged(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two runs, one forwarding every row and one skipping rows with A = 0: identical weights."""
    from safetensors.torch import load_file

    weights = {}
    for skip in (True, False):
        cfg = tiny_cfg(
            tiny_config_dir,
            tiny_model_dir,
            tmp_path / f"skip-{skip}",
            f"train.skip_zero_advantage_rows={str(skip).lower()}",
            "eval.at_start=false",
            "eval.at_end=false",
            "train.micro_batch_size=4",
            "train.steps=4",
            'rewards=[{fn: regex_format, name: has_digit, options: {pattern: "[0-9]"}}]',
            "eval.metric=has_digit",
        )
        summary = train(cfg, config_dir=tiny_config_dir)
        rows = [m for m in read_metrics(summary.run_dir) if "loss" in m]
        if skip:
            # ~80% of 16-character random completions hold a digit, so some groups of 8 are all 1
            # (zero variance, skipped) and others are mixed (forwarded).
            fractions = [m["update/rows_forwarded_frac"] for m in rows]
            assert min(fractions) < 1.0 and max(fractions) > 0.0, fractions
        model_file = summary.run_dir / "checkpoints" / "step-000004" / "model" / "model.safetensors"
        weights[skip] = load_file(str(model_file))
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    assert any(not torch.equal(initial[k], weights[True][k]) for k in initial)  # it did train
    for name in weights[True]:
        torch.testing.assert_close(weights[True][name], weights[False][name], rtol=1e-5, atol=1e-7)


def test_cli_resume_without_config_uses_the_saved_one(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from rlvr.cli import app

    run = tmp_path / "cli-run"
    common = ["--set", f"model.name={tiny_model_dir}", "--set", "tracking.progress=false"]
    first = CliRunner().invoke(
        app,
        [
            "train",
            str(tiny_config_dir / "tiny.yaml"),
            "--output-dir",
            str(run),
            "--set",
            "train.steps=2",
            "--set",
            "eval.n=2",
            *common,
        ],
    )
    assert first.exit_code == 0, first.output
    again = CliRunner().invoke(app, ["train", "--resume", str(run), "--set", "train.steps=3"])
    assert again.exit_code == 0, again.output
    steps = [m["step"] for m in read_metrics(run) if "loss" in m]
    assert steps == [1, 2, 3]
    assert "steps: 3" in (run / "config.yaml").read_text()  # the effective config is saved


@pytest.mark.slow
def test_multi_turn_grpo_learns_the_tiny_dialogue(tiny_model_dir: Path, tmp_path: Path) -> None:
    """examples/tiny_multiturn.yaml: three turns with user observations between them; turn-level
    credit must raise the reward (share of digits per turn) well above the random model's."""
    for name in ("tiny_multiturn.yaml", "tiny_envs.py"):
        (tmp_path / name).write_text((EXAMPLES / name).read_text())
    cfg = load_config(
        tmp_path / "tiny_multiturn.yaml",
        [
            f"model.name={tiny_model_dir}",
            f"output_dir={tmp_path / 'run'}",
            "tracking.progress=false",
        ],
    )
    summary = train(cfg, config_dir=tmp_path)
    steps = [m for m in read_metrics(summary.run_dir) if "reward" in m]
    assert all(m["turns/mean"] > 2.5 for m in steps)  # the episodes really are multi-turn
    assert "tools/call_frequency" in steps[0]
    first = sum(m["reward"] for m in steps[:5]) / 5
    last = sum(m["reward"] for m in steps[-5:]) / 5
    assert first < 0.3
    assert last > first + 0.3, (first, last)
    before, after = summary.eval_history[0][1], summary.eval_history[-1][1]
    assert after["eval/accuracy"] > before["eval/accuracy"] + 0.3
    # Token-level trajectories were saved for `rlvr inspect`.
    assert (summary.run_dir / "trajectories" / f"step_{cfg.train.steps:06d}.jsonl").is_file()


def test_eval_command_on_a_built_in_env(tiny_model_dir: Path) -> None:
    from rlvr.errors import ConfigError
    from rlvr.evaluate_cli import run_eval

    results = run_eval(
        str(tiny_model_dir), task="env:bandit", n=3, k=1, max_new_tokens=8, temperature=1.0
    )
    assert results["eval/n"] == 3.0 and results["eval/turns"] == 1.0
    assert results["eval/accuracy"] in (0.0, 1 / 3, 2 / 3, 1.0)
    with pytest.raises(ConfigError, match="expected arithmetic, env:NAME"):
        run_eval(str(tiny_model_dir), task="bandit", n=3, k=1, max_new_tokens=8, temperature=1.0)


def test_time_limit_stops_after_the_step_that_crosses_it(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A budget shorter than one step: the run ends after step 1 with a checkpoint and a final eval,
    and resuming continues from there."""
    out = tmp_path / "limited"
    cfg = tiny_cfg(
        tiny_config_dir, tiny_model_dir, out, "train.steps=5", "train.time_limit_minutes=0.0001"
    )
    summary = train(cfg, config_dir=tiny_config_dir)
    assert summary.time_limited and summary.steps_done == 1 and not summary.stopped_early
    assert (out / "checkpoints" / "step-000001" / "optimizer.pt").exists()
    assert summary.eval_history[-1][0] == 1  # the final eval ran, at step 1
    resumed = train(
        load_config(out / "config.yaml", ["train.time_limit_minutes=null"]),
        resume=True,
        config_dir=tiny_config_dir,
    )
    assert resumed.steps_done == 5 and not resumed.time_limited
