"""The environment protocol every rollout goes through, single-turn tasks included.

An `Env` is single-use: one instance plays one trajectory.

    reset()            -> EnvReset(messages, tools)          the opening conversation (and tool schemas)
    step(assistant)    -> EnvStep(messages, rewards, done)   what the world answers to one assistant turn

`step` receives the assistant's text exactly as decoded from the sampled tokens. Its `messages` (role
"user" or "tool") are appended to the conversation and tokenized as observations: they are context for
the next turn and never receive gradient. `rewards` are named reward parts earned by this turn; a
trajectory's component is the sum over its turns, and turn-level credit uses them per turn.

An `EnvFamily` is what a config names (`task.env.name`): it generates seeded task instances with a
held-out split (`make_splits`) and builds the env that plays one (`make`). A fixed hash of each
instance's `split_key` decides held-out membership, so no seed (and no other num_train, or curriculum
level over the same key) can put a held-out instance into training. The key is the level at which
two instances must not be split apart: by default the id (the content), but e.g. Sudoku's is the
answer grid and Sokoban's the room, so that no held-out puzzle shares its solution with a train
puzzle, or starts from a state that playing a train level can reach (tests/test_splits.py).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from rlvr.errors import ConfigError
from rlvr.records import Task
from rlvr.registry import ENVS

Message = dict[str, Any]


@dataclass(frozen=True)
class EnvReset:
    """The opening conversation: chat messages and (for tool use) JSON tool schemas. `state_key`:
    optionally the opening state's key, of the kind `EnvStep.info["state_key"]` gives (GiGPO then
    puts a group's first turns in one anchor group with any later return to that state)."""

    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)
    state_key: Any = None


STATE_KEY = "state_key"


@dataclass(frozen=True)
class EnvStep:
    """The answer to one assistant turn.

    `messages`: observation messages to append (empty when done). `rewards`: reward parts earned by
    this turn, by name. `done`: the episode is over. `info`: counters for metrics (e.g. tool calls),
    and optionally `info["state_key"]` (STATE_KEY), a hashable key of the state the next turn acts
    from: GiGPO's credit groups turns by it instead of by the observation's text.
    """

    messages: list[Message] = field(default_factory=list)
    rewards: dict[str, float] = field(default_factory=dict)
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Env(ABC):
    """One episode. Subclasses implement `reset` and `step`. `max_turns` is the default turn cap
    (`rollout.max_turns` overrides it); a family may set it per instance, e.g. by puzzle size.

    `episode_index` is the episode's place in its group (0..G-1), set by the engine before `reset`.
    An env with chance in it (slippery ice) seeds from its task id and this index: the G episodes of
    a group differ, and a replayed or resumed run draws exactly the same (no process counter)."""

    max_turns: int = 1
    episode_index: int = 0

    @abstractmethod
    def reset(self) -> EnvReset: ...

    @abstractmethod
    def step(self, assistant_text: str) -> EnvStep: ...


class EnvOptions(BaseModel):
    """Base for an env family's options (`task.env.options`): unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class EnvFamily(ABC):
    """A registered environment: generates instances and builds the env that plays one.

    Subclasses set `name`, `description` (one line, shown by `rlvr envs`), `Options` (a pydantic
    model), `success_metric` (the reward part read as held-out accuracy), optionally `reward_weights`
    (parts not listed weigh 1.0), and implement `generate` and `make`.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    Options: ClassVar[type[EnvOptions]] = EnvOptions
    success_metric: ClassVar[str] = "success"
    reward_weights: ClassVar[Mapping[str, float]] = {}
    example_config: ClassVar[str] = ""  # path under examples/, for `rlvr envs`

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        try:
            self.options = self.Options.model_validate(dict(options or {}))
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ConfigError(
                f"task.env.options.{where}: {first['msg']} (env '{self.name}')"
            ) from None

    @abstractmethod
    def generate(self, seed: int) -> Task:
        """One instance from an integer seed; `Task.id` must be a canonical key of its content
        (two seeds that give the same puzzle give the same id). Everything `make` needs goes into
        `Task.fields`, so a task alone rebuilds its env."""

    @abstractmethod
    def make(self, task: Task) -> Env:
        """A fresh env playing `task`."""

    def split_key(self, task: Task) -> str:
        """What a fixed hash decides the side of: instances with the same key are all train or all
        held out. The id by default; a family whose instances can share a solution, or reach one
        another's start in play, returns the coarser thing they share (docs/envs.md, splits)."""
        return task.id

    def make_splits(
        self, num_train: int, num_heldout: int, heldout_fraction: float = 0.1
    ) -> tuple[list[Task], list[Task]]:
        return split_instances(
            self.generate, num_train, num_heldout, heldout_fraction, split_key=self.split_key
        )


