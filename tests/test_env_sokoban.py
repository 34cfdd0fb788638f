"""Sokoban env family: pushing rules, generated levels are solvable, ids and splits, options."""

from __future__ import annotations

import pytest

from rlvr.envs.base import split_instances
from rlvr.envs.sokoban import (
    MAX_TURNS_BY_SIZE,
    Room,
    SokobanEnv,
    SokobanFamily,
    make_task,
    solve_sokoban,
)
from rlvr.errors import ConfigError

LEVEL = ["#######", "#_____#", "#_PX_O#", "#_____#", "#######"]


def answer(move: str) -> str:
    return f"<answer>{move}</answer>"


def env_for(rows: list[str]) -> SokobanEnv:
    env = SokobanFamily().make(make_task(rows))
    assert isinstance(env, SokobanEnv)
    return env


def play(env: SokobanEnv, moves: list[str]) -> tuple[float, bool]:
    success, done = 0.0, False
    for move in moves:
        out = env.step(answer(move))
        success += out.rewards["success"]
        done = out.done
        if done:
            break
    return success, done


def test_task_messages_and_reset() -> None:
    task = make_task(LEVEL)
    assert task.id == "sokoban:" + "/".join(LEVEL)
    assert [m["role"] for m in task.messages] == ["system", "user"]
    assert "# wall, _ floor, O target, X box, √ box on target" in task.messages[0]["content"]
    user = task.messages[1]["content"]
    assert "# _ P X _ O #" in user
    assert user.endswith("e.g. <answer>Left</answer>.")
    assert env_for(LEVEL).reset().messages == [dict(m) for m in task.messages]


def test_push_box_onto_target_wins() -> None:
    env = env_for(LEVEL)
    out = env.step(answer("Right"))
    assert env.room.player == (2, 3) and env.room.boxes == {(2, 4)}
    # potential: the box 2 -> 1 moves from its target, on 15 floor cells: +1/15
    assert out.rewards == pytest.approx(
        {"success": 0.0, "invalid_action": 0.0, "boxes_on_target": 0.0, "potential": 1 / 15}
    )
    assert "You moved Right and pushed a box." in out.messages[0]["content"]
    assert "# _ _ P X O #" in out.messages[0]["content"]
    out = env.step(answer("right"))
    assert out.done and out.messages == []
    assert out.rewards == pytest.approx(
        {"success": 1.0, "invalid_action": 0.0, "boxes_on_target": 1.0, "potential": 1 / 15}
    )
    with pytest.raises(RuntimeError):
        env.step(answer("Left"))


def test_losing_sequence_does_not_succeed() -> None:
    # Pushing the box Up against the top wall is a dead end: later moves never win.
    env = env_for(LEVEL)
    success, done = play(env, ["Down", "Right", "Up", "Up", "Right", "Right", "Down"])
    assert (success, done) == (0.0, False)
    assert env.room.boxes == {(1, 3)}
    assert solve_sokoban(env.room.rows()) is None


def test_walls_block_the_player() -> None:
    env = env_for(LEVEL)
    env.step(answer("Left"))
    out = env.step(answer("Left"))
    assert env.room.player == (2, 1)
    assert out.info == {"no_effect": 1, "state_key": ((2, 1), ((2, 3),))}
    assert out.rewards["invalid_action"] == 0.0
    assert "blocked" in out.messages[0]["content"]


def test_cannot_push_a_box_into_a_wall() -> None:
    env = env_for(["#####", "#_PX#", "#__O#", "#####"])
    out = env.step(answer("Right"))
    assert out.info == {"no_effect": 1, "state_key": ((1, 2), ((1, 3),))} and not out.done
    assert out.rewards["invalid_action"] == 0.0
    assert env.room.player == (1, 2) and env.room.boxes == {(1, 3)}


def test_cannot_push_two_boxes() -> None:
    env = env_for(["######", "#PXX_#", "#___O#", "#___O#", "######"])
    out = env.step(answer("Right"))
    assert out.info == {"no_effect": 1, "state_key": ((1, 1), ((1, 2), (1, 3)))}
    assert env.room.player == (1, 1) and env.room.boxes == {(1, 2), (1, 3)}


