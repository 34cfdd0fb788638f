"""The rollout engine: many episodes at once on the Generator seam; pause, step the env, resume.

Every rollout (single-turn tasks included, as one-step envs) goes through `rollout_groups`:

    reset every env -> render each opening conversation once
    repeat until every episode is over:
        sample one assistant turn for every live episode (one batched generator call)
        append the sampled tokens (policy_mask 1, behaviour log-probs kept)
        env.step(decoded turn) -> observation messages, reward parts, done
        append the template glue + observation tokens (policy_mask 0, log-prob 0)
    score: rubric functions on the finished trajectory + the env's reward parts

Token-exact: a trajectory's ids are the rendered prompt, then exactly what was sampled, then the
observations tokenized on their own (rollout/chat.py), never a re-tokenization of decoded text.
Limits: the env's (or config's) max_turns, a budget on completion tokens (sampled + observations),
and a cap on each observation message's tokens (truncated on a configured side).

The Generator seam is stateless (vLLM's prefix cache makes re-sent conversations cheap there). A
generator with a `turn_session()` context (HFGenerator with `generator.turn_cache`) keeps each live
conversation's KV cache between the turns of one multi-turn rollout, so a turn prefills only the
observation glue; the session ends (caches dropped) when the rollout returns, before any update.

History (`RolloutLimits.history`): `full` samples each turn from the whole conversation so far;
`window` from the opening plus the last `history_turns` turns (each an assistant action and the
observation after it), verl-agent's memory and SkyRL / prime-rl's non-prefix histories. The window
is a slice of the conversation's own tokens (opening + token_ids[turns[k-K].start:]), never a
re-rendering, so it is token-exact too; the episode records each turn's history start and is trained
as one sample per turn (`Trajectory.turn_samples`). Token budgets count the whole episode either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from rlvr.envs.base import STATE_KEY, Env, EnvStep, SingleTurnEnv
from rlvr.envs.tool_formats import HERMES, ToolFormat, ToolFormatChoice, resolve_tool_format
from rlvr.observe.watchdog import watch
from rlvr.records import FinishReason, Group, Span, Task, Trajectory
from rlvr.rollout.chat import (
    Truncation,
    decode_turn,
    is_skipped_special,
    observation_glue_text,
    render_prompt_ids,
    truncate_text,
)
from rlvr.rollout.generator import Completion, Generator, SamplingParams
from rlvr.verifiers import Rubric
from rlvr.verifiers.rubric import Prefetched

EnvFactory = Callable[[Task], Env]


@dataclass(frozen=True)
class RolloutLimits:
    """Caps on one episode. `max_turns` None = the env's own default (`Env.max_turns`)."""

    max_turns: int | None = None
    max_total_tokens: int = 2048
    max_observation_tokens: int = 512
    observation_truncation: Truncation = "right"
    tool_timeout_s: float = 5.0
    max_tool_calls_per_turn: int = 4
    env_workers: int = 4  # threads stepping envs in parallel (1 = in the calling thread)
    tool_format: ToolFormatChoice = "auto"  # auto = the chat template's (envs/tool_formats.py)
    history: Literal["full", "window"] = "full"  # what each turn is sampled from (module docstring)
    history_turns: int = 2  # window: the last K turns after the opening

    def __post_init__(self) -> None:
        if self.history_turns < 1:
            raise ValueError(f"history_turns must be >= 1, got {self.history_turns}")


@dataclass(frozen=True)
class Scoring:
    """How a finished trajectory is scored: rubric functions (may be None) + the env's reward parts.

    Each env part weighs `env_weights.get(name, 1.0)`; weight 0 parts are logged, not optimised.
    """

    rubric: Rubric | None = None
    env_weights: Mapping[str, float] = field(default_factory=dict)

    def names(self, env_parts: Sequence[str] = ()) -> list[str]:
        return [*(self.rubric.names if self.rubric else ()), *env_parts]


@dataclass
class _Episode:
    task: Task
    env: Env
    max_turns: int
    tools: list[dict[str, Any]]
    token_ids: list[int]
    prompt_length: int
    policy_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[Span] = field(default_factory=list)
    turn_parts: list[dict[str, float]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, float] = field(default_factory=dict)
    state_keys: list[Any] = field(default_factory=list)  # env's `state_key` per step (GiGPO)
    initial_state_key: Any = None  # the reset's (EnvReset.state_key)
    history_starts: list[int] = field(default_factory=list)  # window: each turn's (Trajectory)
    last_text: str = ""
    finish: FinishReason | None = None
    error: str | None = None
    tool_format: ToolFormat = HERMES

    def __post_init__(self) -> None:
        self.policy_mask = [0] * len(self.token_ids)
        self.logprobs = [0.0] * len(self.token_ids)

    @property
    def used(self) -> int:
        return len(self.token_ids) - self.prompt_length

    def next_prompt(self, limits: RolloutLimits) -> list[int]:
        """The ids the next turn is sampled from; with a window, its history start is recorded."""
        if limits.history == "full":
            return self.token_ids
        first = len(self.turns) - limits.history_turns  # the oldest turn kept
        start = self.turns[first].start if first > 0 else self.prompt_length
        self.history_starts.append(start)
        return self.token_ids[: self.prompt_length] + self.token_ids[start:]


