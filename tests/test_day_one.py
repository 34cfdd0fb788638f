"""Day-one papercuts (issue 19, item 5): YAML's `off` for a text choice, eval options for a
user's env file, and eval.n larger than the held-out split. (`rlvr --version`: tests/test_export.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlvr.config import load_config
from rlvr.errors import ConfigError
from rlvr.evaluate_cli import run_eval, with_task
from rlvr.offline.config import SFTConfig, load_stage_config


def test_set_takes_the_text_where_the_field_is_a_text_choice() -> None:
    cfg = load_config(None, ["model.bf16=off", "model.name=123", "train.fused_logprobs=off"])
    assert cfg.model.bf16 == "off"  # YAML read False; the field is a choice of auto/on/off
    assert cfg.model.name == "123"  # YAML read an int; the field is a str
    assert cfg.train.fused_logprobs is False  # bool | "auto": YAML's False is a valid value
    assert load_config(None, ["model.bf16=on"]).model.bf16 == "on"
    with pytest.raises(ConfigError, match=r"'train\.steps'"):
        load_config(None, ["train.steps=off"])  # an int field still refuses text


def test_a_config_files_off_means_off_for_a_text_choice(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  bf16: off\n  lora: {enabled: yes}\n")
    cfg = load_config(path)
    assert cfg.model.bf16 == "off" and cfg.model.lora.enabled is True
    stage = tmp_path / "sft.yaml"
    stage.write_text(
        "model: {name: tiny-random, bf16: off}\ndata: {path: x.jsonl}\noutput_dir: o\n"
    )
    assert load_stage_config(SFTConfig, stage).model.bf16 == "off"
    assert load_stage_config(SFTConfig, stage, ["model.bf16=on"]).model.bf16 == "on"


SMALL_FAMILY = '''
from rlvr.envs import EnvFamily, SingleTurnEnv
from rlvr.records import Task


class Few(EnvFamily):
    """Only 60 distinct instances: far fewer than the 2000 train instances an env asks by default."""

    name = "few"
    description = "Say a number."
    success_metric = "said"

    def generate(self, seed):
        k = seed % 60
        return Task(id=f"few:{k}", messages=({"role": "user", "content": f"Say {k}."},))

    def make(self, task):
        return SingleTurnEnv(task)
'''


def test_eval_of_an_env_file_takes_env_options_and_needs_no_train_split(tmp_path: Path) -> None:
    (tmp_path / "few.py").write_text(SMALL_FAMILY)
    base = load_config(None)
    cfg, _ = with_task(base, f"env:{tmp_path / 'few.py'}:Few", ["task.env.num_heldout=3"])
    assert cfg.task.env is not None
    assert cfg.task.env.num_heldout == 3 and cfg.task.env.num_train == 1
    with pytest.raises(ConfigError, match=r"unknown key 'task\.env\.num_heldouts'"):
        with_task(base, f"env:{tmp_path / 'few.py'}:Few", ["task.env.num_heldouts=3"])


def test_eval_n_above_the_held_out_split_says_it_was_cut(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "few.py").write_text(SMALL_FAMILY)
    with pytest.warns(UserWarning, match="eval.n=50 but the task has 3 held-out tasks"):
        results = run_eval(
            str(tiny_model_dir),
            task=f"env:{tmp_path / 'few.py'}:Few",
            n=50,
            k=1,
            max_new_tokens=2,
            temperature=1.0,
            overrides=["task.env.num_heldout=3", "model.bf16=off"],
        )
    assert results["eval/n"] == 3.0
