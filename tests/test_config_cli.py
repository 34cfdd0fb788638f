"""Bad input gives one clear line naming the problem: from `load_config` and from the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlvr.config import RunConfig, load_config
from rlvr.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def config_error(tmp_path: Path, text: str | None, overrides: list[str] | None = None) -> str:
    """The one-line message of the ConfigError that loading `text` (None: no file) raises."""
    path = None
    if text is not None:
        path = tmp_path / "run.yaml"
        path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    message = str(err.value)
    assert message.strip() and "\n" not in message, message
    return message


# --- load_config: bad files ---
def test_malformed_yaml_names_the_line(tmp_path: Path) -> None:
    message = config_error(tmp_path, "train:\n  steps: 10\n  learning_rate: : 3\n")
    assert "run.yaml" in message
    assert "line 3" in message
    assert "malformed YAML" in message


def test_malformed_yaml_unclosed_bracket(tmp_path: Path) -> None:
    message = config_error(tmp_path, "rewards: [\n  {fn: numeric_match}\nsampling: {}\n")
    assert "malformed YAML" in message
    assert "line " in message


def test_unknown_key_names_its_full_path(tmp_path: Path) -> None:
    message = config_error(tmp_path, "train:\n  stepz: 10\n")
    assert "unknown key 'train.stepz'" in message


def test_unknown_top_level_section(tmp_path: Path) -> None:
    assert "unknown key 'trainer'" in config_error(tmp_path, "trainer:\n  steps: 10\n")


def test_unknown_key_inside_a_list_item(tmp_path: Path) -> None:
    message = config_error(tmp_path, "rewards:\n  - {fn: numeric_match, wieght: 2}\n")
    assert "unknown key 'rewards.0.wieght'" in message


def test_wrong_type_names_the_field_and_the_value(tmp_path: Path) -> None:
    message = config_error(tmp_path, 'train:\n  steps: "ten"\n')
    assert "'train.steps'" in message
    assert "'ten'" in message
    assert "integer" in message


def test_out_of_range_value_names_the_field(tmp_path: Path) -> None:
    message = config_error(tmp_path, "sampling:\n  group_size: 1\n")
    assert "'sampling.group_size'" in message
    assert "2" in message


def test_section_given_as_a_scalar(tmp_path: Path) -> None:
    message = config_error(tmp_path, "train: 5\n")
    assert "'train'" in message


def test_literal_violation_lists_allowed_values(tmp_path: Path) -> None:
    message = config_error(tmp_path, "objective:\n  kl_estimator: k9\n")
    assert "'objective.kl_estimator'" in message
    assert "'k9'" in message
    for allowed in ("k1", "k2", "k3"):
        assert allowed in message


def test_literal_violation_inside_a_list(tmp_path: Path) -> None:
    message = config_error(tmp_path, "task:\n  arithmetic:\n    operations: ['+', '/']\n")
    assert "task.arithmetic.operations.1" in message
    assert "'/'" in message
    assert "'+'" in message and "'*'" in message


@pytest.mark.parametrize(
    ("text", "kind"), [("- train\n- eval\n", "list"), ("just a string\n", "str"), ("42\n", "int")]
)
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str, kind: str) -> None:
    message = config_error(tmp_path, text)
    assert "top level must be a mapping" in message
    assert kind in message


def test_empty_file_gives_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing here\n")
    assert load_config(path) == RunConfig()


def test_missing_config_file_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "run.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(missing)
    assert str(missing) in str(err.value)
    assert "does not exist" in str(err.value)


def test_dataset_source_without_dataset_section(tmp_path: Path) -> None:
    message = config_error(tmp_path, "task:\n  source: dataset\n")
    assert "task.dataset" in message
    assert "path" in message


def test_dataset_section_without_path(tmp_path: Path) -> None:
    message = config_error(tmp_path, "task:\n  source: dataset\n  dataset: {split: train}\n")
    assert "'task.dataset.path'" in message


def test_duplicate_reward_names(tmp_path: Path) -> None:
    text = "rewards:\n  - {fn: numeric_match, name: r}\n  - {fn: exact_match, name: r}\n"
    message = config_error(tmp_path, text)
    assert "unique" in message and "r" in message


def test_example_configs_load() -> None:
    cfg = load_config(EXAMPLES / "tiny.yaml")
    assert cfg.model.name == "tiny-random"
    assert cfg.tracking.trackio is False


# --- load_config: --set overrides ---
def test_overrides_apply_on_top_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  steps: 30\n  learning_rate: 3.0e-3\ntracking:\n  trackio: true\n")
    cfg = load_config(
        path,
        [
            "train.steps=5",
            "tracking.trackio=false",
            'sampling.stop=["\\n", "</answer>"]',
            "output_dir=x/y",
        ],
    )
    assert cfg.train.steps == 5
    assert cfg.train.learning_rate == 3.0e-3  # untouched keys keep the file's value
    assert cfg.tracking.trackio is False
    assert cfg.sampling.stop == ["\n", "</answer>"]  # a YAML value
    assert cfg.output_dir == "x/y"


def test_override_value_keeps_everything_after_the_first_equals_sign() -> None:
    cfg = load_config(None, ["task.arithmetic.prompt=a=b {a} {op} {b}"])
    assert cfg.task.arithmetic.prompt == "a=b {a} {op} {b}"


def test_override_creates_nested_sections(tmp_path: Path) -> None:
    cfg = load_config(None, ["task.source=dataset", "task.dataset.path=data.jsonl"])
    assert cfg.task.dataset is not None
    assert cfg.task.dataset.path == "data.jsonl"
    assert cfg.task.dataset.answer_column == "answer"  # the rest of the new section is defaults
    # A section left empty (null) in the file is filled the same way.
    path = tmp_path / "run.yaml"
    path.write_text("model:\n")
    cfg = load_config(path, ["model.lora.r=4", "model.lora.enabled=true"])
    assert cfg.model.lora.r == 4
    assert cfg.model.lora.enabled is True
    assert cfg.model.name == RunConfig().model.name


def test_override_without_equals_sign_raises() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["foo"])
    message = str(err.value)
    assert "'foo'" in message
    assert "key=value" in message
    assert "\n" not in message


def test_override_of_an_unknown_key_is_an_error(tmp_path: Path) -> None:
    message = config_error(tmp_path, None, ["train.stepz=3"])
    assert "unknown key 'train.stepz'" in message


def test_override_into_a_non_section(tmp_path: Path) -> None:
    message = config_error(tmp_path, None, ["train.steps=3", "train.steps.max=4"])
    assert "'train.steps.max=4'" in message
    assert "'steps' is not a section" in message


def test_override_with_a_wrong_type(tmp_path: Path) -> None:
    message = config_error(tmp_path, None, ["train.steps=ten"])
    assert "'train.steps'" in message
    assert "'ten'" in message


# --- the CLI, in a subprocess ---
def cli_env(tmp_path: Path) -> dict[str, str]:
    """Caches inside tmp_path; wide, plain output."""
    return {
        **os.environ,
        "RLVR_CACHE": str(tmp_path / "rlvr-cache"),
        "HF_HOME": str(tmp_path / "hf"),
        "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets"),
        "COLUMNS": "200",
        "NO_COLOR": "1",
        "TERM": "dumb",
    }


def rlvr(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlvr.cli", *args],
        cwd=tmp_path,
        env=cli_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_user_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 2, no traceback, the last stderr line is `error: ...` and names each needle."""
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    last = lines[-1]
    assert last.startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in last, last
    return last


