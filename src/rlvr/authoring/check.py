"""`rlvr env check`: play a few episodes of an env and show what training would see, turn by turn.

The episodes go through the real rollout engine (rollout/engine.py), so the text shown is the text
trained on: the opening conversation rendered by the chat template (with the tool schemas written in
by the template, or injected into the system message when the template ignores `tools=`), each
assistant turn's tokens (trained: policy_mask 1), the template glue and observations between turns
(masked: policy_mask 0), and the reward parts each turn earned.

The policy is, in order of preference: a model (`--model`, sampled at temperature 1); the family's
`scripted_action(task, messages) -> str` when it defines one (`messages`: the episode's
conversation after the opening, assistant turns and observations) (a solver, so an author sees the
successful path); else a random policy (a tool env gets a call to one of its tools with random
arguments of the schema's types, then a random `<answer>`; any other env random words and numbers).
Calls are written in the tool-call format the engine reads for this tokenizer (`--tool-format`, auto
= the chat template's; envs/tool_formats.py), shown with the tools: a scripted action's Hermes
`<tool_call>` blocks are rewritten into that format, so one scripted solver serves every family.

With `history="window"` (`rollout.history: window`, `--history window`) each turn after the
first K is sampled from the opening plus the last K turns only; the report then shows, before such a
turn, the windowed history it was sampled from (the tokens after the opening that its prompt kept),
and checks that every turn sample's prompt is the opening followed by exactly those tokens.

After each episode a few invariants are checked (every sampled token trained, every observation
masked and present in the tokens, every tool named in the prompt, no env error); a failed one is
printed as `PROBLEM:` and `rlvr env check` exits 1.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rlvr.envs.base import Env, EnvFamily, EnvReset, EnvStep, Message, get_env_family
from rlvr.envs.tool_formats import (
    HERMES,
    ToolCall,
    ToolFormat,
    from_hermes,
    resolve_tool_format,
)
from rlvr.envs.tools import Tool
from rlvr.observe.inspect import marked_text, trajectory_rows
from rlvr.records import Task, Trajectory
from rlvr.rollout.chat import TOOL_SYSTEM_PROMPT, template_renders_tools
from rlvr.rollout.engine import RolloutLimits, Scoring, rollout_groups
from rlvr.rollout.generator import Completion, Generator, SamplingParams

Policy = Callable[[Task, list[Message]], str]

_WORDS = (
    "yes", "no", "Up", "Left", "42", "7", "the", "answer", "is", "3 + 4",
    "<answer>5</answer>", "<answer>Right</answer>", "<answer>Down</answer>",
)  # fmt: skip
_STRINGS = ("3 + 4", "km", "apple", "hello", "42", "")


_FORWARDED = ("timeout_s", "max_calls_per_turn", "tool_format")


@dataclass
class _Turn:
    text: str
    step: EnvStep | None = None


class _Recorder(Env):
    """Wraps the family's env: keeps the conversation (for the scripted / random policy) and each
    turn's EnvStep (for its reward parts), and forwards the tool limits the engine sets."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.max_turns = env.max_turns
        self.messages: list[Message] = []  # after the opening: assistant turns and observations
        self.turns: list[_Turn] = []
        self.tools: list[dict[str, Any]] = []
        for limit in _FORWARDED:
            if hasattr(env, limit):
                setattr(self, limit, getattr(env, limit))

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FORWARDED:  # the engine's limits and tool format reach the real env
            setattr(self.env, name, value)
        object.__setattr__(self, name, value)

    def reset(self) -> EnvReset:
        opening = self.env.reset()
        self.tools = list(opening.tools)
        return opening

    def step(self, assistant_text: str) -> EnvStep:
        self.messages.append({"role": "assistant", "content": assistant_text})
        self.turns.append(_Turn(assistant_text))
        result = self.env.step(assistant_text)
        self.turns[-1].step = result if isinstance(result, EnvStep) else None
        if isinstance(result, EnvStep):
            self.messages.extend(dict(m) for m in result.messages)
        return result