def _configure(env: Env, limits: RolloutLimits, tool_format: ToolFormat) -> None:
    # Tool envs read their per-call limits and call format from these attributes (envs/tools.py).
    if hasattr(env, "timeout_s"):
        env.timeout_s = limits.tool_timeout_s
    if hasattr(env, "max_calls_per_turn"):
        env.max_calls_per_turn = limits.max_tool_calls_per_turn
    if hasattr(env, "tool_format"):
        env.tool_format = tool_format


def _start(
    task: Task, make_env: EnvFactory, tokenizer: Any, limits: RolloutLimits, index: int = 0
) -> _Episode:
    tool_format = resolve_tool_format(limits.tool_format, tokenizer)
    try:
        env = make_env(task)
        _configure(env, limits, tool_format)
        env.episode_index = index  # its place in the group: seeds a random env (resume-safe)
        with watch("env_step", f"{type(env).__name__}.reset"):
            opening = env.reset()
    except Exception as exc:  # counted as an env error like a failing step, not a crash
        ids = render_prompt_ids(tokenizer, [dict(m) for m in task.messages])
        failed = _Episode(task, SingleTurnEnv(task), 1, [], ids, len(ids), finish="error")
        failed.error = f"reset failed: {type(exc).__name__}: {exc}"[:500]
        return failed
    ids = render_prompt_ids(tokenizer, opening.messages, opening.tools, tool_format)
    hash(opening.state_key)  # an unhashable key is the env's error, not a crash of the credit
    return _Episode(
        task=task,
        env=env,
        max_turns=limits.max_turns or env.max_turns,
        tools=list(opening.tools),
        token_ids=ids,
        prompt_length=len(ids),
        tool_format=tool_format,
        initial_state_key=opening.state_key,
    )


def _sample_turn(
    prompts: list[list[int]], generator: Generator, sampling: SamplingParams, budget: int
) -> list[Completion]:
    """One assistant turn for every live episode's prompt, in order, in one generator call.

    Identical prompts (the G samples of a task on their first turn) are sent once with n = G, so
    the generator prefills that prompt once.
    """
    params = dataclasses.replace(sampling, n=1, max_new_tokens=max(1, budget))
    order: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        order.setdefault(tuple(prompt), []).append(i)
    sizes = {len(v) for v in order.values()}
    out: list[Completion | None] = [None] * len(prompts)
    if len(sizes) == 1 and (k := sizes.pop()) > 1:
        with watch("generation"):
            results = generator.generate(list(order), dataclasses.replace(params, n=k))
        for members, completions in zip(order.values(), results, strict=True):
            for i, c in zip(members, completions, strict=True):
                out[i] = c
    else:
        with watch("generation"):
            results = generator.generate(prompts, params)
        for i, completions in enumerate(results):
            out[i] = completions[0]
    assert all(c is not None for c in out)
    return [c for c in out if c is not None]


def special_token_text(tokenizer: Any, token_id: int) -> str:
    """The decoded text of `token_id` when it is a special token (an EOS the policy sampled), else ""."""
    if is_skipped_special(tokenizer, token_id):
        return str(tokenizer.decode([token_id]))
    return ""


def _append_observation(
    ep: _Episode,
    step: EnvStep,
    tokenizer: Any,
    limits: RolloutLimits,
    sampled_eos_text: str,
) -> bool:
    """Append the observation's tokens; False when they do not fit the token budget."""
    messages = []
    for m in step.messages:
        content = m.get("content")
        # Whatever a tool echoed (lone surrogates included) must survive the tokenizer.
        content = "" if content is None else str(content)
        content = content.encode("utf-8", "replace").decode("utf-8")
        content = truncate_text(
            tokenizer, content, limits.max_observation_tokens, limits.observation_truncation
        )
        messages.append({**m, "content": content})
    glue = observation_glue_text(
        tokenizer,
        messages,
        ep.tools,
        sampled_eos_text=sampled_eos_text,
        turn_ends=ep.tool_format.turn_ends,
    )
    ids = [int(i) for i in tokenizer(glue, add_special_tokens=False)["input_ids"]]
    if ep.used + len(ids) >= limits.max_total_tokens:
        return False
    ep.token_ids.extend(ids)
    ep.policy_mask.extend([0] * len(ids))
    ep.logprobs.extend([0.0] * len(ids))
    ep.messages.extend(messages)
    return True


