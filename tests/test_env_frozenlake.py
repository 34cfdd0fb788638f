"""FrozenLake env family (gymnasium's FrozenLake-v1 dynamics): rules, slips, generated lakes are
solvable, ids and splits, options."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from rlvr.config import load_config
from rlvr.envs.base import Env, split_instances
from rlvr.envs.frozenlake import (
    MAX_TURNS_BY_SIZE,
    FrozenLakeEnv,
    FrozenLakeFamily,
    make_task,
    solve_frozenlake,
)
from rlvr.errors import ConfigError
from rlvr.records import Task
from rlvr.rollout.engine import RolloutLimits, Scoring, rollout_groups
from rlvr.rollout.generator import Completion, SamplingParams
from rlvr.train.sources import Sources

LAKE = ["PFFF", "FHFH", "FFFH", "HFFG"]


def answer(move: str) -> str:
    return f"Let me think. <answer>{move}</answer>"


def play(env: FrozenLakeEnv, moves: list[str]) -> tuple[float, bool]:
    """(total success, done) after playing the moves until the episode ends."""
    success, done = 0.0, False
    for move in moves:
        out = env.step(answer(move))
        success += out.rewards["success"]
        done = out.done
        if done:
            break
    return success, done


def test_task_messages_and_reset() -> None:
    task = make_task(LAKE)
    assert task.id == "frozenlake:PFFF/FHFH/FFFH/HFFG"
    assert [m["role"] for m in task.messages] == ["system", "user"]
    assert "P player, F frozen ice, H hole, G goal" in task.messages[0]["content"]
    user = task.messages[1]["content"]
    assert user.startswith("P F F F\nF H F H\nF F F H\nH F F G\n")
    assert user.endswith("e.g. <answer>Left</answer>.")
    assert FrozenLakeFamily().make(task).reset().messages == [dict(m) for m in task.messages]
    assert make_task(LAKE, slippery=True).id.endswith(":slippery")


def test_moves_and_edges() -> None:
    env = FrozenLakeEnv(make_task(LAKE))
    out = env.step(answer("Right"))
    assert env.player == (0, 1)
    # potential: 6 -> 5 moves from the goal on 16 cells, +1/16 (tests/test_shaping.py)
    assert out.rewards == {"success": 0.0, "no_effect": 0.0, "invalid_action": 0.0,
                           "potential": 1 / 16}  # fmt: skip
    assert not out.done
    assert out.messages[0]["role"] == "user"
    assert "You moved Right.\nF P F F" in out.messages[0]["content"]
    out = env.step(answer("up"))  # the top edge: valid, no effect, no penalty by default
    assert env.player == (0, 1)
    assert out.info["no_effect"] == 1
    assert out.rewards == {"success": 0.0, "no_effect": 1.0, "invalid_action": 0.0,
                           "potential": 0.0}  # fmt: skip
    assert FrozenLakeFamily.reward_weights["no_effect"] == 0.0  # logged, not optimised
    assert "edge" in out.messages[0]["content"]
    out = env.step("Up, I think")  # invalid: no move was made, so no edge push either
    assert out.rewards == {"success": 0.0, "no_effect": 0.0, "invalid_action": 1.0,
                           "potential": 0.0}  # fmt: skip


def test_winning_sequence_succeeds() -> None:
    env = FrozenLakeEnv(make_task(LAKE))
    assert play(env, ["Right", "Right", "Down", "Down", "Down", "Right"]) == (1.0, True)
    shortest = solve_frozenlake(LAKE)
    assert shortest is not None and len(shortest) == 6
    assert play(FrozenLakeEnv(make_task(LAKE)), shortest) == (1.0, True)


def test_hole_loses_and_ends() -> None:
    env = FrozenLakeEnv(make_task(LAKE))
    env.step(answer("Right"))
    out = env.step(answer("Down"))
    assert out.done and out.messages == []
    # The hole (1, 1) counts 1 + its nearest ice's 3 = 4 moves, the cell left 5: +1/16.
    assert out.rewards == {"success": 0.0, "no_effect": 0.0, "invalid_action": 0.0,
                           "potential": 1 / 16}  # fmt: skip
    assert out.info["fell"] == 1
    with pytest.raises(RuntimeError):
        env.step(answer("Up"))


@pytest.mark.parametrize(
    ("text", "why"),
    [("<answer>Jump</answer>", "'Jump' is not a valid action"), ("Right", "No action found")],
)
def test_invalid_action_is_penalised_and_changes_nothing(text: str, why: str) -> None:
    env = FrozenLakeEnv(make_task(LAKE))
    out = env.step(text)
    assert env.player == (0, 0)
    assert out.rewards == {"success": 0.0, "no_effect": 0.0, "invalid_action": 1.0,
                           "potential": 0.0}  # fmt: skip
    assert out.info == {"invalid_action": 1, "state_key": (0, 0)}
    assert not out.done
    content = out.messages[0]["content"]
    assert why in content and "Valid actions: Up, Down, Left, Right." in content
    assert "P F F F" in content


def test_answer_is_case_insensitive_and_last_tag_wins() -> None:
    env = FrozenLakeEnv(make_task(LAKE))
    env.step("<answer>Up</answer> no wait <answer> RIGHT. </answer>")
    assert env.player == (0, 1)


def test_unsolvable_lake_has_no_solution() -> None:
    assert solve_frozenlake(["PFFF", "HHHH", "FFFF", "FFFG"]) is None


@pytest.mark.parametrize("size", [4, 5, 6])
def test_generated_lakes_are_solvable_within_the_turn_cap(size: int) -> None:
    family = FrozenLakeFamily({"size": size})
    for seed in range(50):
        task = family.generate(seed)
        assert task == family.generate(seed)  # deterministic
        rows = task.fields["rows"]
        assert len(rows) == size and all(len(r) == size for r in rows)
        path = solve_frozenlake(rows)
        assert path is not None and 2 <= len(path) <= MAX_TURNS_BY_SIZE[size] - 2
        env = family.make(task)
        assert env.max_turns == MAX_TURNS_BY_SIZE[size]
        assert isinstance(env, FrozenLakeEnv)
        assert play(env, path) == (1.0, True)


def test_ids_are_mostly_distinct_and_split_is_disjoint() -> None:
    family = FrozenLakeFamily()
    assert len({family.generate(s).id for s in range(100)}) >= 95
    train, heldout = split_instances(family.generate, 200, 20)
    assert len(train) == 200 and len(heldout) == 20
    assert not {t.id for t in train} & {t.id for t in heldout}


OPEN_LAKE = ["FFFFF", "FFFFF", "FFPFF", "FFFFF", "FFFFG"]


def slippery_env(index: int, family: FrozenLakeFamily | None = None) -> FrozenLakeEnv:
    """The env of the episode at `index` in its group, as the engine sets it up."""
    env = (family or FrozenLakeFamily({"slippery": True})).make(make_task(OPEN_LAKE, slippery=True))
    env.episode_index = index
    assert isinstance(env, FrozenLakeEnv)
    return env


def test_slippery_moves_follow_gymnasium_frozenlake_v1() -> None:
    """Changed on purpose with the move to gymnasium's FrozenLake-v1: a slippery move goes the
    intended way with probability 1/3 and each perpendicular way with 1/3 (rlvr's hand-written
    copy kept the intended direction with probability 2/3)."""
    envs = [slippery_env(i) for i in range(300)]
    assert len({e.seed for e in envs}) == 300  # each episode of a group slips differently
    ends = []
    for env in envs:
        out = env.step(answer("Up"))
        ends.append(env.player)
        assert env.player in {(1, 2), (2, 1), (2, 3)}  # intended or perpendicular
        assert out.info["slipped"] == int(env.player != (1, 2))
        if env.player != (1, 2):
            side = "Left" if env.player == (2, 1) else "Right"
            assert f"You tried Up but slipped {side}." in out.messages[0]["content"]
    for cell in [(1, 2), (2, 1), (2, 3)]:
        assert 70 < ends.count(cell) < 130  # about 1/3 each


def test_slips_come_from_the_task_and_episode_index_not_a_process_counter() -> None:
    """A resumed run (a fresh process, a fresh family) slips exactly as the first run did."""

    def walk(env: FrozenLakeEnv) -> list[tuple[int, int]]:
        cells = []
        for move in ["Up", "Left", "Down", "Right", "Down"]:
            out = env.step(answer(move))
            cells.append(env.player)
            if out.done:
                break
        return cells

    family = FrozenLakeFamily({"slippery": True})
    for _ in range(10):  # envs made before must not change which slips an episode gets
        family.make(make_task(OPEN_LAKE, slippery=True))
    first = [walk(slippery_env(i, family)) for i in range(8)]
    resumed = [walk(slippery_env(i)) for i in range(8)]
    assert first == resumed
    assert len({tuple(w) for w in first}) > 1  # the group's episodes differ
    assert FrozenLakeEnv(make_task(OPEN_LAKE, True), seed=7).seed == 7


class Always:
    """A generator whose every turn answers `move`, EOS-terminated (tiny tokenizer)."""

    def __init__(self, move: str) -> None:
        from rlvr.models import tiny_tokenizer

        self.tokenizer = tiny_tokenizer()
        eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        text = f"<answer>{move}</answer>"
        self.reply = (*self.tokenizer(text, add_special_tokens=False)["input_ids"], eos)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Any]:
        completion = Completion(self.reply, (0.0,) * len(self.reply), "stop")
        return [[completion] * sampling.n for _ in prompts]


def test_the_engine_gives_each_episode_of_a_group_its_index() -> None:
    """Through the rollout engine: G episodes of one task get indices 0..G-1 (so they slip
    differently), and replaying the round in a fresh family plays the same slips."""
    always_up = Always("Up")
    made: list[FrozenLakeEnv] = []

    def play() -> list[tuple[str, ...]]:
        family = FrozenLakeFamily({"slippery": True})

        def make_env(task: Task) -> Env:
            env = family.make(task)
            made.append(env)  # type: ignore[arg-type]
            return env

        groups = rollout_groups(
            [make_task(OPEN_LAKE, slippery=True)],
            make_env,
            always_up,
            always_up.tokenizer,
            SamplingParams(n=6, max_new_tokens=32),
            Scoring(env_weights=dict(FrozenLakeFamily.reward_weights)),
            RolloutLimits(max_turns=4),
        )
        return [tuple(str(m["content"]) for m in t.messages) for t in groups[0].trajectories]

    first = play()
    assert [e.episode_index for e in made] == list(range(6))
    assert play() == first
    assert len(set(first)) > 1
    assert any("slipped" in text for episode in first for text in episode)


@pytest.mark.parametrize(("weight", "reward"), [(None, 0.0), (-0.1, -0.4)])
def test_edge_pushes_are_logged_and_shaped_only_when_weighted(
    weight: float | None, reward: float
) -> None:
    """`no_effect` counts the episode's pushes into the edge; at its default weight 0 it changes no
    reward, with `task.env.reward_weights.no_effect` it shapes each pushing turn's reward."""
    sets = ["task.source=env", "task.env.name=frozenlake", "task.env.num_train=4"]
    if weight is not None:
        sets.append(f"task.env.reward_weights.no_effect={weight}")
    (source,) = list(Sources(load_config(None, sets), None))
    up = Always("Up")  # LAKE's player starts on the top row: every move pushes into the edge
    (group,) = rollout_groups(
        [make_task(LAKE)], source.make_env, up, up.tokenizer, SamplingParams(n=1, max_new_tokens=32),
        source.scoring, RolloutLimits(max_turns=4),
    )  # fmt: skip
    (episode,) = group.trajectories
    assert episode.rewards["no_effect"] == 4.0 and episode.rewards["success"] == 0.0
    assert episode.reward == pytest.approx(reward)
    assert episode.turn_rewards == pytest.approx([reward / 4] * 4)


