"""The gymnasium adapter: any gym env played in text (a tiny custom env and gymnasium's Taxi),
reward mapping, invalid actions, seeding per episode, state keys, and the family helper."""

from __future__ import annotations

from collections import deque
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium.envs.toy_text import TaxiEnv
from gymnasium.wrappers import TimeLimit

from rlvr.envs.base import split_instances
from rlvr.envs.gym_adapter import (
    GymEnv,
    GymSpec,
    InvalidAction,
    gym_family,
    hashable,
    stable_seed,
)
from rlvr.records import Task
from rlvr.verifiers.builtin import extract_tagged


class LineWorld(gymnasium.Env[Any, Any]):
    """Cells 0..6: a pit at 0, the goal at 6, the start drawn in 1..5 at reset. Actions 0 left,
    1 right; with `windy`, a move goes the other way with probability 1/2."""

    def __init__(self, windy: bool = False) -> None:
        self.observation_space = gymnasium.spaces.Discrete(7)
        self.action_space = gymnasium.spaces.Discrete(2)
        self.windy = windy
        self.pos = 3

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[int, dict[str, Any]]:
        super().reset(seed=seed)
        self.pos = int(self.np_random.integers(1, 6))
        return self.pos, {}

    def step(self, action: int) -> tuple[int, float, bool, bool, dict[str, Any]]:
        move = 1 if action == 1 else -1
        if self.windy and self.np_random.random() < 0.5:
            move = -move
        self.pos += move
        return self.pos, float(self.pos == 6), self.pos in (0, 6), False, {}


def parse_line(text: str) -> int | None:
    answer = extract_tagged(text, "answer")
    if answer is None:
        return None
    if answer.strip() == "jump":
        raise InvalidAction("You cannot jump. Say left or right.")
    names = {"left": 0, "right": 1}
    return names.get(answer.strip().lower(), 5)  # 5: outside the action space


def line_spec(windy: bool = False, limit: int | None = None) -> GymSpec:
    def make(task: Task) -> gymnasium.Env[Any, Any]:
        env: Any = LineWorld(windy)
        return TimeLimit(env, max_episode_steps=limit) if limit else env

    return GymSpec(
        make=make,
        render=lambda obs, env: "".join("X" if i == obs else "." for i in range(7)),
        parse=parse_line,
        instruction="Answer <answer>left</answer> or <answer>right</answer>.",
    )


def line_task(gym_seed: int = 0) -> Task:
    return Task(id=f"line:{gym_seed}", messages=(), fields={"gym_seed": gym_seed})


def right() -> str:
    return "I go <answer>right</answer>"


def test_valid_steps_render_map_rewards_and_name_the_state() -> None:
    env = GymEnv(line_task(), line_spec())
    env.reset()
    start = env.observation
    assert 1 <= start <= 5
    outs = [env.step(right()) for _ in range(6 - start)]
    for k, out in enumerate(outs[:-1], start=1):
        assert out.rewards == {"success": 0.0, "invalid_action": 0.0}
        assert not out.done
        text = out.messages[0]["content"]
        assert text.splitlines()[0] == "".join("X" if i == start + k else "." for i in range(7))
        assert text.endswith("<answer>right</answer>.")
        assert out.info["state_key"] == start + k
    last = outs[-1]
    assert last.done and last.messages == []
    assert last.rewards == {"success": 1.0, "invalid_action": 0.0}
    with pytest.raises(RuntimeError):
        env.step(right())


def test_falling_in_the_pit_ends_without_success() -> None:
    env = GymEnv(line_task(), line_spec())
    env.reset()
    outs = [env.step("<answer>left</answer>") for _ in range(env.observation)]
    assert outs[-1].done and outs[-1].rewards["success"] == 0.0


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("no tags", "No valid action found."),
        ("<answer>jump</answer>", "You cannot jump. Say left or right."),
        ("<answer>fly</answer>", "5 is not a valid action."),
    ],
)
def test_unparsable_text_is_invalid_and_changes_nothing(text: str, why: str) -> None:
    env = GymEnv(line_task(), line_spec())
    env.reset()
    before = env.observation
    out = env.step(text)
    assert env.observation == before and not out.done
    assert out.rewards == {"success": 0.0, "invalid_action": 1.0}
    assert out.info == {"invalid_action": 1, "state_key": before}
    assert out.messages[0]["content"].startswith(why + "\n")


def test_episodes_are_seeded_by_task_and_index_reproducibly() -> None:
    """The instance (gym_seed) fixes the start for every episode; the windy dynamics come from the
    task id and the episode index: the same index replays, different indices differ."""

    def walk(index: int) -> tuple[int, list[int]]:
        env = GymEnv(line_task(gym_seed=3), line_spec(windy=True))
        env.episode_index = index
        env.reset()
        start, cells = env.observation, []
        for _ in range(8):
            out = env.step(right())
            cells.append(env.observation)
            if out.done:
                break
        return start, cells

    walks = [walk(i) for i in range(12)]
    assert len({start for start, _ in walks}) == 1  # one instance, one start
    assert len({tuple(cells) for _, cells in walks}) > 1  # the group's episodes differ
    assert [walk(i) for i in range(12)] == walks  # a resumed run replays them
    env = GymEnv(line_task(3), line_spec(), seed=11)
    assert env.seed == 11
    assert GymEnv(line_task(3), line_spec()).seed == stable_seed("line:3#0")