def test_player_and_box_on_target_render() -> None:
    rows = ["#####", "#P√_#", "#_XO#", "#___#", "#####"]
    env = env_for(rows)
    assert env.room.rows() == rows
    env.step(answer("Down"))
    out = env.step(answer("Right"))  # box from (2, 2) onto the target (2, 3)
    assert out.done and out.rewards["success"] == 1.0
    assert out.rewards["boxes_on_target"] == 0.5
    assert Room(["#####", "#S_X#", "#__O#", "#####"]).targets == {(1, 1), (2, 3)}


@pytest.mark.parametrize(
    ("text", "why"),
    [("<answer>push</answer>", "'push' is not a valid action"), ("go up", "No action found")],
)
def test_invalid_action_is_penalised_and_changes_nothing(text: str, why: str) -> None:
    env = env_for(LEVEL)
    out = env.step(text)
    assert env.room.rows() == LEVEL
    assert out.rewards == {
        "success": 0.0, "invalid_action": 1.0, "boxes_on_target": 0.0, "potential": 0.0
    }  # fmt: skip
    assert out.info == {"invalid_action": 1, "state_key": ((2, 2), ((2, 3),))}
    assert not out.done
    assert why in out.messages[0]["content"]
    assert "Valid actions: Up, Down, Left, Right." in out.messages[0]["content"]


@pytest.mark.parametrize("size", [5, 6, 7])
@pytest.mark.parametrize("num_boxes", [1, 2])
def test_generated_levels_are_solvable_and_not_solved(size: int, num_boxes: int) -> None:
    family = SokobanFamily({"size": size, "num_boxes": num_boxes})
    for seed in range(50):
        task = family.generate(seed)
        assert task == family.generate(seed)
        room = Room(task.fields["rows"])
        assert room.shape == (size, size)
        assert len(room.boxes) == len(room.targets) == num_boxes
        assert not room.solved()
        path = solve_sokoban(task.fields["rows"])
        assert path is not None and 1 <= len(path) <= MAX_TURNS_BY_SIZE[size] // 2
        env = family.make(task)
        assert isinstance(env, SokobanEnv) and env.max_turns == MAX_TURNS_BY_SIZE[size]
        assert play(env, path) == (1.0, True)


def test_ids_are_mostly_distinct_and_split_is_disjoint() -> None:
    family = SokobanFamily()
    assert len({family.generate(s).id for s in range(100)}) >= 90
    train, heldout = split_instances(family.generate, 200, 20)
    assert len(train) == 200 and len(heldout) == 20
    assert not {t.id for t in train} & {t.id for t in heldout}


@pytest.mark.parametrize(
    ("options", "name"),
    [({"size": 4}, "size"), ({"num_boxes": 3}, "num_boxes"), ({"boxes": 1}, "boxes")],
)
def test_bad_options_raise_config_error_naming_the_option(
    options: dict[str, object], name: str
) -> None:
    with pytest.raises(ConfigError, match=f"task.env.options.{name}"):
        SokobanFamily(options)


def test_family_metadata() -> None:
    assert SokobanFamily.name == "sokoban"
    assert SokobanFamily.success_metric == "success"
    assert SokobanFamily.reward_weights == {
        "success": 1.0,
        "invalid_action": -0.1,
        "boxes_on_target": 0.0,
        "potential": 0.0,
    }
    assert SokobanFamily.example_config == "examples/env_sokoban.yaml"


def test_the_state_key_is_player_and_boxes_whatever_the_observation_says() -> None:
    """GiGPO's anchor states: one room state reached by different moves has one key, while the
    observation texts differ (they narrate the last move)."""
    direct, detour = env_for(LEVEL), env_for(LEVEL)
    *_, by_up = [direct.step(answer(m)) for m in ("Up",)]
    *_, by_left = [detour.step(answer(m)) for m in ("Up", "Right", "Left")]
    assert by_up.info["state_key"] == by_left.info["state_key"] == ((1, 2), ((2, 3),))
    assert by_up.messages != by_left.messages  # "You moved Up." vs "You moved Left."
