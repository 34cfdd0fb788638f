"""Multi-turn rollouts through the engine (rlvr.rollout.engine) with a scripted generator and env.

The generator is a fake that returns, for each prompt, the tiny tokenizer's ids of a scripted string
plus `<|im_end|>`; so every expected token id, mask and log-prob below is known exactly.

Longer than 500 lines on purpose: every test here leans on the same scripted generator, env and
tokenizer set up at the top; splitting the file would split or import that scaffolding.
"""

from __future__ import annotations

import json
import re
import string
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from rlvr.envs.base import Env, EnvReset, EnvStep, SingleTurnEnv
from rlvr.envs.tools import Tool, ToolEnv
from rlvr.models import load_policy, tiny_tokenizer
from rlvr.observe.metrics import agent_metrics
from rlvr.records import Span, Task, Trajectory
from rlvr.rollout.chat import (
    TOOL_SYSTEM_PROMPT,
    Truncation,
    prompt_text,
    template_renders_tools,
    with_tool_instructions,
)
from rlvr.rollout.engine import RolloutLimits, Scoring, rollout_groups
from rlvr.rollout.generator import Completion, SamplingParams
from rlvr.train.batch import collate, token_logprobs
from rlvr.verifiers import Rubric
from rlvr.verifiers.rubric import RewardFunction

LOGPROB = -0.5

# A Qwen2.5 / Hermes-style template: tools rendered into the system block, tool results as a user turn.
HERMES_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content']"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def make_tokenizer(template: str = "chatml") -> Any:
    tok = tiny_tokenizer()  # a fresh object: template_renders_tools caches on the tokenizer
    if template == "hermes":
        tok.chat_template = HERMES_TEMPLATE
    return tok


TOK = make_tokenizer()
EOS = TOK.convert_tokens_to_ids("<|im_end|>")


def ids(text: str, tok: Any = TOK) -> list[int]:
    return [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]