def stable_fraction(key: str) -> float:
    """A number in [0, 1) fixed by `key` alone (not Python's salted hash)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def split_instances(
    generate: Callable[[int], Task],
    num_train: int,
    num_heldout: int,
    heldout_fraction: float = 0.1,
    max_tries_factor: int = 50,
    split_key: Callable[[Task], str] | None = None,
) -> tuple[list[Task], list[Task]]:
    """Generate distinct instances from seeds 0, 1, 2, ... and split them by a hash of their key.

    An instance is held out iff stable_fraction(split_key(task)) < heldout_fraction (the key is the
    id when `split_key` is None), whatever seed produced it, so the two lists never share a key.
    Stops when both lists are full; raises a ConfigError if the family cannot produce that many
    distinct instances (e.g. a tiny option space).
    """
    train: list[Task] = []
    heldout: list[Task] = []
    seen: set[str] = set()
    budget = max_tries_factor * (num_train + num_heldout) + 1000
    seed = 0
    while len(train) < num_train or len(heldout) < num_heldout:
        if seed >= budget:
            raise ConfigError(
                f"only {len(train)} train / {len(heldout)} held-out distinct instances after "
                f"{seed} seeds; ask for fewer (task.env.num_train / num_heldout) or widen the options"
            )
        task = generate(seed)
        seed += 1
        if task.id in seen:
            continue
        seen.add(task.id)
        key = task.id if split_key is None else split_key(task)
        if stable_fraction(key) < heldout_fraction:
            if len(heldout) < num_heldout:
                heldout.append(task)
        elif len(train) < num_train:
            train.append(task)
    return train, heldout


ENV_FAMILIES: dict[str, type[EnvFamily]] = {}


def register_env(cls: type[EnvFamily]) -> type[EnvFamily]:
    """Class decorator: make the family available as `task.env.name: <cls.name>`."""
    if cls.name in ENV_FAMILIES:
        raise ValueError(f"env '{cls.name}' is registered twice")
    ENV_FAMILIES[cls.name] = cls
    return cls


def get_env_family(name: str, options: Mapping[str, Any] | None = None) -> EnvFamily:
    """A built-in family by name, an installed plug-in (entry-point group `rlvr.envs`), or your own:
    'file.py:MyFamily' / 'package.module:MyFamily' (rlvr.registry)."""
    family: type[EnvFamily] = ENVS.resolve(name)
    return family(options)


def as_env_family(obj: Any, ref: str) -> type[EnvFamily]:
    """`obj` if it is an EnvFamily subclass (rlvr.registry's check for `task.env.name`)."""
    if not (isinstance(obj, type) and issubclass(obj, EnvFamily)):
        raise ConfigError(f"task.env.name '{ref}' is not an EnvFamily subclass")
    return obj


class SingleTurnEnv(Env):
    """A plain task as a one-step env: the task's messages, one answer, done. The rubric scores it."""

    max_turns = 1

    def __init__(self, task: Task) -> None:
        self.task = task

    def reset(self) -> EnvReset:
        return EnvReset([dict(m) for m in self.task.messages], [dict(t) for t in self.task.tools])

    def step(self, assistant_text: str) -> EnvStep:
        return EnvStep(done=True)


class AnswerWithFeedbackEnv(Env):
    """Puzzles answered whole (Countdown, Sudoku): each turn is an answer; a wrong one gets feedback
    and another try, up to `max_turns`. Subclasses set `self.task` and implement `check`.

    Reward parts per turn: `success` (1.0 on the solving turn) and `format` (1.0 the first time a
    well-formed answer is given: paid once per episode, so missing on purpose before the right
    answer earns nothing extra).
    """

    max_turns = 2
    task: Task

    def __init__(self) -> None:
        self.turns = 0
        self.format_paid = False
        self.done = False

    @abstractmethod
    def check(self, assistant_text: str) -> tuple[bool, bool, str]:
        """(well formed, solved, feedback for a wrong answer) for one answer."""

    def reset(self) -> EnvReset:
        return EnvReset(messages=[dict(m) for m in self.task.messages])

    def step(self, assistant_text: str) -> EnvStep:
        if self.done:
            raise RuntimeError("step() called after the episode ended")
        self.turns += 1
        parsed, solved, feedback = self.check(assistant_text)
        fmt = 1.0 if parsed and not self.format_paid else 0.0
        self.format_paid = self.format_paid or parsed
        rewards = {"success": 1.0 if solved else 0.0, "format": fmt}
        info = {"turn": self.turns, "parsed": parsed}
        if solved:
            self.done = True
            return EnvStep(rewards=rewards, done=True, info=info)
        observation: list[Message] = [{"role": "user", "content": f"{feedback} Try again."}]
        return EnvStep(messages=observation, rewards=rewards, done=False, info=info)
