"""json_schema_format, tool_trace and the (non-verifiable) LLM judge."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rlvr.records import Task, Trajectory
from rlvr.verifiers import BUILTIN_REWARDS, RewardFunction, Rubric, resolve_reward_fn
from rlvr.verifiers.builtin import json_schema_format
from rlvr.verifiers.judge import is_verifiable, make_judge, parse_score
from rlvr.verifiers.trace import tool_trace

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}

# --- json_schema_format -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"name": "Ada", "age": 36}', 1.0),
        ('{"name": "Ada", "age": 36', 0.0),  # invalid JSON
        ("not json at all", 0.0),
        ('{"name": "Ada", "age": -1}', 0.0),  # schema violation
        ('{"name": "Ada"}', 0.0),  # missing required key
        ('Here:\n```json\n{"name": "Ada", "age": 36}\n```', 1.0),  # fenced block
        ('```\n{"name": "Ada", "age": 36}\n```', 1.0),  # unlabelled fence
        ('think {"x": 1} <answer>{"name": "Ada", "age": 36}</answer>', 1.0),  # tagged
        ('<answer>```json\n{"name": "Ada", "age": 36}\n```</answer>', 1.0),  # fence in tag
        ('<answer>{"name": "Ada"}</answer> {"name": "Ada", "age": 36}', 0.0),  # tag wins
    ],
)
def test_json_schema_format(text: str, expected: float) -> None:
    assert json_schema_format(text, schema=SCHEMA) == expected


def test_json_schema_format_without_tag_reads_whole_text() -> None:
    text = '<answer>{"name": "Ada", "age": 36}</answer>'
    assert json_schema_format(text, schema=SCHEMA, tag=None) == 0.0
    assert json_schema_format('{"name": "A", "age": 1}', schema=SCHEMA, tag=None) == 1.0


def test_json_schema_format_bad_schema_raises() -> None:
    with pytest.raises(ValueError, match="invalid schema"):
        json_schema_format("{}", schema={"type": "no-such-type"})
    with pytest.raises(ValueError, match="mapping"):
        json_schema_format("{}", schema="object")
    # Recorded as an error by the rubric, never as 0.0.
    fn = RewardFunction("json", json_schema_format, options={"schema": {"type": 3}})
    score = Rubric([fn]).score(_trajectory([], text="{}"), _task())
    assert "json" in score.errors and "json" not in score.rewards


# --- tool_trace ---------------------------------------------------------------------------------


def _call(name: str, **arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _trajectory(turns: list[str], text: str = "done") -> Trajectory:
    messages: list[dict[str, Any]] = []
    for turn in turns:
        messages += [{"role": "assistant", "content": turn}, {"role": "tool", "content": "ok"}]
    return Trajectory(
        task_id="t",
        token_ids=(1, 2),
        policy_mask=(0, 1),
        logprobs=(0.0, -0.1),
        prompt_length=1,
        completion_text=text,
        finish_reason="stop",
        messages=tuple(messages),
    )


def _task(**fields: Any) -> Task:
    return Task(id="t", messages=({"role": "user", "content": "q"},), fields=fields)


SEARCH: dict[str, Any] = {"name": "search", "arguments": {"query": "paris"}}
CALC: dict[str, Any] = {"name": "calc", "arguments": {"x": 2}}
TRAJ = _trajectory(
    [
        "thinking " + _call("search", query="paris", limit=5),
        _call("lookup", id=1) + _call("calc", x=2.0, y=3),
        "<tool_call>{not json</tool_call>",
    ]
)


def test_tool_trace_ordered_subsequence() -> None:
    assert tool_trace(TRAJ, expected_calls=[SEARCH, CALC]) == 1.0
    assert tool_trace(TRAJ, expected_calls=[CALC, SEARCH]) == 0.0  # out of order
    assert tool_trace(TRAJ, expected_calls=[CALC, SEARCH], ordered=False) == 1.0
    assert tool_trace(TRAJ, expected_calls=[SEARCH, SEARCH], ordered=False) == 0.0  # multiset


def test_tool_trace_partial_arguments_and_values() -> None:
    assert tool_trace(TRAJ, expected_calls=[{"name": "lookup"}]) == 1.0
    assert tool_trace(TRAJ, expected_calls=[{"name": "calc", "arguments": {"y": 3.0}}]) == 1.0
    assert tool_trace(TRAJ, expected_calls=[{"name": "calc", "arguments": {"y": 4}}]) == 0.0
    assert tool_trace(TRAJ, expected_calls=[{"name": "calc", "arguments": {"z": 1}}]) == 0.0
    flag = _trajectory([_call("f", on=True)])
    assert tool_trace(flag, expected_calls=[{"name": "f", "arguments": {"on": 1}}]) == 0.0


def test_tool_trace_unordered_needs_distinct_calls() -> None:
    traj = _trajectory([_call("s", q="a", k=1) + _call("s", q="b")])
    # The general pattern must not take the only call that fits the specific one.
    expected = [{"name": "s"}, {"name": "s", "arguments": {"k": 1}}]
    assert tool_trace(traj, expected_calls=expected, ordered=False) == 1.0


def test_tool_trace_exact_forbids_extras_and_ignores_malformed() -> None:
    lookup: dict[str, Any] = {"name": "lookup", "arguments": {"id": 1}}
    assert tool_trace(TRAJ, expected_calls=[SEARCH, CALC], exact=True) == 0.0  # lookup is extra
    assert tool_trace(TRAJ, expected_calls=[SEARCH, lookup, CALC], exact=True) == 1.0
    assert tool_trace(TRAJ, expected_calls=[lookup, SEARCH, CALC], ordered=False, exact=True) == 1.0
    assert tool_trace(_trajectory(["no calls"]), expected_calls=[], exact=True) == 1.0


def test_tool_trace_single_turn_falls_back_to_completion() -> None:
    assert tool_trace(_trajectory([], text=_call("search", query="paris")), [SEARCH]) == 1.0


def test_tool_trace_through_rubric_and_registry() -> None:
    assert resolve_reward_fn("tool_trace") is tool_trace
    assert BUILTIN_REWARDS["json_schema_format"] is json_schema_format
    rubric = Rubric([RewardFunction("trace", tool_trace)])
    assert rubric.score(TRAJ, _task(expected_calls=[SEARCH])).rewards == {"trace": 1.0}
    bad = rubric.score(TRAJ, _task(expected_calls=[{"arguments": {}}]))
    assert "trace" in bad.errors  # broken task data is an error, not a 0.0


# --- judge --------------------------------------------------------------------------------------


class FakeClient:
    def __init__(self, replies: list[str]) -> None:
        self.replies = replies
        self.calls: list[dict[str, Any]] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    def _create(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        content = self.replies[min(len(self.calls), len(self.replies)) - 1]
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=content))])


PROMPT = "Question: {question}\nReference: {answer}\nGrade {completion} from 0 to 10."


def _judge(replies: list[str], **kwargs: Any) -> tuple[Any, FakeClient]:
    client = FakeClient(replies)
    return make_judge("http://x/v1", "m", PROMPT, client=client, **kwargs), client


def test_judge_scores_and_formats_prompt() -> None:
    judge, client = _judge(["Good.\nSCORE: 7"])
    assert judge("Paris", question="Capital?", answer="Paris") == pytest.approx(0.7)
    call = client.calls[0]
    assert call["model"] == "m" and call["temperature"] == 0
    assert "Question: Capital?\nReference: Paris\nGrade Paris" in call["messages"][-1]["content"]


@pytest.mark.parametrize(
    ("reply", "expected"),
    [("SCORE: 15", 1.0), ("SCORE: -3", 0.0), ("score: 2.5", 0.25), ("SCORE: 1\nSCORE: **9**", 0.9)],
)
def test_judge_clips_and_takes_last_score(reply: str, expected: float) -> None:
    judge, _ = _judge([reply])
    assert judge("x", question="q", answer="a") == pytest.approx(expected)


def test_judge_unparseable_raises_and_is_not_cached() -> None:
    judge, client = _judge(["I refuse.", "SCORE: 10"])
    with pytest.raises(ValueError, match="SCORE"):
        judge("x", question="q", answer="a")
    assert judge("x", question="q", answer="a") == 1.0
    assert len(client.calls) == 2
    with pytest.raises(ValueError):
        parse_score("no score here")


def test_judge_memory_cache() -> None:
    judge, client = _judge(["SCORE: 5"])
    for _ in range(3):
        assert judge("x", question="q", answer="a") == 0.5
    judge("y", question="q", answer="a")
    assert len(client.calls) == 2


def test_judge_disk_cache_across_instances(tmp_path: Path) -> None:
    first, client1 = _judge(["SCORE: 4"], cache_dir=str(tmp_path))
    assert first("x", question="q", answer="a") == 0.4
    second, client2 = _judge(["SCORE: 9"], cache_dir=str(tmp_path))
    assert second("x", question="q", answer="a") == 0.4  # from disk
    assert len(client1.calls) == 1 and not client2.calls
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_verifiable_flags() -> None:
    from rlvr.verifiers import judge as judge_module

    judge, _ = _judge(["SCORE: 1"])
    assert judge.verifiable is False
    assert not is_verifiable(judge) and not is_verifiable(judge_module.judge)
    assert not is_verifiable(RewardFunction("j", judge))
    assert "NOT" in (judge.__doc__ or "")
    assert all(is_verifiable(fn) for fn in BUILTIN_REWARDS.values())
    with pytest.raises(ValueError, match="max_score"):
        _judge(["SCORE: 1"], max_score=0)


def test_config_judge_reuses_one_client(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlvr.verifiers import judge as judge_module

    client = FakeClient(["SCORE: 8"])
    built: list[tuple[Any, ...]] = []
    real: Any = judge_module._Judge

    def fake_judge(*args: Any) -> Any:
        built.append(args)
        return real(*args[:4], client)

    monkeypatch.setattr(judge_module, "_JUDGES", {})
    monkeypatch.setattr(judge_module, "_Judge", fake_judge)
    fn = resolve_reward_fn("rlvr.verifiers.judge:judge")
    options = {"base_url": "http://x/v1", "model": "m", "rubric_prompt": PROMPT}
    rubric = Rubric([RewardFunction("judge", fn, options=options)])
    for text in ("a", "b"):
        traj = _trajectory([], text=text)
        assert rubric.score(traj, _task(question="q", answer="a")).rewards == {"judge": 0.8}
    assert len(built) == 1 and len(client.calls) == 2


def test_judge_rewards_are_reported_apart_from_verifiable_ones() -> None:
    from rlvr.config import load_config
    from rlvr.observe.metrics import verifiability_metrics
    from rlvr.records import Trajectory
    from rlvr.train.sources import Sources

    cfg = load_config(
        None,
        [
            "rewards=[{fn: numeric_match, name: correct}, {fn: 'rlvr.verifiers.judge:judge', "
            "name: style, weight: 0.5, options: {base_url: 'http://127.0.0.1:9', model: m, "
            "rubric_prompt: 'Grade {completion}'}}]",
        ],
    )
    sources = Sources(cfg)
    assert sources.unverifiable == {"style"}
    assert sources.reward_weights == {"correct": 1.0, "style": 0.5}

    def traj(correct: float, style: float) -> Trajectory:
        return Trajectory(
            "t", (), (), (), 0, "", "stop", rewards={"correct": correct, "style": style}
        )

    out = verifiability_metrics([traj(1.0, 0.5), traj(0.0, 1.0)], sources.reward_weights, {"style"})
    assert out["reward/verifiable"] == 0.5
    assert out["reward/non_verifiable"] == (0.25 + 0.5) / 2
    assert out["rewards/style/verifiable"] == 0.0 and out["rewards/correct/verifiable"] == 1.0
    assert verifiability_metrics([traj(1.0, 0.0)], {"correct": 1.0}, set()) == {}