def _step_all(envs_and_texts: Sequence[tuple[Env, str]], workers: int) -> list[Any]:
    """env.step(text) for each pair; an exception is returned in place of its step.

    Steps can be slow (code run in the sandbox, tools), so they run in worker threads: a slow one
    holds back only the end of this turn, never the other episodes' steps.
    """

    def one(pair: tuple[Env, str]) -> Any:
        try:
            with watch("env_step", f"{type(pair[0]).__name__}.step"):
                return pair[0].step(pair[1])
        except Exception as exc:
            return exc

    if workers <= 1 or len(envs_and_texts) <= 1:
        return [one(pair) for pair in envs_and_texts]
    with ThreadPoolExecutor(min(workers, len(envs_and_texts))) as pool:
        return list(pool.map(one, envs_and_texts))


def _advance(
    ep: _Episode,
    step: EnvStep,
    cut: bool,
    eos_text: str,
    tokenizer: Any,
    limits: RolloutLimits,
) -> None:
    """Record one env step's reward parts; append the observation or end the episode. Anything
    raised here is the env's failure (the caller records it)."""
    if not isinstance(step, EnvStep):
        raise TypeError(f"env.step returned {type(step).__name__}, expected EnvStep")
    parts = {}
    for name, value in step.rewards.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"reward part {name!r} is {type(value).__name__}, expected a number")
        if not math.isfinite(value):
            raise ValueError(f"reward part {name!r} is {value}")
        parts[name] = float(value)
    state_key = step.info.get(STATE_KEY)
    hash(state_key)  # an unhashable key is the env's error, not a crash of the credit
    ep.turn_parts.append(parts)
    ep.state_keys.append(state_key)
    for key, value in step.info.items():
        if key != STATE_KEY and isinstance(value, (int, float)):
            ep.info[key] = ep.info.get(key, 0.0) + float(value)
    if step.done:
        ep.finish = "length" if cut else "stop"
    elif ep.used >= limits.max_total_tokens:
        ep.finish = "length"
    elif len(ep.turns) >= ep.max_turns:
        ep.finish = "max_turns"
    elif not _append_observation(ep, step, tokenizer, limits, eos_text):
        ep.finish = "length"


def run_episodes(
    tasks: Sequence[Task],
    make_env: EnvFactory,
    generator: Generator,
    tokenizer: Any,
    sampling: SamplingParams,
    limits: RolloutLimits,
) -> list[list[_Episode]]:
    """Play `sampling.n` episodes of each task to the end; (P, G) finished episodes."""
    episodes = [
        [_start(t, make_env, tokenizer, limits, i) for i in range(sampling.n)] for t in tasks
    ]
    flat = [ep for group in episodes for ep in group]
    session = getattr(generator, "turn_session", None)
    multi_turn = any(ep.max_turns > 1 and ep.finish is None for ep in flat)
    with session() if session is not None and multi_turn else contextlib.nullcontext():
        _play(flat, generator, tokenizer, sampling, limits)
    return episodes


def _play(
    flat: list[_Episode],
    generator: Generator,
    tokenizer: Any,
    sampling: SamplingParams,
    limits: RolloutLimits,
) -> None:
    """Turns until every episode is over (run_episodes' loop)."""
    while live := [ep for ep in flat if ep.finish is None]:
        budget = min(sampling.max_new_tokens, max(limits.max_total_tokens - ep.used for ep in live))
        pending: list[tuple[_Episode, str, bool, str]] = []
        prompts = [ep.next_prompt(limits) for ep in live]
        for ep, completion in zip(
            live, _sample_turn(prompts, generator, sampling, budget), strict=True
        ):
            room = limits.max_total_tokens - ep.used
            sampled = list(completion.token_ids[:room])
            cut = len(sampled) < len(completion.token_ids) or completion.finish_reason == "length"
            start = len(ep.token_ids)
            ep.token_ids.extend(sampled)
            ep.policy_mask.extend([1] * len(sampled))
            ep.logprobs.extend(completion.logprobs[: len(sampled)])
            ep.turns.append(Span(start, len(ep.token_ids)))
            # The env sees the turn without special tokens, but with its tool-call markers.
            text = decode_turn(tokenizer, sampled, ep.tool_format.markers)
            ep.last_text = text
            ep.messages.append({"role": "assistant", "content": text})
            eos_text = "" if not sampled or cut else special_token_text(tokenizer, sampled[-1])
            pending.append((ep, text, cut, eos_text))
        steps = _step_all([(ep.env, text) for ep, text, _, _ in pending], limits.env_workers)
        for (ep, _, cut, eos_text), step in zip(pending, steps, strict=True):
            try:
                if isinstance(step, Exception):
                    raise step
                _advance(ep, step, cut, eos_text, tokenizer, limits)
            except Exception as exc:  # a broken env is reported, never turned into a reward
                ep.error = f"{type(exc).__name__}: {exc}"[:500]
                if len(ep.turn_parts) < len(ep.turns):  # one entry per turn, for turn credit
                    ep.turn_parts.append({})
                ep.finish = "error"


