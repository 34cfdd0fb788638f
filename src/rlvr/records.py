"""The records every stage passes along: `Task` -> `Trajectory` -> `Group`.

Shape convention used across rlvr wherever tensors cross a function boundary: a suffix names the axes,
`_B` trajectories in a batch, `_P` prompts (tasks), `_G` members of a group, `_T` token positions, so
`logprobs_B_T` is a (B, T) tensor. Plain lists in these records are per token (length T) unless said.

A `Trajectory` is token-exact: `token_ids` is built by appending the prompt's tokens, then each token as
the policy sampled it, then (multi-turn) each observation as it is tokenized. It is never rebuilt by
re-tokenizing decoded text, which silently shifts masks (TRL #5144).

With `rollout.history: window` each turn is sampled from a shorter prompt than the whole conversation:
the opening plus the last K turns. The episode's `Trajectory` still holds the whole conversation (for
scoring, metrics and reading) and records where each turn's history began (`history_starts`); the
update trains on its per-turn samples (`Trajectory.turn_samples`), each token-exact for its own prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

# stop: the episode ended (EOS / stop string single-turn, env done multi-turn); length: a token limit
# cut the last turn; max_turns: the turn cap ended an unfinished episode; error: the env raised.
FinishReason = Literal["stop", "length", "max_turns", "error"]


@dataclass(frozen=True)
class Task:
    """What a rollout starts from.

    `messages` are chat messages (`{"role": ..., "content": ...}`); `fields` carries whatever the verifiers
    need (`answer`, `tests`, ...) and reaches each reward function by keyword. `id` is stable across runs
    so rollouts can be traced back to their task. `source` names the mixture component (task set or
    env) the task came from; "" for a run with one source.
    """

    id: str
    messages: tuple[Mapping[str, str], ...]
    fields: Mapping[str, Any] = field(default_factory=dict)
    tools: tuple[Mapping[str, Any], ...] = ()
    source: str = ""


@dataclass(frozen=True)
class Span:
    """A half-open token range [start, end) inside a trajectory; one per assistant turn."""

    start: int
    end: int


@dataclass(frozen=True)
class EpisodeTurn:
    """Where a per-turn training sample comes from: turn `index` of `episode` (a windowed episode)."""

    episode: Trajectory
    index: int


@dataclass(frozen=True)
class Trajectory:
    """One finished rollout of a task.

    Invariants (checked in `__post_init__`): `token_ids`, `policy_mask` and `logprobs` have equal length T;
    `logprobs[t]` is the behaviour policy's log-prob of `token_ids[t]` where `policy_mask[t] == 1` and 0.0
    elsewhere; `prompt_length` tokens come first. `turns` holds the span of each assistant turn (the
    tokens between two spans are observations and template glue, policy_mask 0).
    `rewards` are the components by name (rubric functions and the env's reward parts summed over
    turns), `reward` their weighted total and `turn_rewards` that total split by turn (the rubric's
    share lands on the last turn); `reward_errors` names the components whose function raised (such a
    trajectory is excluded from the update). `completion_text` is the last assistant turn's text,
    `messages` the conversation after the prompt (assistant turns as decoded, observations as sent).

    `history_starts` (`rollout.history: window`; empty for full history): one per turn, where in
    `token_ids` the history turn k was sampled with begins. Turn k's prompt was exactly
    `token_ids[:prompt_length] + token_ids[history_starts[k]:turns[k].start]` (the opening, then the
    last K turns' actions and observations), so `logprobs` on turn k are conditioned on that prompt,
    not on the whole conversation: such an episode is trained through `turn_samples()`, never as one
    row (`windowed`; rlvr.train.batch.collate refuses it). `turn_of` marks a per-turn sample.
    """

    task_id: str
    token_ids: tuple[int, ...]
    policy_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    prompt_length: int
    completion_text: str
    finish_reason: FinishReason
    turns: tuple[Span, ...] = ()
    rewards: Mapping[str, float] = field(default_factory=dict)
    reward: float = 0.0
    reward_errors: tuple[str, ...] = ()
    turn_rewards: tuple[float, ...] = ()
    messages: tuple[Mapping[str, Any], ...] = ()
    source: str = ""
    info: Mapping[str, Any] = field(default_factory=dict)
    history_starts: tuple[int, ...] = ()
    turn_of: EpisodeTurn | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.policy_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"trajectory {self.task_id}: token_ids ({n}), policy_mask ({len(self.policy_mask)}) "
                f"and logprobs ({len(self.logprobs)}) must have the same length"
            )
        if not 0 <= self.prompt_length <= n:
            raise ValueError(f"trajectory {self.task_id}: prompt_length {self.prompt_length} > {n}")
        for span in self.turns:
            if not self.prompt_length <= span.start <= span.end <= n:
                raise ValueError(f"trajectory {self.task_id}: turn {span} outside the completion")
        if self.history_starts:
            if len(self.history_starts) != len(self.turns):
                raise ValueError(
                    f"trajectory {self.task_id}: {len(self.history_starts)} history starts for "
                    f"{len(self.turns)} turns"
                )
            for start, span in zip(self.history_starts, self.turns, strict=True):
                if not self.prompt_length <= start <= span.start:
                    raise ValueError(
                        f"trajectory {self.task_id}: history start {start} outside "
                        f"[{self.prompt_length}, {span.start}]"
                    )

    @property
    def completion_ids(self) -> tuple[int, ...]:
        """Every token after the prompt (sampled tokens and, multi-turn, observations)."""
        return self.token_ids[self.prompt_length :]

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.policy_mask)

    @property
    def windowed(self) -> bool:
        """True when some turn was sampled without the whole conversation before it (a window that
        dropped turns): the conversation as one row is not what the policy saw."""
        return any(start != self.prompt_length for start in self.history_starts)

    def turn_prompt_ids(self, k: int) -> tuple[int, ...]:
        """The exact prompt turn k was sampled from (the whole conversation before it without a
        window)."""
        start = self.history_starts[k] if self.history_starts else self.prompt_length
        return self.token_ids[: self.prompt_length] + self.token_ids[start : self.turns[k].start]

    def turn_samples(self) -> tuple[Trajectory, ...]:
        """One training sample per turn: turn k's prompt (`turn_prompt_ids`) then the tokens sampled
        for turn k, with their sampling log-probs. The sample's `prompt_length` is the opening's,
        and the kept turns after it are context inside its completion (policy_mask 0, like
        observations): the token sequence is the one the sampler saw, and the update's collate runs
        the opening once for every sample of a task (the G episodes' turns all share it). Rewards,
        errors, finish reason and info are the episode's (a sample is usable, or cut, exactly when
        its episode is); `turn_rewards` holds turn k's own reward; `turn_of` links back to the
        episode, whose credit the sample takes (rlvr.train.selection.assign_credit)."""
        out = []
        assistant = [m for m in self.messages if m.get("role") == "assistant"]
        for k, span in enumerate(self.turns):
            prompt = self.turn_prompt_ids(k)
            n, sampled = len(prompt), self.token_ids[span.start : span.end]
            out.append(
                Trajectory(
                    task_id=self.task_id,
                    token_ids=prompt + sampled,
                    policy_mask=(0,) * n + self.policy_mask[span.start : span.end],
                    logprobs=(0.0,) * n + self.logprobs[span.start : span.end],
                    prompt_length=self.prompt_length,
                    completion_text=str(assistant[k].get("content", ""))
                    if k < len(assistant)
                    else "",
                    finish_reason=self.finish_reason,
                    turns=(Span(n, n + len(sampled)),),
                    rewards=self.rewards,
                    reward=self.reward,
                    reward_errors=self.reward_errors,
                    turn_rewards=self.turn_rewards[k : k + 1],
                    source=self.source,
                    info={**self.info, "turn": k},
                    turn_of=EpisodeTurn(self, k),
                )
            )
        return tuple(out)

    @property
    def usable(self) -> bool:
        """False when a reward function raised on it, or when every one said "not applicable"
        (TRL-style None; `info["unscorable"]`): it must not shape the update."""
        return not self.reward_errors and "unscorable" not in self.info


@dataclass(frozen=True)
class Group:
    """The G trajectories sampled for one task; advantages are computed within a group."""

    task: Task
    trajectories: tuple[Trajectory, ...]

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]


def flatten(groups: Sequence[Group]) -> list[Trajectory]:
    """Trajectories of all groups, group-major (the order `view(-1, G)` expects)."""
    return [t for g in groups for t in g.trajectories]
