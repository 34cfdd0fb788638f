"""`rollout: external`: the user's agent (plain `openai` client) plays, rlvr trains on the recordings."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from rlvr.config import load_config
from rlvr.errors import ConfigError
from rlvr.models import load_policy
from rlvr.records import Task
from rlvr.rollout.hf import HFGenerator
from rlvr.serve.external import ExternalRollout, agent_parts
from rlvr.train.loop import train
from rlvr.train.sources import Sources
from test_serve import teacher_forced_logprobs

BYO = Path(__file__).resolve().parent.parent / "examples" / "byo_agent"

AGENTS = """
from openai import OpenAI

def _ask(base_url, model, task, rollout_id):
    client = OpenAI(base_url=base_url, api_key="x", max_retries=0)
    r = client.chat.completions.create(model=model, messages=list(task.messages), max_tokens=4,
                                       metadata={"rollout_id": rollout_id})
    return r.choices[0].message.content or ""

def flaky(base_url, model, task, rollout_id):
    _ask(base_url, model, task, rollout_id)
    if rollout_id.split("-")[2] == "1":  # the second sample of every task
        raise RuntimeError("tool backend down")
    return {"digits": 1.0, "style": 0.5}

def reply_length(base_url, model, task, rollout_id):
    return float(len(_ask(base_url, model, task, rollout_id)))

import threading
from rlvr.verifiers.rubric import parallel_reward

@parallel_reward
def slow_check(completion, **_):
    return 0.0 if threading.current_thread() is threading.main_thread() else 1.0

def silent(task):
    return 1.0

def bad_return(base_url, model, task, rollout_id):
    _ask(base_url, model, task, rollout_id)
    return "great"
"""


@pytest.fixture()
def byo_dir(tmp_path: Path) -> Path:
    for name in ("tiny.yaml", "tiny_agent.py"):
        shutil.copy(BYO / name, tmp_path / name)
    (tmp_path / "agents.py").write_text(AGENTS)
    return tmp_path


def _external(byo_dir: Path, agent: str, tiny_model_dir: Path) -> tuple[ExternalRollout, Any]:
    cfg = load_config(
        byo_dir / "tiny.yaml",
        [f"model.name={tiny_model_dir}", f"external.agent={byo_dir / 'agents.py'}:{agent}"],
    )
    policy = load_policy(str(tiny_model_dir))
    generator = HFGenerator(
        policy.model, policy.tokenizer, {policy.tokenizer.eos_token_id}, seed=0, autocast_bf16=False
    )
    return ExternalRollout(cfg, policy, generator, Sources(cfg, byo_dir), byo_dir), policy


def test_agent_failures_are_counted_not_scored(byo_dir: Path, tiny_model_dir: Path) -> None:
    tasks = [
        Task(id=f"t{i}", messages=({"role": "user", "content": f"{i} + 1 ="},), source="main")
        for i in range(2)
    ]
    ext, policy = _external(byo_dir, "flaky", tiny_model_dir)
    try:
        groups = ext.rollout(tasks, 3)
        assert [len(g.trajectories) for g in groups] == [3, 3]
        flat = [t for g in groups for t in g.trajectories]
        failed = [t for t in flat if not t.usable]
        assert len(failed) == 2 and all(
            "tool backend down" in t.info["reward_errors"]["agent"] for t in failed
        )
        ok = [t for t in flat if t.usable]
        assert all(t.rewards == {"digits": 1.0, "style": 0.5} and t.reward == 1.5 for t in ok)
        assert ext.last_metrics["external/agent_errors"] == 2.0
        # The trained sequence is the recorded one: the policy's log-probs of its sampled tokens.
        t = ok[0]
        forced = teacher_forced_logprobs(policy.model, t.token_ids)
        sampled = [i for i, m in enumerate(t.policy_mask) if m]
        assert sampled and sampled[0] == t.prompt_length
        for i in sampled:
            assert forced[i - 1] == pytest.approx(t.logprobs[i], abs=1e-4)
    finally:
        ext.close()
    ext, _ = _external(byo_dir, "silent", tiny_model_dir)
    try:
        (group,) = ext.rollout(tasks[:1], 2)
        assert all(
            "no request under rollout id" in t.info["reward_errors"]["agent"]
            for t in group.trajectories
        )
    finally:
        ext.close()
    ext, _ = _external(byo_dir, "bad_return", tiny_model_dir)
    try:
        (group,) = ext.rollout(tasks[:1], 1)
        assert (
            "expected None, a number or a dict"
            in group.trajectories[0].info["reward_errors"]["agent"]
        )
    finally:
        ext.close()


COMMAND_AGENT = """
import json, os, sys
from openai import OpenAI

task = json.loads(os.environ["RLVR_TASK"])
if task["id"].endswith("1"):
    print("no model for this one", file=sys.stderr)
    sys.exit(3)