def tiny_config(tmp_path: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """examples/tiny.yaml and its reward file copied to tmp_path, made small, `sections` merged."""
    shutil.copy(EXAMPLES / "tiny_rewards.py", tmp_path / "tiny_rewards.py")
    cfg = yaml.safe_load((EXAMPLES / "tiny.yaml").read_text())
    small = {
        "sampling": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4},
        "train": {"steps": 2, "micro_batch_size": 4},
        "eval": {"at_start": False, "at_end": False, "n": 2},
        "checkpoint": {"save_final": False},
        "tracking": {"trackio": False, "progress": False},
    }
    for name, values in {**small, **sections}.items():
        if isinstance(values, dict) and isinstance(cfg.get(name), dict):
            cfg[name] = {**cfg[name], **values}
        else:
            cfg[name] = values
    cfg["output_dir"] = str(tmp_path / "run")
    assert cfg["tracking"]["trackio"] is False
    return cfg


def write_config(tmp_path: Path, cfg: dict[str, Any] | str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(cfg if isinstance(cfg, str) else yaml.safe_dump(cfg, sort_keys=False))
    return str(path)


def test_cli_malformed_yaml(tmp_path: Path) -> None:
    config = write_config(
        tmp_path, "tracking: {trackio: false}\ntrain:\n  steps: [1, 2\n  seed: 0\n"
    )
    assert_user_error(rlvr(tmp_path, "train", config), "cfg.yaml", "malformed YAML", "line ")


def test_cli_unknown_key(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path)
    cfg["train"]["stepz"] = 3
    assert_user_error(rlvr(tmp_path, "train", write_config(tmp_path, cfg)), "'train.stepz'")
    assert not (tmp_path / "run").exists()  # nothing written for a config that does not load


def test_cli_wrong_type(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path)
    cfg["train"]["steps"] = "ten"
    assert_user_error(rlvr(tmp_path, "train", write_config(tmp_path, cfg)), "'train.steps'", "ten")


def test_cli_dataset_without_the_answer_column(tmp_path: Path) -> None:
    rows = [{"question": f"{i} + 1 = ?", "solution": str(i + 1)} for i in range(20)]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny_config(
        tmp_path,
        task={"source": "dataset", "dataset": {"path": "qa.jsonl", "prompt_column": "question"}},
    )
    last = assert_user_error(rlvr(tmp_path, "train", write_config(tmp_path, cfg)), "'answer'")
    assert "question" in last and "solution" in last  # the columns that are there


def test_cli_model_that_does_not_exist(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, model={"name": "/nonexistent/model"})
    assert_user_error(rlvr(tmp_path, "train", write_config(tmp_path, cfg)), "/nonexistent/model")


def test_cli_reward_that_raises_stops_the_run_and_keeps_its_metrics(tmp_path: Path) -> None:
    (tmp_path / "broken_rewards.py").write_text(
        "def always_fails(completion: str, **_: object) -> float:\n"
        "    raise ValueError('cannot score ' + repr(completion))\n"
    )
    cfg = tiny_config(tmp_path, rewards=[{"fn": "broken_rewards.py:always_fails", "name": "flaky"}])
    cfg["eval"]["metric"] = "flaky"
    proc = rlvr(tmp_path, "train", write_config(tmp_path, cfg))
    assert_user_error(proc, "'flaky'", "ValueError", "max_reward_error_fraction")

    # Every rollout of step 1 failed: the run stops there, after writing what it has.
    run_dir = tmp_path / "run"
    assert (run_dir / "config.yaml").exists()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    assert records[0]["rewards/flaky/errors"] > 0
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 4
    assert all("ValueError" in row["errors"]["flaky"] for row in rollouts)


# --- help ---
def rlvr_help(tmp_path: Path, *args: str) -> str:
    proc = rlvr(tmp_path, *args, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stdout


def test_help(tmp_path: Path) -> None:
    out = rlvr_help(tmp_path)
    assert "train" in out and "eval" in out
    assert "verifiable rewards" in out


def test_train_help(tmp_path: Path) -> None:
    out = rlvr_help(tmp_path, "train")
    assert "config" in out.lower()  # the argument (typer may print it in lower case)
    for option in ("--set", "--output-dir", "--resume"):
        assert option in out


def test_eval_help(tmp_path: Path) -> None:
    out = rlvr_help(tmp_path, "eval")
    assert "model" in out.lower()
    for option in ("--task", "--n", "--k", "--max-new-tokens", "--temperature"):
        assert option in out