def call(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


CALL_ADD = call("add", {"a": 2, "b": 3})
ANSWER = "<answer>5</answer>"


# ------------------------------------------------------------------------------------ fake generator
Script = Callable[[str, int, int], str]  # (decoded prompt, turn index, sample index) -> text


def by_turn(*texts: str) -> Script:
    """The same script for every prompt: turn k answers texts[k] (the last one repeats)."""
    return lambda prompt, turn, j: texts[min(turn, len(texts) - 1)]


def by_marker(scripts: Mapping[str, Sequence[str]]) -> Script:
    """A script per task, chosen by a marker string found in the prompt."""

    def pick(prompt: str, turn: int, j: int) -> str:
        for marker, texts in scripts.items():
            if marker in prompt:
                return texts[min(turn, len(texts) - 1)]
        raise AssertionError(f"no script for prompt {prompt[-80:]!r}")

    return pick


def chatml_turn(prompt: str) -> int:
    """The index of the assistant turn a ChatML prompt asks for (its openings so far, minus one)."""
    return prompt.count("<|im_start|>assistant") - 1


class ScriptedGenerator:
    """Returns `sampling.n` completions per prompt: ids of the scripted text + `eos` (<|im_end|>).

    Like a real generator it stops at `sampling.max_new_tokens` (finish "length"). Every call's
    prompts and sampling params are recorded. Other tokenizers (tests/test_tool_formats.py) pass
    their own `eos` id and `turn_of` (the turn index a decoded prompt asks for).
    """

    def __init__(
        self,
        tokenizer: Any,
        script: Script,
        eos: int = EOS,
        turn_of: Callable[[str], int] = chatml_turn,
    ) -> None:
        self.tok = tokenizer
        self.script = script
        self.eos = eos
        self.turn_of = turn_of
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        self.calls.append(([list(p) for p in prompts], sampling))
        out = []
        for prompt in prompts:
            text = str(self.tok.decode(list(prompt)))
            turn = self.turn_of(text)
            row = []
            for j in range(sampling.n):
                token_ids = [*ids(self.script(text, turn, j), self.tok), self.eos]
                finish = "stop"
                if len(token_ids) > sampling.max_new_tokens:
                    token_ids, finish = token_ids[: sampling.max_new_tokens], "length"
                row.append(Completion(tuple(token_ids), (LOGPROB,) * len(token_ids), finish))
            out.append(row)
        return out


# ------------------------------------------------------------------------------------------ the env
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: Ignored.
    """
    raise ValueError(f"kaput {x}")


RELEASE = threading.Event()


def slow(seconds: float) -> str:
    """Sleep (until the test releases it).

    Args:
        seconds: How long at most.
    """
    RELEASE.wait(seconds)
    return "late"


LONG = string.ascii_letters + string.digits  # 62 distinct characters = 62 tokens


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: The key.
    """
    return LONG


TICKS: list[int] = []


def tick(n: int) -> int:
    """Count calls.

    Args:
        n: Recorded.
    """
    TICKS.append(n)
    return len(TICKS)


ADD = Tool.from_function(add)
EXTRA = [Tool.from_function(f) for f in (boom, slow, lookup, tick)]
SYSTEM = "Use the tools."


@pytest.fixture(autouse=True)
def _release_slow_tools() -> Iterator[None]:
    RELEASE.clear()
    TICKS.clear()
    yield
    RELEASE.set()  # an abandoned timed-out tool thread ends now


class AddEnv(ToolEnv):
    max_turns = 4

    def __init__(self, task: Task, tools: Sequence[Tool] = (ADD,)) -> None:
        super().__init__(tools)
        self.task = task

    def reset(self) -> EnvReset:
        return EnvReset([dict(m) for m in self.task.messages], self.tool_schemas)

    def finish(self, assistant_text: str) -> EnvStep:
        match = re.search(r"<answer>(\d+)</answer>", assistant_text)
        right = match is not None and int(match.group(1)) == self.task.fields["answer"]
        return EnvStep(rewards={"success": 1.0 if right else 0.0}, done=True)


class BrokenFinishEnv(AddEnv):
    def finish(self, assistant_text: str) -> EnvStep:
        raise RuntimeError("env broke")


def task(question: str = "What is 2 + 3?", answer: int = 5, task_id: str = "add") -> Task:
    return Task(
        id=task_id,
        messages=({"role": "system", "content": SYSTEM}, {"role": "user", "content": question}),
        fields={"answer": answer},
    )


def play(
    script: Script,
    *,
    tasks: Sequence[Task] | None = None,
    tok: Any = TOK,
    make_env: Callable[[Task], Env] = AddEnv,
    limits: RolloutLimits | None = None,
    n: int = 1,
    scoring: Scoring | None = None,
    max_new_tokens: int = 400,
) -> tuple[list[list[Trajectory]], ScriptedGenerator]:
    gen = ScriptedGenerator(tok, script)
    groups = rollout_groups(
        list(tasks or [task()]),
        make_env,
        gen,
        tok,
        SamplingParams(n=n, max_new_tokens=max_new_tokens),
        scoring or Scoring(),
        limits or RolloutLimits(),
    )
    return [list(g.trajectories) for g in groups], gen


def with_extra_tools(t: Task) -> Env:
    return AddEnv(t, [ADD, *EXTRA])


# ------------------------------------------------------------------------------------ token exactness
# Hand-written: how each template renders the opening conversation and a "5" tool result.
def expected_prompt(template: str) -> str:
    schema = json.dumps(ADD.schema)
    if template == "chatml":
        system = SYSTEM + "\n\n" + TOOL_SYSTEM_PROMPT.format(schemas=schema)
    else:
        system = SYSTEM + "\n\n# Tools\n<tools>\n" + schema + "\n</tools>"
    return (
        f"<|im_start|>system\n{system}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )


GLUE_5 = {
    # the closing "<|im_end|>" was sampled; then "\n", the observation, the next opening
    "chatml": "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n",
    "hermes": (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ),
}


@pytest.mark.parametrize("template", ["chatml", "hermes"])
def test_token_exact_two_turn_tool_episode(template: str) -> None:
    tok = make_tokenizer(template)
    (group,), gen = play(by_turn(CALL_ADD, ANSWER), tok=tok)
    (traj,) = group

    prompt = ids(expected_prompt(template), tok)
    turn1 = [*ids(CALL_ADD, tok), EOS]
    glue = ids(GLUE_5[template], tok)
    turn2 = [*ids(ANSWER, tok), EOS]
    # char-level tokenizer: one id per character, the specials one id each
    assert len(turn1) == len(CALL_ADD) + 1
    assert traj.token_ids == tuple(prompt + turn1 + glue + turn2)
    assert traj.prompt_length == len(prompt)

    p, a, g, b = len(prompt), len(turn1), len(glue), len(turn2)
    assert traj.turns == (Span(p, p + a), Span(p + a + g, p + a + g + b))

    # The generator saw the rendered prompt, then exactly the trajectory so far (nothing re-tokenized).
    assert len(gen.calls) == 2
    assert gen.calls[0][0] == [prompt]
    assert gen.calls[1][0] == [list(traj.token_ids[: traj.turns[1].start])]
    assert gen.calls[1][0] == [prompt + turn1 + glue]

    # policy_mask is 1 exactly on the sampled tokens, which the turn spans cover.
    in_turns = {t for s in traj.turns for t in range(s.start, s.end)}
    assert {t for t, m in enumerate(traj.policy_mask) if m} == in_turns
    assert traj.num_policy_tokens == a + b
    assert traj.policy_mask == (0,) * p + (1,) * a + (0,) * g + (1,) * b
    assert traj.logprobs == (0.0,) * p + (LOGPROB,) * a + (0.0,) * g + (LOGPROB,) * b

    assert traj.messages == (
        {"role": "assistant", "content": CALL_ADD},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": ANSWER},
    )
    # decode(token_ids) is the template's rendering of the whole conversation, minus the closing
    # glue after the last sampled <|im_end|>.
    opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2 + 3?"}]
    conversation = with_tool_instructions(tok, opening, [ADD.schema]) + list(traj.messages)
    native = [ADD.schema] if template == "hermes" else None
    rendered = tok.apply_chat_template(conversation, tools=native, tokenize=False)
    decoded = tok.decode(list(traj.token_ids))
    assert rendered.startswith(decoded)
    assert rendered[len(decoded) :] == "\n"

    assert traj.finish_reason == "stop"
    assert traj.completion_text == ANSWER
    assert traj.rewards == {"success": 1.0}
    assert traj.reward == 1.0
    assert traj.turn_rewards == (0.0, 1.0)
    assert traj.info["tool_calls"] == 1 and traj.info["tool_failures"] == 0
    assert traj.info["num_turns"] == 2


def test_a_turn_cut_before_its_eos_gets_the_whole_closing_in_the_glue() -> None:
    # sampling.max_new_tokens = 30 cuts the call mid-JSON (no <|im_end|> sampled): the glue must
    # supply the template's whole closing "<|im_end|>\n" before the (error) observation.
    (group,), _ = play(by_turn(CALL_ADD, ANSWER), max_new_tokens=30)
    (traj,) = group
    cut_text = CALL_ADD[:30]
    error = traj.messages[1]["content"]
    assert error.startswith("Error: malformed: tool call is not valid JSON")
    glue = f"<|im_end|>\n<|im_start|>tool\n{error}<|im_end|>\n<|im_start|>assistant\n"
    p = traj.prompt_length
    assert traj.token_ids[p:] == tuple(ids(cut_text) + ids(glue) + ids(ANSWER) + [EOS])
    assert traj.turns == (Span(p, p + 30), Span(p + 30 + len(ids(glue)), len(traj.token_ids)))
    assert traj.num_policy_tokens == 30 + len(ANSWER) + 1
    assert traj.finish_reason == "stop"
    opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2 + 3?"}]
    conversation = with_tool_instructions(TOK, opening, [ADD.schema]) + list(traj.messages)
    rendered = TOK.apply_chat_template(conversation, tokenize=False)
    assert rendered == TOK.decode(list(traj.token_ids)) + "\n"


def test_chatml_template_gets_the_tool_schema_in_the_system_message() -> None:
    tok = make_tokenizer("chatml")
    assert template_renders_tools(tok) is False
    block = TOOL_SYSTEM_PROMPT.format(schemas=json.dumps(ADD.schema))
    opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q"}]
    assert with_tool_instructions(tok, opening, [ADD.schema]) == [
        {"role": "system", "content": SYSTEM + "\n\n" + block},
        {"role": "user", "content": "q"},
    ]
    # Without a system message one is inserted; without tools nothing changes.
    assert with_tool_instructions(tok, opening[1:], [ADD.schema]) == [
        {"role": "system", "content": block},
        {"role": "user", "content": "q"},
    ]
    assert with_tool_instructions(tok, opening, []) == opening
    assert '"name": "add"' in prompt_text(tok, opening, [ADD.schema])


def test_hermes_template_renders_the_tools_natively() -> None:
    tok = make_tokenizer("hermes")
    assert template_renders_tools(tok) is True
    opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q"}]
    assert with_tool_instructions(tok, opening, [ADD.schema]) == opening  # no injection
    text = prompt_text(tok, opening, [ADD.schema])
    assert '"name": "add"' in text
    assert "You can call these tools" not in text
    assert text.count('"name": "add"') == 1  # once, not injected and rendered


def test_g_samples_share_one_first_turn_prompt() -> None:
    (group,), gen = play(by_turn(CALL_ADD, ANSWER), n=3)
    assert len(group) == 3
    # first turn: one prompt with n = 3; second turn: the 3 (equal) conversations, n = 3 again
    assert [(len(prompts), s.n) for prompts, s in gen.calls] == [(1, 3), (1, 3)]
    assert len({t.token_ids for t in group}) == 1
    assert all(t.reward == 1.0 for t in group)


# ------------------------------------------------------------------------------------ tool failures
def test_failed_tool_calls_become_error_observations_and_are_counted() -> None:
    bad_turn = (
        "<tool_call>\n{not json}\n</tool_call>"
        + call("mul", {"a": 2, "b": 3})
        + call("boom", {"x": 1})
        + call("slow", {"seconds": 5.0})
    )
    scripts = {
        "2 + 3": [bad_turn, call("add", {"a": "2", "b": 3}), ANSWER],
        "4 + 4": [call("add", {"a": 4, "b": 4}), "<answer>8</answer>"],
    }
    tasks = [task(), task("What is 4 + 4?", 8, "add-4-4")]
    groups, _ = play(
        by_marker(scripts),
        tasks=tasks,
        make_env=with_extra_tools,
        limits=RolloutLimits(tool_timeout_s=0.2),
    )
    (bad,), (good,) = groups

    tool_msgs = [m for m in bad.messages if m["role"] == "tool"]
    assert len(tool_msgs) == 5
    assert all(m["content"].startswith("Error:") for m in tool_msgs)
    malformed, unknown, raised, timeout, bad_args = (m["content"] for m in tool_msgs)
    assert malformed.startswith("Error: malformed: tool call is not valid JSON")
    assert unknown.startswith("Error: unknown tool 'mul'")
    assert raised == "Error: ValueError: kaput 1"
    assert timeout == "Error: slow timed out after 0.2s"
    assert bad_args == "Error: argument 'a' should be int, got str '2'"
    # Every error text reached the policy's context as tokens.
    decoded = TOK.decode(list(bad.token_ids))
    for content in (malformed, unknown, raised, timeout, bad_args):
        assert content in decoded

    assert bad.finish_reason == "stop" and len(bad.turns) == 3 and bad.reward == 1.0
    assert bad.info["tool_calls"] == 5
    assert bad.info["tool_failures"] == 5
    assert {k: bad.info[k] for k in bad.info if k.startswith("tool_errors/")} == {
        "tool_errors/malformed": 1,
        "tool_errors/unknown_tool": 1,
        "tool_errors/bad_arguments": 1,
        "tool_errors/raised": 1,
        "tool_errors/timeout": 1,
        "tool_errors/too_many_calls": 0,
    }
    assert good.info["tool_calls"] == 1 and good.info["tool_failures"] == 0
    assert good.messages[1] == {"role": "tool", "name": "add", "content": "8"}
    assert good.reward == 1.0 and len(good.turns) == 2

    metrics = agent_metrics([bad, good])
    assert metrics["tools/call_frequency"] == pytest.approx((5 + 1) / 2)
    assert metrics["tools/failure_frequency"] == pytest.approx(5 / 6)
    assert metrics["tools/call_rate"] == 1.0
    assert metrics["tools/errors/timeout"] == 1.0
    assert metrics["tools/errors/too_many_calls"] == 0.0
    assert metrics["turns/mean"] == pytest.approx(2.5)
    assert metrics["turns/max"] == 3.0


def test_calls_past_the_per_turn_limit_are_not_run() -> None:
    two_calls = call("tick", {"n": 1}) + call("tick", {"n": 2}) + call("tick", {"n": 3})
    (group,), _ = play(
        by_turn(two_calls, ANSWER),
        make_env=with_extra_tools,
        limits=RolloutLimits(max_tool_calls_per_turn=1),
    )
    (traj,) = group
    assert TICKS == [1]
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == [
        "1",
        "Error: at most 1 tool call(s) per turn; this one was not run",
        "Error: at most 1 tool call(s) per turn; this one was not run",
    ]
    assert traj.info["tool_errors/too_many_calls"] == 2
    assert traj.info["tool_failures"] == 2


# ------------------------------------------------------------------------------------------ limits
@pytest.mark.parametrize(("max_turns", "expected"), [(2, 2), (None, AddEnv.max_turns)])
def test_max_turns(max_turns: int | None, expected: int) -> None:
    (group,), gen = play(by_turn(CALL_ADD), limits=RolloutLimits(max_turns=max_turns))
    (traj,) = group
    assert traj.finish_reason == "max_turns"
    assert len(traj.turns) == expected
    assert len(gen.calls) == expected
    # The last turn's tool result is not appended: the trajectory ends on the sampled tokens.
    assert traj.turns[-1].end == len(traj.token_ids)
    assert [m["role"] for m in traj.messages] == ["assistant", "tool"] * (expected - 1) + [
        "assistant"
    ]
    assert traj.info["tool_calls"] == expected
    assert traj.reward == 0.0
    assert agent_metrics([traj])["turns/max_turns_ratio"] == 1.0


TURN1 = len(CALL_ADD) + 1
GLUE = len(ids(GLUE_5["chatml"]))


def test_max_total_tokens_cuts_the_second_turn() -> None:
    limit = TURN1 + GLUE + 5
    (group,), gen = play(by_turn(CALL_ADD, ANSWER), limits=RolloutLimits(max_total_tokens=limit))
    (traj,) = group
    assert gen.calls[1][1].max_new_tokens == 5  # the budget left
    assert len(traj.completion_ids) == limit
    assert traj.finish_reason == "length"
    assert traj.completion_text == ANSWER[:5]
    assert traj.turns[1] == Span(traj.prompt_length + TURN1 + GLUE, len(traj.token_ids))
    assert traj.rewards == {"success": 0.0}


def test_max_total_tokens_stops_before_an_observation_that_does_not_fit() -> None:
    limit = TURN1 + 3
    (group,), gen = play(by_turn(CALL_ADD, ANSWER), limits=RolloutLimits(max_total_tokens=limit))
    (traj,) = group
    assert len(gen.calls) == 1
    assert traj.finish_reason == "length"
    assert len(traj.turns) == 1
    assert len(traj.completion_ids) == TURN1 <= limit
    assert traj.messages == ({"role": "assistant", "content": CALL_ADD},)


def test_max_total_tokens_cuts_the_first_turn() -> None:
    (group,), _ = play(by_turn(CALL_ADD, ANSWER), limits=RolloutLimits(max_total_tokens=10))
    (traj,) = group
    assert traj.finish_reason == "length"
    assert traj.completion_ids == tuple(ids(CALL_ADD[:10]))
    assert len(traj.turns) == 1


MARKER = " ...[truncated]... "


@pytest.mark.parametrize(
    ("side", "expected"),
    [
        ("right", "abcdefghij" + MARKER),
        ("left", MARKER + "0123456789"),
        ("middle", "abcde" + MARKER + "56789"),
    ],
)
def test_max_observation_tokens_truncates_a_long_tool_result(
    side: Truncation, expected: str
) -> None:
    limits = RolloutLimits(max_observation_tokens=10, observation_truncation=side)
    (group,), _ = play(
        by_turn(call("lookup", {"key": "k"}), ANSWER), make_env=with_extra_tools, limits=limits
    )
    (traj,) = group
    assert traj.messages[1] == {"role": "tool", "name": "lookup", "content": expected}
    observation = traj.token_ids[traj.turns[0].end : traj.turns[1].start]
    glue = GLUE_5["chatml"].replace("\n5<", "\n" + expected + "<")
    assert observation == tuple(ids(glue))
    # bounded: the glue around it + at most 10 content tokens + the marker
    assert len(observation) == GLUE - 1 + 10 + len(MARKER)
    assert len(LONG) > 10 + len(MARKER)


def test_observation_within_the_limit_is_kept_whole() -> None:
    limits = RolloutLimits(max_observation_tokens=len(LONG))
    (group,), _ = play(
        by_turn(call("lookup", {"key": "k"}), ANSWER), make_env=with_extra_tools, limits=limits
    )
    assert group[0].messages[1]["content"] == LONG


def exact(completion: str, answer: int) -> float:
    return float(completion == f"<answer>{answer}</answer>")


RUBRIC = Rubric([RewardFunction("exact", exact)])


def test_env_that_raises_ends_its_episode_with_an_error() -> None:
    def make_env(t: Task) -> Env:
        return BrokenFinishEnv(t) if t.id == "broken" else AddEnv(t)

    tasks = [task(task_id="broken"), task(task_id="fine")]
    groups, _ = play(
        by_turn(CALL_ADD, ANSWER), tasks=tasks, make_env=make_env, scoring=Scoring(RUBRIC)
    )
    (broken,), (fine,) = groups
    assert broken.finish_reason == "error"
    assert broken.reward_errors == ("env",)
    assert not broken.usable
    assert broken.reward == 0.0  # the rubric would give 1.0; an env error is never a reward
    assert broken.info["reward_errors"] == {"env": "RuntimeError: env broke"}
    assert len(broken.turns) == 2  # the turns played so far are kept
    assert broken.turn_rewards == (0.0, 1.0)
    # The other episode in the same batch is unaffected.
    assert fine.finish_reason == "stop" and fine.reward_errors == ()
    assert fine.rewards == {"exact": 1.0, "success": 1.0}
    assert fine.reward == 2.0
    assert agent_metrics([broken, fine])["env/errors"] == 1.0


class StepRaises(Env):
    def reset(self) -> EnvReset:
        return EnvReset([{"role": "user", "content": "hi"}])

    def step(self, assistant_text: str) -> EnvStep:
        raise KeyError("missing")


def test_env_whose_step_raises_on_the_first_turn() -> None:
    (group,), _ = play(by_turn(ANSWER), make_env=lambda t: StepRaises(), n=2)
    for traj in group:
        assert traj.finish_reason == "error"
        assert traj.reward_errors == ("env",)
        assert traj.info["reward_errors"]["env"] == "KeyError: 'missing'"
        assert len(traj.turns) == 1
        assert traj.rewards == {}


def test_single_turn_env_plays_one_turn_scored_by_the_rubric() -> None:
    plain = Task(
        id="q", messages=({"role": "user", "content": "What is 2 + 3?"},), fields={"answer": 5}
    )
    gen = ScriptedGenerator(TOK, lambda prompt, turn, j: [ANSWER, "<answer>6</answer>"][j])
    (group,) = rollout_groups(
        [plain],
        SingleTurnEnv,
        gen,
        TOK,
        SamplingParams(n=2, max_new_tokens=64),
        Scoring(RUBRIC),
    )
    right, wrong = group.trajectories
    prompt = ids("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    assert len(gen.calls) == 1
    assert gen.calls[0][0] == [prompt] and gen.calls[0][1].n == 2
    assert right.token_ids == tuple(prompt + ids(ANSWER) + [EOS])
    for traj in (right, wrong):
        assert len(traj.turns) == 1
        assert traj.turns[0] == Span(len(prompt), len(traj.token_ids))
        assert traj.finish_reason == "stop"
        assert traj.messages == ({"role": "assistant", "content": traj.completion_text},)
    assert (right.reward, right.rewards, right.turn_rewards) == (1.0, {"exact": 1.0}, (1.0,))
    assert (wrong.reward, wrong.rewards, wrong.turn_rewards) == (0.0, {"exact": 0.0}, (0.0,))
    assert wrong.completion_text == "<answer>6</answer>"


# ------------------------------------------------------------------------------------ gradients
@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir: Path) -> Any:
    return load_policy(str(tiny_model_dir)).model


@pytest.fixture(scope="module")
def episode() -> Trajectory:
    (group,), _ = play(by_turn(CALL_ADD, ANSWER))
    return group[0]


def test_collate_zeroes_mask_and_advantage_on_observation_tokens(episode: Trajectory) -> None:
    n = len(episode.completion_ids)
    batch = collate([episode], [[2.0] * n], pad_token_id=0)  # advantage everywhere on purpose
    mask = batch.mask_B_C[0].tolist()
    assert mask == [float(m) for m in episode.policy_mask[episode.prompt_length :]]
    a, g = TURN1, GLUE
    assert mask == [1.0] * a + [0.0] * g + [1.0] * (n - a - g)
    assert batch.advantages_B_C[0].tolist() == [2.0 * m for m in mask]
    assert batch.behaviour_logprobs_B_C[0].tolist() == [LOGPROB * m for m in mask]
    assert batch.completion_ids_B_C[0].tolist() == list(episode.completion_ids)


def test_observation_tokens_get_zero_gradient(tiny_model: Any, episode: Trajectory) -> None:
    n = len(episode.completion_ids)
    batch = collate([episode], [[1.0] * n], pad_token_id=0)
    obs = batch.mask_B_C == 0
    assert int(obs.sum()) == GLUE

    captured: list[torch.Tensor] = []

    def keep_logits(module: Any, inputs: Any, output: torch.Tensor) -> None:
        output.retain_grad()
        captured.append(output)

    handle = tiny_model.get_output_embeddings().register_forward_hook(keep_logits)
    try:
        # The logits path, whose lm_head output the hook can see (the fused head never builds the
        # logits; tests/test_fastpath.py holds it equal to this path, gradients included).
        logp, _ = token_logprobs(tiny_model, batch, share_prefix=False, fused=False)
    finally:
        handle.remove()
    logp.retain_grad()
    loss = -(logp * batch.advantages_B_C * batch.mask_B_C).sum()
    tiny_model.zero_grad(set_to_none=True)
    loss.backward()

    # d loss / d logp: exactly 0 on observations, -A = -1 on sampled tokens
    assert logp.grad is not None
    assert (logp.grad[obs] == 0.0).all()
    assert (logp.grad[~obs] == -1.0).all()

    # d loss / d logits: the logits row that scores completion token j is position j of the plain
    # forward's kept logits (C + 1 rows, the last predicts past the end).
    (logits,) = captured
    assert logits.shape[1] == n + 1
    assert logits.grad is not None
    grad_rows = logits.grad[0, :n]  # (C, V)
    assert (grad_rows[obs[0]] == 0.0).all()
    assert (grad_rows[~obs[0]].abs().sum(dim=-1) > 0).all()
    assert (logits.grad[0, n] == 0.0).all()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tiny_model.parameters())
    tiny_model.zero_grad(set_to_none=True)


def test_observation_logprobs_do_not_reach_the_shared_prefix_loss(
    tiny_model: Any, episode: Trajectory
) -> None:
    n = len(episode.completion_ids)
    batch = collate([episode], [[0.5] * n], pad_token_id=0)
    logp, _ = token_logprobs(tiny_model, batch, share_prefix=True)
    loss = -(logp * batch.advantages_B_C * batch.mask_B_C).sum()
    (grad,) = torch.autograd.grad(loss, logp)
    obs = batch.mask_B_C == 0
    assert (grad[obs] == 0.0).all()
    assert torch.equal(grad[~obs], torch.full_like(grad[~obs], -0.5))


# ------------------------------------------------------------------------- odd output never crashes
def test_a_lone_surrogate_echoed_by_a_tool_does_not_crash_the_rollout() -> None:
    """`\\ud800` in JSON decodes to a lone surrogate, which the tokenizer cannot encode as is."""
    weird = '<tool_call>{"name": "a\\ud800b", "arguments": {}}</tool_call>'
    [[traj]], _ = play(by_turn(weird, ANSWER))
    assert traj.finish_reason == "stop" and traj.usable
    observation = traj.messages[1]["content"]
    assert observation.startswith("Error: unknown tool") and "\ud800" not in observation


def test_absurd_tool_call_json_is_a_malformed_call() -> None:
    deep = "<tool_call>" + "[" * 100_000 + "</tool_call>"
    huge = '<tool_call>{"name": "add", "arguments": {"a": ' + "9" * 5000 + "}}</tool_call>"
    for text in (deep, huge):
        [[traj]], _ = play(by_turn(text, ANSWER))
        assert traj.info["tool_errors/malformed"] == 1.0 and traj.usable


class NoneRewardEnv(AddEnv):
    def finish(self, assistant_text: str) -> EnvStep:
        return EnvStep(rewards={"success": None}, done=True)  # type: ignore[dict-item]


def test_an_env_reward_that_is_not_a_number_is_an_env_error() -> None:
    [[traj]], _ = play(by_turn(ANSWER), make_env=NoneRewardEnv)
    assert traj.finish_reason == "error" and traj.reward_errors == ("env",)
    assert "expected a number" in traj.info["reward_errors"]["env"]
    assert len(traj.turn_rewards) == len(traj.turns)


# A Qwen3-style template: the last assistant message gets an empty think block, earlier ones do not.
QWEN3_LIKE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_templates_that_render_the_last_assistant_turn_differently_still_give_exact_glue() -> None:
    tok = make_tokenizer()
    tok.chat_template = QWEN3_LIKE
    [[traj]], _ = play(by_turn(CALL_ADD, ANSWER), tok=tok)
    text = tok.decode(list(traj.token_ids))
    assert "<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n" + ANSWER in text
    assert traj.rewards["success"] == 1.0


class BrokenResetEnv(AddEnv):
    def reset(self) -> EnvReset:
        raise RuntimeError("no world today")


def test_an_env_whose_reset_raises_is_an_env_error_not_a_crash() -> None:
    [[bad], [good]], _ = play(
        by_turn(ANSWER),
        tasks=[task(task_id="bad"), task(task_id="good")],
        make_env=lambda t: BrokenResetEnv(t) if t.id == "bad" else AddEnv(t),
    )
    assert bad.finish_reason == "error" and bad.reward_errors == ("env",) and not bad.turns
    assert "reset failed: RuntimeError: no world today" in bad.info["reward_errors"]["env"]
    assert good.finish_reason == "stop" and good.rewards["success"] == 1.0


class SlowEnv(AddEnv):
    def finish(self, assistant_text: str) -> EnvStep:
        time.sleep(0.5)  # e.g. code run in the sandbox
        return super().finish(assistant_text)


def test_slow_env_steps_run_in_parallel_and_stay_in_order() -> None:
    tasks = [task(task_id=f"t{i}", answer=5 if i % 2 else 6) for i in range(4)]
    started = time.monotonic()
    groups, _ = play(
        by_turn(ANSWER), tasks=tasks, make_env=SlowEnv, limits=RolloutLimits(env_workers=4)
    )
    elapsed = time.monotonic() - started
    assert elapsed < 1.5, elapsed  # four 0.5 s steps side by side, not one after another
    assert [g[0].task_id for g in groups] == ["t0", "t1", "t2", "t3"]
    assert [g[0].rewards["success"] for g in groups] == [0.0, 1.0, 0.0, 1.0]


def test_parallel_rubric_functions_score_all_trajectories_at_once() -> None:
    from rlvr.verifiers.rubric import parallel_reward

    @parallel_reward
    def slow_check(completion: str, **_: object) -> float:
        time.sleep(0.5)  # e.g. running the answer's code in the sandbox
        return float("5" in completion)

    @parallel_reward
    def broken(completion: str, **_: object) -> float:
        raise RuntimeError("sandbox unavailable")

    rubric = Rubric(
        [RewardFunction("slow", slow_check), RewardFunction("broken", broken, weight=0)]
    )
    tasks = [task(task_id=f"t{i}") for i in range(4)]
    started = time.monotonic()
    groups, _ = play(
        by_turn(ANSWER),
        tasks=tasks,
        make_env=SingleTurnEnv,
        scoring=Scoring(rubric=rubric),
        limits=RolloutLimits(env_workers=4),
    )
    assert time.monotonic() - started < 1.5
    trajs = [g[0] for g in groups]
    assert all(t.rewards["slow"] == 1.0 for t in trajs)
    # A parallel function that raises is still an error of that trajectory, never a 0.
    assert all(
        t.reward_errors == ("broken",)
        and "sandbox unavailable" in t.info["reward_errors"]["broken"]
        for t in trajs
    )