def _unscored(ep: _Episode) -> Trajectory:
    return Trajectory(
        task_id=ep.task.id,
        token_ids=tuple(ep.token_ids),
        policy_mask=tuple(ep.policy_mask),
        logprobs=tuple(ep.logprobs),
        prompt_length=ep.prompt_length,
        completion_text=ep.last_text,
        finish_reason=ep.finish or "error",
        turns=tuple(ep.turns),
        messages=tuple(ep.messages),
        source=ep.task.source,
        history_starts=tuple(ep.history_starts),
    )


def _trajectory(
    ep: _Episode, trajectory: Trajectory, scoring: Scoring, prefetched: Prefetched | None = None
) -> Trajectory:
    """Score a finished episode: env parts summed over turns + rubric components."""
    # Declared parts an episode never earned (cut before its final answer) count 0, so per-component
    # means are over every episode, not only the ones that got that far.
    parts: dict[str, float] = dict.fromkeys(scoring.env_weights, 0.0)
    for turn in ep.turn_parts:
        for name, value in turn.items():
            parts[name] = parts.get(name, 0.0) + value
    turn_totals = [
        sum(scoring.env_weights.get(n, 1.0) * v for n, v in turn.items()) for turn in ep.turn_parts
    ]
    info: dict[str, Any] = {**ep.info, "num_turns": len(ep.turns)}
    if any(key is not None for key in ep.state_keys):
        info["state_keys"] = tuple(ep.state_keys)  # read by GiGPO's credit (turn_state_keys)
    if ep.initial_state_key is not None:
        info["initial_state_key"] = ep.initial_state_key
    errors: dict[str, str] = {}
    if ep.error is not None:
        errors["env"] = ep.error
    rewards = dict(parts)
    if scoring.rubric is not None:
        score = scoring.rubric.score(trajectory, ep.task, prefetched)
        rewards.update(score.rewards)
        errors.update(score.errors)
        if turn_totals:
            turn_totals[-1] += score.total
        if score.skipped:  # eval leaves these out of a metric's mean, as TRL's nanmean does
            info["not_applicable"] = list(score.skipped)
        if score.skipped and not rewards and not errors:
            # Every reward function said "not applicable" (TRL's None): TRL leaves such a sample
            # out of its group's baseline and gives it no advantage; `usable` is False for it.
            info["unscorable"] = list(score.skipped)
    if errors:
        info["reward_errors"] = errors
    return dataclasses.replace(
        trajectory,
        rewards=rewards,
        reward=sum(turn_totals) if not errors else 0.0,
        turn_rewards=tuple(turn_totals),
        reward_errors=tuple(sorted(errors)),
        info=info,
    )


def rollout_groups(
    tasks: Sequence[Task],
    make_env: EnvFactory,
    generator: Generator,
    tokenizer: Any,
    sampling: SamplingParams,
    scoring: Scoring | Callable[[Task], Scoring],
    limits: RolloutLimits | None = None,
) -> list[Group]:
    """Play and score `sampling.n` trajectories per task (a (P, G) list of groups).

    `scoring` may be a function of the task (a mixture scores each source its own way). Without
    `limits`, one turn of at most `sampling.max_new_tokens` tokens (the single-turn case)."""
    limits = limits or RolloutLimits(max_total_tokens=sampling.max_new_tokens)
    episodes = run_episodes(tasks, make_env, generator, tokenizer, sampling, limits)
    plans = [
        (ep, _unscored(ep), scoring(task) if callable(scoring) else scoring)
        for task, group in zip(tasks, episodes, strict=True)
        for ep in group
    ]
    # Slow, thread-safe rubric functions (code execution) run across all trajectories at once.
    prefetched: Prefetched = {}
    for rubric in {id(how.rubric): how.rubric for _, _, how in plans if how.rubric}.values():
        pairs = [(traj, ep.task) for ep, traj, how in plans if how.rubric is rubric]
        prefetched.update(rubric.prefetch(pairs, workers=limits.env_workers))
    scored_list = [_trajectory(ep, traj, how, prefetched) for ep, traj, how in plans]
    unscorable = [t for t in scored_list if "unscorable" in t.info]
    if unscorable:
        warnings.warn(
            f"{len(unscorable)}/{len(scored_list)} rollouts: every reward function returned None "
            f"(e.g. task {unscorable[0].task_id!r}); they are left out of the update",
            stacklevel=2,
        )
    scored = iter(scored_list)
    return [
        Group(task=task, trajectories=tuple(next(scored) for _ in group))
        for task, group in zip(tasks, episodes, strict=True)
    ]
