"""Bad input gets a one-line error that says what and where, before anything slow runs; failed
rollouts are counted and named by what failed (reward, env, tool), never hidden behind a 0%."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from rlvr.config import load_config
from rlvr.errors import ConfigError, RewardError
from rlvr.tasks import load_tasks
from rlvr.train.loop import train

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def dataset_tasks_of(tmp_path: Path, name: str, text: str) -> Any:
    (tmp_path / name).write_text(text)
    cfg = load_config(None, ["task.source=dataset", f"task.dataset.path={tmp_path / name}"])
    return load_tasks(cfg.task)


def one_line(err: pytest.ExceptionInfo[Exception]) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------------------------- datasets
def test_an_empty_dataset_file_says_it_has_no_rows(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        dataset_tasks_of(tmp_path, "empty.jsonl", "\n")
    assert "empty.jsonl' has no rows" in one_line(err)


def test_a_malformed_jsonl_line_names_the_file_and_line(tmp_path: Path) -> None:
    text = '{"prompt": "1+1", "answer": 2}\n{"prompt": "2+2", answer: 4}\n'
    with pytest.raises(ConfigError) as err:
        dataset_tasks_of(tmp_path, "bad.jsonl", text)
    assert "bad.jsonl line 2: invalid JSON" in one_line(err)


@pytest.mark.parametrize(
    ("prompt", "needle"),
    [
        ([{"role": "user"}], "message 1 must be an object with string 'role' and 'content'"),
        (["what is 1+1?"], "message 1 must be an object"),
        ([], "expected a non-empty list of chat messages"),
        ({"role": "user", "content": "hi"}, "must be a string or a list of chat messages"),
    ],
)
def test_wrongly_shaped_messages_name_the_row(tmp_path: Path, prompt: Any, needle: str) -> None:
    rows = [{"prompt": "fine", "answer": 1}, {"prompt": prompt, "answer": 2}]
    with pytest.raises(ConfigError) as err:
        dataset_tasks_of(tmp_path, "msgs.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    message = one_line(err)
    assert "msgs.jsonl' row 2" in message and needle in message


def test_a_row_without_the_prompt_field_is_named(tmp_path: Path) -> None:
    rows = [{"prompt": "fine", "answer": 1}, {"question": "?", "answer": 2}]
    with pytest.raises(ConfigError, match=r"row 2 has no 'prompt' field"):
        dataset_tasks_of(tmp_path, "rows.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


# ---------------------------------------------------------------------------------------------- envs
BROKEN_ENV = """
from rlvr.envs import Env, EnvFamily, EnvReset, EnvStep
from rlvr.records import Task


class BrokenEnv(Env):
    max_turns = 1

    def __init__(self, task):
        self.task = task

    def reset(self):
        return EnvReset([dict(m) for m in self.task.messages])

    def step(self, assistant_text):
        raise RuntimeError("the env broke")


class BrokenFamily(EnvFamily):
    name = "broken"
    description = "every step raises"
    success_metric = "digits"

    def generate(self, seed):
        return Task(id=f"b:{seed}", messages=({"role": "user", "content": f"Say {seed}."},))

    def make(self, task):
        return BrokenEnv(task)
