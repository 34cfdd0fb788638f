"""docs/extending.md runs as written: each recipe's files are extracted from the doc into a folder,
the recipe's own test passes, and the tiny model trains with the recipe named by `file.py:Name`
(an algorithm and a tracker, each one file: the "done when" of issue 37)."""

from __future__ import annotations

import inspect
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlvr.config import load_config
from rlvr.observe.tracking import read_metrics
from rlvr.registry import load_object
from rlvr.train.loop import train

DOC = Path(__file__).resolve().parent.parent / "docs" / "extending.md"
QUICK = [
    "eval.at_start=false",
    "eval.at_end=false",
    "tracking.progress=false",
    "model.bf16=off",
    "checkpoint.save_final=false",
]


def doc_files() -> dict[str, str]:
    """Every fenced block the doc marks `file=NAME`, by NAME."""
    found = re.findall(r"```\w+ file=(\S+)\n(.*?)```", DOC.read_text(), re.DOTALL)
    files = dict(found)
    assert len(files) == len(found), "two blocks of docs/extending.md write the same file"
    return files


def write_recipes(folder: Path) -> None:
    for name, text in doc_files().items():
        (folder / name).write_text(text)


def run_recipe_test(folder: Path, module: str, tmp_path: Path, monkeypatch: Any) -> int:
    """Call each test function of the recipe's test file (given `tmp_path` when it asks)."""
    monkeypatch.syspath_prepend(str(folder))  # the test imports its recipe by module name
    tests = load_object(f"{folder / module}:__dict__", what="recipe test")
    ran = 0
    for name, fn in tests.items():
        if name.startswith("test_") and callable(fn):
            wants = inspect.signature(fn).parameters
            fn(**({"tmp_path": tmp_path} if "tmp_path" in wants else {}))
            ran += 1
    return ran


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def recipe_config(folder: Path, recipe_yaml: str, model_dir: Path, out: Path, *extra: str) -> Any:
    """examples/tiny.yaml with the recipe's config block over it, as the file a user would write."""
    data = _merge(
        yaml.safe_load((folder / "tiny.yaml").read_text()),
        yaml.safe_load((folder / recipe_yaml).read_text()),
    )
    (folder / "run.yaml").write_text(yaml.safe_dump(data))
    overrides = [f"model.name={model_dir}", f"output_dir={out}", *QUICK, *extra]
    return load_config(folder / "run.yaml", overrides)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def test_every_recipe_file_is_written_and_each_recipe_has_a_test_and_a_config() -> None:
    names = set(doc_files())
    for recipe in ("short_grpo", "reverse_env", "units", "jsonl_tracker"):
        assert {f"{recipe}.py", f"test_{recipe}.py", f"{recipe}.yaml"} <= names, recipe


def test_an_algorithm_in_one_file_trains_the_tiny_model(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    write_recipes(tiny_config_dir)
    assert run_recipe_test(tiny_config_dir, "test_short_grpo.py", tmp_path, monkeypatch) == 1
    cfg = recipe_config(
        tiny_config_dir, "short_grpo.yaml", tiny_model_dir, tmp_path / "run", "train.steps=2"
    )
    # Named relative to the config, kept absolute: the saved config finds it from anywhere.
    assert cfg.algorithm == f"{(tiny_config_dir / 'short_grpo.py').resolve()}:SHORT_GRPO"
    assert cfg.objective.loss_aggregation == "token-mean"  # the algorithm's default applied
    train(cfg, config_dir=tiny_config_dir)
    by_step = losses(tmp_path / "run")
    assert sorted(by_step) == [1, 2] and all(math.isfinite(v) for v in by_step.values())
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["algorithm"] == cfg.algorithm


def test_an_unknown_algorithm_or_tracker_is_one_line_naming_the_field(
    tiny_config_dir: Path,
) -> None:
    from rlvr.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(tiny_config_dir / "tiny.yaml", ["algorithm=short_grpo"])
    assert "algorithm 'short_grpo' is not a known algorithm (one of: grpo," in str(err.value)
    assert "entry-point group rlvr.algorithms" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(tiny_config_dir / "tiny.yaml", ["tracking.report_to=[wandb, jsonl]"])
    assert "tracking.report_to 'jsonl' is not a known tracker (one of: trackio, wandb" in str(
        err.value
    )
    with pytest.raises(ConfigError, match=r"not an rlvr\.algorithms\.Algorithm"):
        load_config(tiny_config_dir / "tiny.yaml", ["algorithm=tiny_rewards.py:digit_fraction"])


def test_an_env_with_its_splits_trains_the_tiny_model(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    write_recipes(tiny_config_dir)
    assert run_recipe_test(tiny_config_dir, "test_reverse_env.py", tmp_path, monkeypatch) == 2
    cfg = recipe_config(
        tiny_config_dir, "reverse_env.yaml", tiny_model_dir, tmp_path / "run", "train.steps=2"
    )
    train(cfg, config_dir=tiny_config_dir)
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("rewards/letters/mean" in r for r in rows), rows[0].keys()


def test_a_reward_function_with_its_task_fields_trains_the_tiny_model(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    write_recipes(tiny_config_dir)
    assert run_recipe_test(tiny_config_dir, "test_units.py", tmp_path, monkeypatch) == 1
    cfg = recipe_config(
        tiny_config_dir, "units.yaml", tiny_model_dir, tmp_path / "run", "train.steps=2"
    )
    train(cfg, config_dir=tiny_config_dir)
    rows = [
        r for r in read_metrics(tmp_path / "run") if "step_time" in r
    ]  # every step (one with no signal has no loss)
    assert [r["step"] for r in rows] == [1, 2]
    # Scored, not errored: the unit column reached the function as a keyword.
    assert all(r["rewards/with_unit/errors"] == 0.0 for r in rows)
    assert all(math.isfinite(r["rewards/with_unit/mean"]) for r in rows)


def test_a_tracker_in_one_file_logs_a_run_and_its_resume_continues_it(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    write_recipes(tiny_config_dir)
    assert run_recipe_test(tiny_config_dir, "test_jsonl_tracker.py", tmp_path, monkeypatch) == 1
    run_dir = tmp_path / "run"
    cfg = recipe_config(
        tiny_config_dir,
        "jsonl_tracker.yaml",
        tiny_model_dir,
        run_dir,
        "train.steps=4",
        "checkpoint.every=2",
    )

    class Stop(Exception):
        pass

    def stop_after_3(step: int, _metrics: dict[str, object]) -> None:
        if step == 3:
            raise Stop

    # Stopped after step 3 was logged; the resume starts from the checkpoint of step 2, so step 3
    # is played (and logged) again: the tracker's file must hold it once.
    with pytest.raises(Stop):
        train(cfg, config_dir=tiny_config_dir, on_step_end=stop_after_3)
    run_id = json.loads((run_dir / "trackers.json").read_text())["jsonl"]["run_id"]
    train(cfg, resume=True, config_dir=tiny_config_dir)
    assert json.loads((run_dir / "trackers.json").read_text())["jsonl"]["run_id"] == run_id
    [log] = run_dir.glob("tracker-*.jsonl")  # one tracker run, continued
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == [1, 2, 3, 4]
    assert {r["step"]: r["loss"] for r in rows if "loss" in r} == pytest.approx(losses(run_dir))