def test_not_slippery_never_slips() -> None:
    env = FrozenLakeFamily().make(make_task(["FFFF", "FPFF", "FFFF", "FFFG"]))
    for _ in range(2):
        out = env.step(answer("Right"))
        assert out.info["slipped"] == 0
    assert isinstance(env, FrozenLakeEnv) and env.player == (1, 3)


@pytest.mark.parametrize(
    ("options", "name"),
    [({"size": 7}, "size"), ({"hole_fraction": 0.9}, "hole_fraction"), ({"holes": 3}, "holes")],
)
def test_bad_options_raise_config_error_naming_the_option(
    options: dict[str, object], name: str
) -> None:
    with pytest.raises(ConfigError, match=f"task.env.options.{name}"):
        FrozenLakeFamily(options)


def test_family_metadata() -> None:
    assert FrozenLakeFamily.name == "frozenlake"
    assert FrozenLakeFamily.success_metric == "success"
    assert FrozenLakeFamily.reward_weights["invalid_action"] == -0.1
    assert FrozenLakeFamily.example_config == "examples/env_frozenlake.yaml"
    assert FrozenLakeEnv.max_turns == 8


def test_the_state_key_is_the_players_cell_whatever_the_observation_says() -> None:
    """GiGPO's anchor states: the same cell reached by different moves has one key, while the
    observation texts differ (they narrate the last move)."""
    direct, detour = FrozenLakeEnv(make_task(LAKE)), FrozenLakeEnv(make_task(LAKE))
    *_, by_right = [direct.step(answer(m)) for m in ("Right", "Right")]
    *_, by_up = [detour.step(answer(m)) for m in ("Right", "Right", "Down", "Up")]
    assert by_right.info["state_key"] == by_up.info["state_key"] == (0, 2)
    assert by_right.messages != by_up.messages  # "You moved Right." vs "You moved Up."
    assert not (by_right.done or by_up.done)