"""


def env_cfg(tmp_path: Path, model_dir: Path, env_name: str, *overrides: str) -> Any:
    return load_config(
        EXAMPLES / "tiny_multiturn.yaml",
        [
            f"model.name={model_dir}",
            f"output_dir={tmp_path / 'run'}",
            f"task.env.name={env_name}",
            "task.env.num_train=8",
            "task.env.num_heldout=4",
            "tracking.progress=false",
            "sampling.prompts_per_step=2",
            "sampling.group_size=2",
            "eval.n=4",
            "model.bf16='off'",
            *overrides,
        ],
    )


def test_a_missing_env_file_is_called_an_env_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = env_cfg(tmp_path, tiny_model_dir, "missing_env.py:Family")
    with pytest.raises(ConfigError) as err:
        train(cfg, config_dir=tmp_path)
    message = one_line(err)
    assert message.startswith("env '") and "missing_env.py' not found" in message
    assert "reward" not in message


def test_env_failures_are_env_errors_in_training(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "broken_env.py").write_text(BROKEN_ENV)
    cfg = env_cfg(tmp_path, tiny_model_dir, "broken_env.py:BrokenFamily", "eval.at_start=false")
    with pytest.raises(RewardError) as err:
        train(cfg, config_dir=tmp_path)
    message = one_line(err)
    assert "(4 env errors)" in message
    assert "the env failed on task b:" in message and "RuntimeError: the env broke" in message
    assert "reward 'env'" not in message


def test_a_base_eval_where_every_rollout_failed_stops_the_run_and_says_why(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "broken_env.py").write_text(BROKEN_ENV)
    cfg = env_cfg(tmp_path, tiny_model_dir, "broken_env.py:BrokenFamily")
    with pytest.raises(RewardError) as err:
        train(cfg, config_dir=tmp_path)
    message = one_line(err)
    assert message.startswith("held-out eval before training: all 4 held-out rollouts failed")
    assert "(4 env)" in message and "the env failed on task" in message
    assert "4/4 rollouts errored (4 env)" in capsys.readouterr().err  # the warning line
    base = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert base["eval/errors"] == base["eval/errors/env"] == 4 and base["eval/errors/reward"] == 0


# ---------------------------------------------------------------------------------------------- rewards
def reward_cfg(tiny_config_dir: Path, tmp_path: Path, source: str) -> Any:
    (tiny_config_dir / "my_rewards.py").write_text(source)
    return load_config(
        tiny_config_dir / "tiny.yaml",
        [
            "model.name=/must/not/be/loaded",
            f"output_dir={tmp_path / 'run'}",
            "rewards.0.fn=my_rewards.py:check",
            "rewards.0.name=check",
            "eval.metric=check",
        ],
    )


def test_a_reward_parameter_no_task_has_fails_before_the_model_loads(
    tiny_config_dir: Path, tmp_path: Path
) -> None:
    cfg = reward_cfg(
        tiny_config_dir, tmp_path, "def check(completion, solution, **_):\n    return 1.0\n"
    )
    with pytest.raises(ConfigError) as err:
        train(cfg, config_dir=tiny_config_dir)  # the model path does not exist: never reached
    message = one_line(err)
    assert "reward function 'check' needs task field(s) 'solution'" in message
    assert "(its fields: answer)" in message
    assert not (tmp_path / "run").exists()


def test_a_reward_whose_first_parameter_is_a_task_field_is_refused(
    tiny_config_dir: Path, tmp_path: Path
) -> None:
    cfg = reward_cfg(tiny_config_dir, tmp_path, "def check(answer, **_):\n    return 1.0\n")
    with pytest.raises(ConfigError) as err:
        train(cfg, config_dir=tiny_config_dir)
    message = one_line(err)
    assert "first parameter 'answer' is a task field" in message
    assert "def check(completion, answer, **_)" in message


# ---------------------------------------------------------------------------------------------- models
def test_an_unknown_hub_id_fails_at_once_when_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    from rlvr.models import resolve_model_path

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    started = time.time()
    with pytest.raises(ConfigError) as err:
        resolve_model_path("no-such-org/no-such-model")
    assert time.time() - started < 2
    message = one_line(err)
    assert "not in the Hugging Face cache" in message and "HF_HUB_OFFLINE" in message


def test_an_unknown_hub_id_fails_at_once_when_the_hub_is_unreachable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from huggingface_hub import constants

    from rlvr.hub import check_hub_model

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    started = time.time()
    with pytest.raises(ConfigError) as err:
        check_hub_model("no-such-org/no-such-model")
    assert time.time() - started < 5
    assert "the hub cannot be reached" in one_line(err)


# ---------------------------------------------------------------------------------------------- eval
RAISING_REWARD = "def check(completion, **_):\n    raise ValueError('cannot score')\n"


@pytest.mark.precision  # a bare model's eval runs at bf16 auto; only error counts are checked
def test_rlvr_eval_counts_errors_and_refuses_an_all_failed_eval(
    tiny_config_dir: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlvr.evaluate_cli import run_eval

    (tiny_config_dir / "my_rewards.py").write_text(RAISING_REWARD)
    task = tiny_config_dir / "raising.yaml"
    task.write_text(
        (tiny_config_dir / "tiny.yaml")
        .read_text()
        .replace("tiny_rewards.py:digit_fraction", "my_rewards.py:check")
    )
    with pytest.raises(RewardError) as err:
        run_eval(str(tiny_model_dir), task=str(task), n=3, k=1, max_new_tokens=4, temperature=1.0)
    message = one_line(err)
    assert "all 3 held-out rollouts failed (3 reward)" in message
    assert "reward 'digits' failed on task" in message and "ValueError: cannot score" in message
    out = capsys.readouterr()
    assert "reward errors" in out.out and "env errors" in out.out
    assert "3/3 rollouts errored (3 reward)" in out.err


def test_the_summary_prints_the_errors_of_the_before_and_after_evals(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from rlvr.cli import _print_summary
    from rlvr.train.loop import RunSummary

    ev = {"eval/accuracy": 0.0, "eval/n": 4.0, "eval/rollouts": 4.0}
    before = {**ev, "eval/errors": 4.0, "eval/errors/env": 4.0}
    after = {**ev, "eval/errors": 1.0, "eval/errors/reward": 1.0, "eval/errors/tool": 2.0}
    _print_summary(RunSummary(tmp_path, 3, [(0, before), (3, after)]), None)
    out = capsys.readouterr().out
    assert "held-out errors at step 0: 4/4 rollouts errored (4 env)" in out
    assert "held-out errors at step 3: 1/4 rollouts errored (1 reward); 2 tool calls failed" in out