def test_truncation_ends_the_episode() -> None:
    env = GymEnv(line_task(), line_spec(limit=1))
    env.reset()
    out = env.step("<answer>left</answer>" if env.observation > 1 else right())
    assert out.done and out.rewards["success"] == 0.0


def test_hashable_keys_of_array_and_dict_observations() -> None:
    a, b = np.array([[1, 2], [3, 4]]), np.array([[1, 2], [3, 4]])
    assert hashable(a) == hashable(b) and hash(hashable(a)) == hash(hashable(b))
    assert hashable(a) != hashable(a.reshape(4))
    obs = {"pos": np.array([1.5]), "t": 2}
    assert hashable(obs) == (("pos", ((1,), (1.5,))), ("t", 2))
    assert hashable((1, np.int64(2))) == (1, 2) and type(hashable(np.int64(2))) is int


# ------------------------------------------------------------------------ gymnasium's Taxi as a family
TAXI_ACTIONS = ["south", "north", "east", "west", "pickup", "dropoff"]


def parse_taxi(text: str) -> int | None:
    answer = extract_tagged(text, "answer")
    key = (answer or "").strip().lower()
    return TAXI_ACTIONS.index(key) if key in TAXI_ACTIONS else None


def render_taxi(obs: int, env: Any) -> str:
    row, col, passenger, destination = env.unwrapped.decode(obs)
    return f"taxi at ({row}, {col}); passenger {passenger}; destination {destination}"


def taxi_reward(reward: float, terminated: bool, truncated: bool, info: Any) -> dict[str, float]:
    return {"success": float(terminated and reward > 0), "return": reward}


TAXI = GymSpec(
    make=lambda task: TimeLimit(TaxiEnv(), max_episode_steps=200),
    render=render_taxi,
    parse=parse_taxi,
    rewards=taxi_reward,
    reward_parts=("success", "return"),
    instruction="Answer one action inside <answer></answer>.",
)
TaxiFamily = gym_family("taxi", TAXI, system_prompt="You drive a taxi.", max_turns=30)


def plan(state: int) -> list[str]:
    """Shortest action list to a successful drop-off, searched on Taxi's transition table."""
    table = TaxiEnv().P
    came: dict[int, tuple[int, str] | None] = {state: None}
    queue = deque([state])
    while queue:
        s = queue.popleft()
        for a, name in enumerate(TAXI_ACTIONS):
            _, nxt, reward, done = table[s][a][0]
            if done and reward > 0:
                path = [name]
                while (prev := came[s]) is not None:
                    s, step = prev
                    path.append(step)
                return path[::-1]
            if nxt not in came:
                came[nxt] = (s, name)
                queue.append(nxt)
    raise AssertionError("no plan")


def test_a_family_from_a_gym_factory_generates_splits_and_plays() -> None:
    family = TaxiFamily()
    assert family.name == "taxi"
    assert family.reward_weights == {"success": 1.0, "return": 1.0, "invalid_action": -0.1}
    task = family.generate(5)
    assert task == family.generate(5)  # deterministic
    assert task.id.startswith("taxi:") and task.fields == {"gym_seed": 5}
    assert [m["role"] for m in task.messages] == ["system", "user"]
    assert task.messages[1]["content"].startswith("taxi at (")
    train, heldout = split_instances(family.generate, 60, 10)
    assert not {t.id for t in train} & {t.id for t in heldout}  # disjoint start states
    assert not {t.fields["gym_seed"] for t in train} & {t.fields["gym_seed"] for t in heldout}

    env = family.make(task)
    assert isinstance(env, GymEnv) and env.max_turns == 30
    assert env.reset().messages == [dict(m) for m in task.messages]
    moves = plan(env.observation)
    total: dict[str, float] = {}
    for k, move in enumerate(moves):
        out = env.step(f"<answer>{move}</answer>")
        for name, value in out.rewards.items():
            total[name] = total.get(name, 0.0) + value
        assert out.done == (k == len(moves) - 1)
    assert total["success"] == 1.0 and total["invalid_action"] == 0.0
    assert total["return"] == 20.0 - (len(moves) - 1)  # gym's -1 a step, +20 on the drop-off


def test_family_keys_by_seed_when_asked_and_from_a_gym_id() -> None:
    spec = GymSpec(
        make="FrozenLake-v1",
        render=lambda obs, env: str(obs),
        parse=lambda text: 2,
        gym_kwargs={"is_slippery": False},
    )
    by_state = gym_family("lake", spec, system_prompt="s")()
    # FrozenLake-v1 always starts in cell 0: one instance, whatever the seed.
    assert {by_state.generate(s).id for s in range(5)} == {"lake:0"}
    by_seed = gym_family("lake", spec, system_prompt="s", key_by="seed")()
    assert [by_seed.generate(s).id for s in range(3)] == [
        "lake:seed=0",
        "lake:seed=1",
        "lake:seed=2",
    ]
    env = by_seed.make(by_seed.generate(0))
    env.reset()
    assert env.step("anything").info["state_key"] == 1  # Right from cell 0
    with pytest.raises(ValueError, match="key_by"):
        gym_family("lake", spec, system_prompt="s", key_by="nope")