def test_positions_observation_states_cells_and_neighbours() -> None:
    """`observation: positions` adds the player's and goal's cells (1-based) and what each move steps
    onto, on the first prompt and after every move; the solver still reads the grid; ids differ."""
    task = make_task(LAKE, observation="positions")
    assert task.id == "frozenlake:PFFF/FHFH/FFFH/HFFG:positions"
    assert make_task(LAKE).fields == {"rows": LAKE, "slippery": False}  # plain tasks unchanged
    first = task.messages[1]["content"]
    assert first.startswith("P F F F\nF H F H\nF F F H\nH F F G\n")
    assert (
        "You are at row 1, column 1. The goal is at row 4, column 4. "
        "Next cells: Up: edge, Down: ice, Left: edge, Right: ice." in first
    )
    env = FrozenLakeFamily({"observation": "positions"}).make(task)
    env.reset()
    out = env.step(answer("Right"))
    text = out.messages[0]["content"]
    assert "You are at row 1, column 2." in text
    assert "Up: edge, Down: hole, Left: ice, Right: ice." in text
    for move in ("Right", "Down", "Down"):  # (0,2) -> (1,2) -> (2,2): the goal is below-right
        out = env.step(answer(move))
    assert "You are at row 3, column 3." in out.messages[0]["content"]
    assert "Up: ice, Down: ice, Left: ice, Right: hole." in out.messages[0]["content"]
    messages = [{"role": "assistant", "content": answer("Right")}, *out.messages]
    assert FrozenLakeFamily().scripted_action(task, messages) == "<answer>Down</answer>"
    out = env.step(answer("Down"))
    assert "Right: goal." in out.messages[0]["content"]
    assert env.step(answer("Right")).rewards["success"] == 1.0
    generated = FrozenLakeFamily({"observation": "positions"}).generate(7)
    assert (
        generated.id.endswith(":positions")
        and "The goal is at row" in generated.messages[1]["content"]
    )
    with pytest.raises(
        ConfigError, match=r"task\.env\.options\.observation: Input should be 'grid'"
    ):
        FrozenLakeFamily({"observation": "coords"})
