"""examples/unit_converter_env.py: a user-written tool env, its rewards, and its tiny-model training."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from rlvr.config import load_config
from rlvr.envs import Tool, ToolEnv, get_env_family
from rlvr.models import tiny_tokenizer
from rlvr.observe.tracking import read_metrics
from rlvr.records import Task
from rlvr.rollout.engine import RolloutLimits, Scoring, rollout_groups
from rlvr.rollout.generator import SamplingParams
from rlvr.train.loop import train

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FAMILY = str(EXAMPLES / "unit_converter_env.py") + ":UnitConverterFamily"


def family() -> Any:
    return get_env_family(FAMILY)


def test_tool_and_tool_env_are_exported_and_the_schema_comes_from_the_docstring() -> None:
    fam = family()
    task = fam.generate(3)
    env = fam.make(task)
    assert isinstance(env, ToolEnv) and all(isinstance(t, Tool) for t in env.tools)
    schema = env.reset().tools[0]["function"]
    assert schema["name"] == "convert"
    assert schema["description"] == "Convert a length from one unit to another."
    assert schema["parameters"]["properties"]["value"] == {
        "type": "number",
        "description": "The amount to convert.",
    }
    assert schema["parameters"]["required"] == ["value", "from_unit", "to_unit"]


def test_rewards_of_a_solved_a_guessed_and_a_broken_episode() -> None:
    fam = family()
    task = fam.generate(0)  # "Convert 50 mm to cm." -> 5
    assert task.messages[-1]["content"] == "Convert 50 mm to cm." and task.fields["answer"] == 5.0

    env = fam.make(task)
    call = '<tool_call>\n{"name": "convert", "arguments": {"value": 50, "from_unit": "mm", "to_unit": "cm"}}\n</tool_call>'
    first = env.step(call)
    assert not first.done and first.messages == [
        {"role": "tool", "name": "convert", "content": "5"}
    ]
    assert first.rewards == {"call_shape": 1.0} and first.info["tool_calls"] == 1
    last = env.step("<answer>5</answer>")
    assert last.done and last.rewards == {"success": 1.0, "format": 1.0, "used_tool": 1.0}

    guess = fam.make(task).step("5")  # right number, no tag, no tool; call_shape: no call opening
    assert guess.done and guess.rewards["success"] == 1.0 and guess.rewards["format"] == 0.0
    assert guess.rewards["used_tool"] == 0.0 and 0.0 <= guess.rewards["call_shape"] < 0.2

    env = fam.make(task)
    bad = env.step(
        '<tool_call>{"name": "convert", "arguments": {"value": 1, "from_unit": "mi", "to_unit": "m"}}</tool_call>'
    )
    assert "unknown unit 'mi'" in bad.messages[0]["content"] and bad.info["tool_failures"] == 1
    assert env.step("<answer>7</answer>").rewards == {
        "success": 0.0,
        "format": 1.0,
        "used_tool": 0.0,
    }

    # call_shape rises as the opening gets closer to `<tool_call>`
    scores = [fam.make(task).step(t).rewards["call_shape"] for t in ("zzz", "<tool", "<tool_cal")]
    assert scores[0] < scores[1] < scores[2] < 1.0


def test_the_scripted_policy_solves_every_instance_through_the_engine() -> None:
    """The family's scripted_action played by the real engine (what `rlvr env check` shows)."""
    from rlvr.authoring.check import _PolicyGenerator, _Recorder

    fam = family()
    tokenizer = tiny_tokenizer()
    for seed in range(40):  # small results included (20 mm -> 0.00002 km)
        task = fam.generate(seed)
        recorder = _Recorder(fam.make(task))
        gen = _PolicyGenerator(fam.scripted_action, tokenizer, task, recorder)

        def make_env(_task: Task, recorder: _Recorder = recorder) -> _Recorder:
            return recorder

        traj = rollout_groups(
            [task],
            make_env,
            gen,
            tokenizer,
            SamplingParams(n=1, max_new_tokens=256),
            Scoring(env_weights={**fam.reward_weights, "success": 1.0}),
            RolloutLimits(max_total_tokens=2048, env_workers=1),
        )[0].trajectories[0]
        assert traj.rewards["success"] == 1.0 and traj.info["tool_calls"] == 1, traj.messages
        assert traj.finish_reason == "stop" and len(traj.turns) == 2
        assert traj.reward == pytest.approx(1.1)  # success 1 + format 0.1 (call_shape weighs 0)


@pytest.mark.slow
def test_tiny_model_learns_the_tool_call_opening(tiny_model_dir: Path, tmp_path: Path) -> None:
    """examples/tiny_tool_env.yaml (model.bf16 pinned 'off' in the config, so no precision mark):
    with call_shape weighted 1, 25 GRPO steps on the tiny random model raise the reward (how close
    the first turn opens to `<tool_call>`) well above the random model's, train and held-out."""
    for name in ("tiny_tool_env.yaml", "unit_converter_env.py"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
    cfg = load_config(
        tmp_path / "tiny_tool_env.yaml",
        [
            f"model.name={tiny_model_dir}",
            f"output_dir={tmp_path / 'run'}",
            "tracking.progress=false",
        ],
    )
    assert cfg.model.bf16 == "off" and cfg.train.seed == 0
    summary = train(cfg, config_dir=tmp_path)
    steps = [m for m in read_metrics(summary.run_dir) if "reward" in m]
    assert len(steps) == 25 and "tools/call_frequency" in steps[0]
    first = sum(m["reward"] for m in steps[:5]) / 5
    last = sum(m["reward"] for m in steps[-5:]) / 5
    assert first < 0.15, first
    assert last > first + 0.15, (first, last)
    before, after = summary.eval_history[0][1], summary.eval_history[-1][1]
    assert after["eval/reward"] > before["eval/reward"] + 0.1, (before, after)