client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment, nothing else
reply = client.chat.completions.create(model=os.environ["RLVR_MODEL"], messages=task["messages"], max_tokens=3)
print("some log line")
print(json.dumps({"answered": 1.0}))
"""


def test_a_command_agent_is_recorded_through_its_api_key(
    byo_dir: Path, tiny_model_dir: Path
) -> None:
    """external.command: a program that only reads OPENAI_BASE_URL / OPENAI_API_KEY is recorded
    under its rollout id (the key carries it); its printed JSON is its reward; a failing exit is an
    agent error with the program's stderr."""
    (byo_dir / "command_agent.py").write_text(COMMAND_AGENT)
    cfg = load_config(
        byo_dir / "tiny.yaml",
        [
            f"model.name={tiny_model_dir}",
            "external.agent=null",
            f"external.command={sys.executable} command_agent.py",
        ],
    )
    policy = load_policy(str(tiny_model_dir))
    generator = HFGenerator(
        policy.model, policy.tokenizer, {policy.tokenizer.eos_token_id}, seed=0, autocast_bf16=False
    )
    ext = ExternalRollout(cfg, policy, generator, Sources(cfg, byo_dir), byo_dir)
    tasks = [
        Task(id=f"t{i}", messages=({"role": "user", "content": f"{i} + 1 ="},), source="main")
        for i in range(2)
    ]
    try:
        ok_group, bad_group = ext.rollout(tasks, 2)
    finally:
        ext.close()
    for t in ok_group.trajectories:
        assert t.usable and t.rewards == {"answered": 1.0} and sum(t.policy_mask) > 0
    for t in bad_group.trajectories:
        assert "exited with 3: no model for this one" in t.info["reward_errors"]["agent"]


def test_external_eval_is_greedy_and_training_keeps_its_temperature(
    byo_dir: Path, tiny_model_dir: Path
) -> None:
    ext, _ = _external(byo_dir, "reply_length", tiny_model_dir)
    tasks = [
        Task(id=f"t{i}", messages=({"role": "user", "content": f"{i} * 3 ="},), source="main")
        for i in range(6)
    ]
    try:
        first = ext.evaluate(tasks, "agent")
        again = ext.evaluate(tasks, "agent")
        assert first["eval/n"] == 6 and first["eval/errors"] == 0
        assert first["eval/agent"] == again["eval/agent"]  # greedy: the same replies twice
        assert ext.state.required_temperature == 1.0 and ext.state.default_temperature == 1.0
        sampled = [ext.rollout(tasks, 2) for _ in range(2)]
        lengths = [[t.rewards["agent"] for g in run for t in g.trajectories] for run in sampled]
        assert lengths[0] != lengths[1]  # training samples at the run's temperature
    finally:
        ext.close()


def test_slow_rubric_functions_run_in_the_worker_pool(byo_dir: Path, tiny_model_dir: Path) -> None:
    """A `@parallel_reward` function (code execution) is scored for all of a step's rollouts at once
    in worker threads, as the engine does, not one by one in the main thread."""
    cfg = load_config(
        byo_dir / "tiny.yaml",
        [
            f"model.name={tiny_model_dir}",
            f"external.agent={byo_dir / 'agents.py'}:reply_length",
            f"rewards=[{{fn: '{byo_dir / 'agents.py'}:slow_check', name: pooled}}]",
            "eval.metric=pooled",
        ],
    )
    policy = load_policy(str(tiny_model_dir))
    generator = HFGenerator(
        policy.model, policy.tokenizer, {policy.tokenizer.eos_token_id}, seed=0, autocast_bf16=False
    )
    ext = ExternalRollout(cfg, policy, generator, Sources(cfg, byo_dir), byo_dir)
    tasks = [
        Task(id=f"t{i}", messages=({"role": "user", "content": f"{i} ="},), source="main")
        for i in range(2)
    ]
    try:
        groups = ext.rollout(tasks, 2)
    finally:
        ext.close()
    assert [t.rewards["pooled"] for g in groups for t in g.trajectories] == [1.0] * 4


def test_agent_parts() -> None:
    assert agent_parts(None) == {}
    assert agent_parts(0.5) == {"agent": 0.5}
    assert agent_parts({"a": 1}) == {"a": 1.0}
    with pytest.raises(ValueError, match="'a'"):
        agent_parts({"a": float("nan")})


def test_external_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"exactly one of external\.agent"):
        load_config(None, ["rollout=external"])
    cfg = load_config(None, ["rollout=external", "external.agent=a.py:f", "rewards=[]"])
    assert cfg.rollout.mode == "external" and cfg.rollout.max_turns is None


@pytest.mark.precision  # the loop at model.bf16: auto
@pytest.mark.slow
def test_external_rollouts_improve_the_reward(
    byo_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """examples/byo_agent/tiny.yaml: a two-turn agent with its own reward (share of digits), trained
    through the endpoint. Fixed seed; the reward must rise by a clear margin."""
    cfg = load_config(
        byo_dir / "tiny.yaml",
        [
            f"model.name={tiny_model_dir}",
            f"output_dir={tmp_path / 'run'}",
            "tracking.progress=false",
        ],
    )
    summary = train(cfg, config_dir=byo_dir)
    assert summary.steps_done == cfg.train.steps
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if "reward" in r and "event" not in r]
    first = sum(r["reward"] for r in steps[:5]) / 5
    last = sum(r["reward"] for r in steps[-5:]) / 5
    assert last > first + 0.2, (first, last)
    assert all(
        r["external/agent_errors"] == 0 and r["external/requests_per_rollout"] == 2 for r in steps
    )
    (_, before), *_, (_, after) = summary.eval_history
    assert after["eval/accuracy"] > before["eval/accuracy"] + 0.15