class _PolicyGenerator:
    """A Generator whose turns come from a text policy: the text tokenized, then EOS (the turn
    ended as a model's would). One episode at a time, so every prompt is the recorder's."""

    def __init__(self, policy: Policy, tokenizer: Any, task: Task, recorder: _Recorder) -> None:
        self.policy, self.tokenizer, self.task, self.recorder = policy, tokenizer, task, recorder

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        text = self.policy(self.task, [dict(m) for m in self.recorder.messages])
        ids = [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        finish: Any = "length" if len(ids) >= sampling.max_new_tokens else "stop"
        ids = (
            ids[: sampling.max_new_tokens - 1]
            if finish == "stop"
            else ids[: sampling.max_new_tokens]
        )
        if finish == "stop" and self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        completion = Completion(tuple(ids), (0.0,) * len(ids), finish)
        return [[completion] * sampling.n for _ in prompts]


def _random_value(schema: Mapping[str, Any], rng: random.Random) -> Any:
    if "enum" in schema:
        return rng.choice(list(schema["enum"]))
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = rng.choice([k for k in kind if k != "null"] or ["null"])
    if kind == "integer":
        return rng.randint(0, 100)
    if kind == "number":
        return round(rng.uniform(0, 100), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [_random_value(schema.get("items", {}), rng) for _ in range(rng.randint(0, 2))]
    if kind == "object":
        return {}
    if kind == "null":
        return None
    return rng.choice(_STRINGS)


def random_policy(tools: Sequence[Tool], seed: int, tool_format: ToolFormat = HERMES) -> Policy:
    """Random valid actions: for a tool env, one call (written in `tool_format`) with random
    arguments of the right JSON types on the first turn, then a random `<answer>`; otherwise a few
    random words and numbers."""
    rng = random.Random(seed)

    def act(task: Task, messages: list[Message]) -> str:
        if tools and not messages:
            tool = rng.choice(list(tools))
            params = tool.schema["function"].get("parameters", {})
            required = set(params.get("required", []))
            arguments = {
                name: _random_value(spec, rng)
                for name, spec in params.get("properties", {}).items()
                if name in required or rng.random() < 0.5
            }
            return tool_format.render_calls([ToolCall(tool.name, arguments)])
        if tools:
            return f"<answer>{rng.randint(0, 1000)}</answer>"
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 5)))

    return act


def _describe_format(tool_format: ToolFormat, choice: str) -> list[str]:
    how = (
        "auto: detected from the chat template"
        if choice == "auto"
        else "set by --tool-format / rollout.tool_format"
    )
    return [
        f"tool-call format: {tool_format.name} ({how}; envs/tool_formats.py reads the calls):",
        f"  {tool_format.call_syntax}".replace("\n", "\n  "),
    ]


def _describe_tools(tokenizer: Any, schemas: Sequence[Mapping[str, Any]]) -> list[str]:
    if not schemas:
        return ["tools: none (a plain multi-turn env)"]
    native = template_renders_tools(tokenizer)
    where = (
        "rendered by the chat template itself (apply_chat_template(tools=...))"
        if native
        else "injected into the system message by rlvr.rollout.chat (this template ignores tools=):"
        + "\n  "
        + TOOL_SYSTEM_PROMPT.splitlines()[0]
    )
    lines = [f"tool schemas ({len(schemas)}), {where}"]
    lines += [f"  {json.dumps(dict(s))}" for s in schemas]
    lines.append('tool results come back as {"role": "tool"} messages: observations, masked')
    return lines


