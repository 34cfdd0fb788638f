"""Gymnasium environments as rlvr envs: the model reads an observation as text and answers an action.

A `GymSpec` says how to play one gymnasium env in text: `make` (a gym id, or a factory of the task),
`render` (observation -> text), `parse` (the assistant's text -> an action), and `rewards` (the gym
reward of a step -> rlvr reward parts). `GymEnv` plays one episode of it; `gym_family` turns a spec
into an `EnvFamily` with seeded instances and a disjoint held-out split, in a few lines:

    spec = GymSpec(
        make=lambda task: gymnasium.make("Taxi-v3"),
        render=lambda obs, env: describe_taxi(env.unwrapped.decode(obs)),
        parse=parse_taxi_action,          # text -> int, None (or raise InvalidAction) if none
        instruction="Answer with one action inside <answer></answer>.",
    )
    TaxiFamily = gym_family("taxi", spec, system_prompt="You drive a taxi ...", max_turns=20)

and a config names it `task.env.name: my_envs.py:TaxiFamily`.

Per turn: a text the parser rejects (or an action outside the action space) changes nothing and
earns the `invalid_action` part 1.0 (weigh it negative), with an observation saying what was wrong;
a valid action steps the gym env, and its reward becomes the spec's parts (default: `success` 1.0
when the episode terminates with a positive reward). The episode ends when gym says terminated or
truncated, or at `max_turns`.

Seeding, so episodes are reproducible and resume-safe: an instance is the gym reset seed
(`Task.fields["gym_seed"]`), fixing the start state the prompt shows. The chance in the dynamics
(slippery ice, random opponents) comes from the env's `np_random`, reseeded after reset from the task
id and the episode's `episode_index` in its group (set by the engine): the G episodes of a group
differ, and a replayed or resumed run draws the same. A task without `gym_seed` (e.g. a FrozenLake
map given as `desc`) resets with that episode seed itself.

`info["state_key"]` is a hashable of the gym observation (`GymSpec.state_key`), for GiGPO's anchor
states.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlvr.envs.base import (
    STATE_KEY,
    Env,
    EnvFamily,
    EnvOptions,
    EnvReset,
    EnvStep,
    Message,
)
from rlvr.records import Task

INVALID_ACTION = "invalid_action"


class InvalidAction(ValueError):
    """Raised by a parser: the text names no valid action; the message is shown to the model."""


def stable_seed(key: str) -> int:
    """A 64-bit seed fixed by `key` alone (not Python's salted hash)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


def hashable(observation: Any) -> Hashable:
    """A hashable, comparable copy of a gym observation: numbers as plain Python numbers, arrays as
    (shape, values), tuples and dicts element by element."""
    if isinstance(observation, (str, bytes, bool, int, float)) or observation is None:
        return observation
    if hasattr(observation, "tolist") and hasattr(observation, "shape"):  # numpy arrays, scalars
        values = observation.tolist()
        if observation.shape == ():  # a numpy scalar: the plain Python number
            return values
        return (tuple(observation.shape), _freeze(values))
    if isinstance(observation, Mapping):
        return tuple((k, hashable(observation[k])) for k in sorted(observation))
    if isinstance(observation, (tuple, list)):
        return tuple(hashable(v) for v in observation)
    return repr(observation)


def _freeze(values: Any) -> Any:
    return tuple(_freeze(v) for v in values) if isinstance(values, list) else values


def success_reward(
    reward: float, terminated: bool, truncated: bool, info: Mapping[str, Any]
) -> dict[str, float]:
    """The default reward mapping: `success` 1.0 when the episode terminates with a positive reward."""
    return {"success": 1.0 if terminated and reward > 0 else 0.0}


RewardMap = Callable[[float, bool, bool, Mapping[str, Any]], Mapping[str, float]]


@dataclass(frozen=True)
class GymSpec:
    """How to play a gymnasium env in text.

    make: a gym id (`gymnasium.make(id)`) or a function of the task returning a fresh gym env.
    render(observation, gym_env) -> str: what the model reads of an observation.
    parse(text) -> action: the action the assistant's text names; None or `InvalidAction(why)` if
        none (an action outside the env's action space is invalid too).
    rewards(reward, terminated, truncated, info) -> parts: one step's reward parts (`reward_parts`
        names them all; each is 0.0 on a turn that does not mention it).
    instruction: appended to every observation (how to answer).
    state_key(observation) -> hashable: GiGPO's state key (default: `hashable`).
    """

    make: str | Callable[[Task], Any]
    render: Callable[[Any, Any], str]
    parse: Callable[[str], Any]
    rewards: RewardMap = success_reward
    reward_parts: tuple[str, ...] = ("success",)
    instruction: str = ""
    state_key: Callable[[Any], Hashable] = hashable
    gym_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def build(self, task: Task) -> Any:
        if isinstance(self.make, str):
            import gymnasium

            return gymnasium.make(self.make, **dict(self.gym_kwargs))
        return self.make(task)


class GymEnv(Env):
    """One episode of a gymnasium env played in text (see the module docstring).

    `seed` overrides the episode seed (default: from the task id and `episode_index`). Subclasses
    may override `describe` to narrate a step (its text goes before the rendered observation).
    """

    max_turns = 8

    def __init__(
        self, task: Task, spec: GymSpec, *, max_turns: int | None = None, seed: int | None = None
    ) -> None:
        self.task, self.spec = task, spec
        self.gym = spec.build(task)
        if max_turns is not None:
            self.max_turns = max_turns
        self._seed = seed
        self.observation: Any = None
        self.started = False
        self.done = False

    @property
    def seed(self) -> int:
        """The episode seed: given, or fixed by the task id and the episode's place in its group."""
        if self._seed is not None:
            return self._seed
        return stable_seed(f"{self.task.id}#{self.episode_index}")

    def start(self) -> None:
        """Reset the gym env (once): to the instance's start state, with this episode's chance."""
        if self.started:
            return
        self.started = True
        instance = self.task.fields.get("gym_seed")
        if instance is None:
            self.observation, _ = self.gym.reset(seed=self.seed)
        else:
            from gymnasium.utils.seeding import np_random

            self.observation, _ = self.gym.reset(seed=int(instance))
            self.gym.unwrapped.np_random, _ = np_random(self.seed)

    def render(self) -> str:
        return self.spec.render(self.observation, self.gym)

    def state_key(self, observation: Any) -> Hashable:
        """GiGPO's key of a state (the spec's `state_key`; a subclass may name it its own way)."""
        return self.spec.state_key(observation)

    def observation_text(self, prefix: str = "") -> str:
        parts = [prefix, self.render(), self.spec.instruction]
        return "\n".join(p for p in parts if p)

    def reset(self) -> EnvReset:
        self.start()
        messages = [dict(m) for m in self.task.messages]
        return EnvReset(messages=messages, state_key=self.state_key(self.observation))

    def parse(self, text: str) -> tuple[Any, str]:
        """(action, "") or (None, what was wrong)."""
        try:
            action = self.spec.parse(text)
        except InvalidAction as err:
            return None, str(err)
        if action is None:
            return None, "No valid action found."
        space = getattr(self.gym, "action_space", None)
        if space is not None and not space.contains(action):
            return None, f"{action!r} is not a valid action."
        return action, ""

    def describe(
        self, action: Any, before: Any, after: Any, reward: float, terminated: bool
    ) -> tuple[str, dict[str, Any]]:
        """Text narrating one step (before the rendered observation) and extra `info` counters."""
        return "", {}

    def step(self, assistant_text: str) -> EnvStep:
        if self.done:
            raise RuntimeError("step() called after the episode ended")
        self.start()
        zeros = dict.fromkeys(self.spec.reward_parts, 0.0)
        key = self.state_key(self.observation)
        action, problem = self.parse(assistant_text)
        if action is None:
            return EnvStep(
                messages=[{"role": "user", "content": self.observation_text(problem)}],
                rewards={**zeros, INVALID_ACTION: 1.0},
                info={INVALID_ACTION: 1, STATE_KEY: key},
            )
        before = self.observation
        self.observation, reward, terminated, truncated, gym_info = self.gym.step(action)
        rewards = {**zeros, **self.spec.rewards(float(reward), terminated, truncated, gym_info)}
        rewards[INVALID_ACTION] = 0.0
        note, info = self.describe(action, before, self.observation, float(reward), terminated)
        if terminated or truncated:
            self.done = True
            self.gym.close()
            return EnvStep(rewards=rewards, done=True, info=info)
        observation: list[Message] = [{"role": "user", "content": self.observation_text(note)}]
        info[STATE_KEY] = self.state_key(self.observation)
        return EnvStep(messages=observation, rewards=rewards, info=info)


def gym_family(
    name: str,
    spec: GymSpec,
    *,
    system_prompt: str,
    description: str = "",
    max_turns: int = 8,
    reward_weights: Mapping[str, float] | None = None,
    success_metric: str = "success",
    key_by: str = "observation",
) -> type[EnvFamily]:
    """An `EnvFamily` class playing `spec`: instance `seed` is the gym reset seed.

    Task ids: `key_by="observation"` (default) keys an instance by its start observation, so two
    seeds with the same start are one instance and train and held-out never share a start state;
    `key_by="seed"` keys it by the seed (disjoint seeds; use when the start observation hides
    state). Held-out membership is a fixed hash of the id (`split_instances`). Reward weights
    default to 1.0 for each reward part and -0.1 for `invalid_action`.
    """
    if key_by not in ("observation", "seed"):
        raise ValueError(f"key_by must be 'observation' or 'seed', not {key_by!r}")
    weights = {**dict.fromkeys(spec.reward_parts, 1.0), INVALID_ACTION: -0.1}
    weights.update(reward_weights or {})

    def generate(self: EnvFamily, seed: int) -> Task:
        env = GymEnv(Task(id=f"{name}:seed={seed}", messages=(), fields={"gym_seed": seed}), spec)
        env.start()
        if key_by == "seed":
            key = f"seed={seed}"
        else:
            state = repr(spec.state_key(env.observation))
            key = state if len(state) <= 64 else stable_seed(state).to_bytes(8, "big").hex()
        env.gym.close()
        messages = (
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": env.observation_text()},
        )
        return Task(id=f"{name}:{key}", messages=messages, fields={"gym_seed": seed})

    def make(self: EnvFamily, task: Task) -> Env:
        return GymEnv(task, spec, max_turns=max_turns)

    namespace: dict[str, Any] = {
        "name": name,
        "description": description or f"{name} (a gymnasium env played in text)",
        "Options": EnvOptions,
        "success_metric": success_metric,
        "reward_weights": weights,
        "generate": generate,
        "make": make,
        "spec": spec,
        "max_turns": max_turns,
    }
    return type(f"{_camel(name)}Family", (EnvFamily,), namespace)


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.replace("-", "_").split("_") if part)


__all__ = [
    "INVALID_ACTION",
    "GymEnv",
    "GymSpec",
    "InvalidAction",
    "gym_family",
    "hashable",
    "stable_seed",
    "success_reward",
]
