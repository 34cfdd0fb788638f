"""The records every stage passes along: `Task` -> `Trajectory` -> `Group`.

Shape convention used across rlvr wherever tensors cross a function boundary: a suffix names the axes,
`_B` trajectories in a batch, `_P` prompts (tasks), `_G` members of a group, `_T` token positions, so
`logprobs_B_T` is a (B, T) tensor. Plain lists in these records are per token (length T) unless said.

A `Trajectory` is token-exact: `token_ids` is built by appending the prompt's tokens, then each token as
the policy sampled it, then (multi-turn) each observation as it is tokenized. It is never rebuilt by
re-tokenizing decoded text, which silently shifts masks (TRL #5144).
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

    @property
    def completion_ids(self) -> tuple[int, ...]:
        """Every token after the prompt (sampled tokens and, multi-turn, observations)."""
        return self.token_ids[self.prompt_length :]

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.policy_mask)

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