def _scripted_in(scripted: Policy, tool_format: ToolFormat) -> Policy:
    def act(task: Task, messages: list[Message]) -> str:
        return from_hermes(scripted(task, messages), tool_format)

    return act


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _parts(parts: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={_fmt(v)}" for k, v in parts.items()) or "(none)"


def _problems(traj: Trajectory, recorder: _Recorder, prompt_text: str) -> list[str]:
    """Invariants an author's env and template must keep."""
    problems = []
    spans = sum(s.end - s.start for s in traj.turns)
    if sum(traj.policy_mask) != spans:
        problems.append(f"{sum(traj.policy_mask)} trained tokens but the turns span {spans}")
    for s in traj.turns:
        if not all(traj.policy_mask[s.start : s.end]):
            problems.append(f"a sampled token in turn [{s.start}, {s.end}) is masked")
    if any(traj.policy_mask[: traj.prompt_length]):
        problems.append("a prompt token is trained")
    for name in (t["function"]["name"] for t in recorder.tools if "function" in t):
        if name not in prompt_text:
            problems.append(f"tool '{name}' does not appear in the rendered prompt")
    return problems


def _window_text(traj: Trajectory, k: int, tokens: Sequence[str]) -> str | None:
    """What turn k's prompt held after the opening (None for the first turn: the opening alone)."""
    start, span = traj.history_starts[k], traj.turns[k]
    if k == 0:
        return None
    if start == traj.prompt_length:
        return f"--- turn {k + 1} prompt: the opening + {_turns(1, k)} (the window is not full yet)"
    dropped = sum(1 for s in traj.turns[:k] if s.start < start)
    kept = "".join(tokens[start : span.start])
    return (
        f"--- turn {k + 1} prompt ({traj.prompt_length + span.start - start} tokens): the opening "
        f"above, {_turns(1, dropped)} dropped, then {_turns(dropped + 1, k)} as sampled:\n{kept}"
    )


def _turns(first: int, last: int) -> str:
    return f"turn {first}" if first == last else f"turns {first}-{last}"


def _sample_problems(traj: Trajectory) -> list[str]:
    """Each turn sample trains exactly on its windowed prompt and the turn's sampled tokens."""
    problems = []
    for k, (sample, span) in enumerate(zip(traj.turn_samples(), traj.turns, strict=True)):
        start = traj.history_starts[k] if traj.history_starts else traj.prompt_length
        prompt = traj.token_ids[: traj.prompt_length] + traj.token_ids[start : span.start]
        if sample.token_ids != prompt + traj.token_ids[span.start : span.end]:
            problems.append(f"turn {k + 1}'s training sample is not its prompt + its tokens")
        if sum(sample.policy_mask) != span.end - span.start:
            problems.append(f"turn {k + 1}'s training sample trains on the wrong tokens")
    return problems


def _observation_problems(masked: str, turn: _Turn) -> list[str]:
    if turn.step is None:
        return []
    return [
        f"observation {str(m.get('content'))[:40]!r} is not in the masked tokens after its turn"
        for m in turn.step.messages
        if str(m.get("content", "")).strip() and str(m.get("content")).strip()[:40] not in masked
    ]


def check_env(
    name: str,
    *,
    tokenizer: Any,
    options: Mapping[str, Any] | None = None,
    episodes: int = 2,
    seed: int = 0,
    generator: Generator | None = None,
    max_new_tokens: int = 256,
    max_turns: int | None = None,
    max_total_tokens: int = 2048,
    tool_format: str = "auto",
    colour: bool = False,
    write: Callable[[str], None] = print,
    history: Literal["full", "window"] = "full",
    history_turns: int = 2,
) -> int:
    """Play `episodes` episodes of env `name` and write the report; returns the number of problems."""
    family: EnvFamily = get_env_family(name, options)
    scripted = getattr(family, "scripted_action", None)
    weights = {**family.reward_weights}
    weights.setdefault(family.success_metric, 1.0)
    call_format = resolve_tool_format(tool_format, tokenizer)
    problems_total = 0
    write(f"env {family.name} ({type(family).__name__}) options {family.options.model_dump()}")
    policy_kind = "model" if generator else "scripted" if callable(scripted) else "random"
    write(f"policy: {policy_kind}; reward weights: {_parts(weights)} (parts not listed weigh 1)")
    write("legend: [[...]] trained tokens (policy_mask 1); everything else masked (policy_mask 0)")
    if history == "window":
        write(
            f"history: window of {history_turns} turn(s): each turn is sampled from the opening "
            f"plus the last {history_turns} turns, and trained as its own sample"
        )
    for episode in range(episodes):
        task = family.generate(seed + episode)
        recorder = _Recorder(family.make(task))
        tool_objects = [t for t in getattr(recorder.env, "tools", []) if isinstance(t, Tool)]
        policy: Policy = (
            _scripted_in(scripted, call_format)
            if callable(scripted)
            else random_policy(tool_objects, seed + episode, call_format)
        )
        engine_generator = generator or _PolicyGenerator(policy, tokenizer, task, recorder)
        limits = RolloutLimits(
            max_turns=max_turns,
            max_total_tokens=max_total_tokens,
            env_workers=1,
            tool_format=call_format.name,
            history=history,
            history_turns=history_turns,
        )

        def make_env(_task: Task, recorder: _Recorder = recorder) -> Env:
            return recorder

        group = rollout_groups(
            [task],
            make_env,
            engine_generator,
            tokenizer,
            SamplingParams(n=1, temperature=1.0, max_new_tokens=max_new_tokens),
            Scoring(env_weights=weights),
            limits,
        )[0]
        traj = group.trajectories[0]
        row = trajectory_rows(
            [traj], [[0.0] * (len(traj.token_ids) - traj.prompt_length)], tokenizer
        )[0]
        tokens, mask = row["tokens"], row["policy_mask"]
        prompt = "".join(tokens[: traj.prompt_length])
        write("")
        write(f"=== episode {episode + 1}/{episodes}: task {task.id}")
        if episode == 0:
            for line in _describe_tools(tokenizer, recorder.tools):
                write(line)
            if recorder.tools:
                for line in _describe_format(call_format, tool_format):
                    write(line)
        write(f"--- rendered prompt ({traj.prompt_length} tokens, masked):")
        write(prompt)
        problems = _problems(traj, recorder, prompt)
        for k, span in enumerate(traj.turns):
            end = traj.turns[k + 1].start if k + 1 < len(traj.turns) else len(tokens)
            turn = recorder.turns[k] if k < len(recorder.turns) else _Turn("")
            trained, masked = span.end - span.start, end - span.end
            if traj.windowed and (window := _window_text(traj, k, tokens)) is not None:
                write(window)
            write(
                f"--- turn {k + 1}: {trained} tokens trained, then {masked} masked (glue + observation):"
            )
            write(marked_text(tokens[span.start : end], mask[span.start : end], colour=colour))
            if turn.step is not None:
                write(f"    reward parts: {_parts(turn.step.rewards)}")
                counters = {k: v for k, v in turn.step.info.items() if v}
                if counters:
                    write(f"    info: {_parts(counters)}")
                write(f"    done: {turn.step.done}")
            if k + 1 < len(traj.turns):  # the last turn's observation is never appended
                problems += _observation_problems("".join(tokens[span.end : end]), turn)
        turn_rewards = ", ".join(_fmt(r) for r in traj.turn_rewards)
        write(
            f"--- episode end: finish {traj.finish_reason}, {len(traj.turns)} turns, "
            f"reward {_fmt(traj.reward)} (per turn: {turn_rewards or '-'})"
        )
        write(f"    reward parts over the episode: {_parts(traj.rewards)}")
        problems += [f"the env failed: {e}" for e in traj.info.get("reward_errors", {}).values()]
        problems += _sample_problems(traj)
        for problem in problems:
            write(f"PROBLEM: {problem}")
        problems_total += len(problems)
    write("")
    write(
        "ok: template and masks look right"
        if not problems_total
        else f"{problems_total} problem(s)"
    )
    return problems_total
