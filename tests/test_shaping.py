"""Potential-based shaping for the grid envs (the `potential` reward part of frozenlake and sokoban;
Ng, Harada & Russell 1999): potentials by hand, and over played episodes the shaped return equals
the unshaped one plus the telescoping term Phi(last state) - Phi(start state)."""

from __future__ import annotations

import random

import pytest

from rlvr.envs.base import EnvFamily
from rlvr.envs.frozenlake import FrozenLakeFamily, goal_distances, lake_potential
from rlvr.envs.sokoban import Room, SokobanFamily, room_potential


def env_family(name: str, options: dict) -> EnvFamily:
    return (FrozenLakeFamily if name == "frozenlake" else SokobanFamily)(options)


LAKE = ["PFFF",
        "FHFH",
        "FFFH",
        "HFFG"]  # fmt: skip


def test_lake_potential_by_hand() -> None:
    dist = goal_distances(LAKE)
    # From G (3,3): (3,2) 1, (2,2) 2 and (3,1) 2, (1,2) 3 and (2,1) 3, (0,2) 4, (2,0) 4, ...
    assert dist[(3, 3)] == 0 and dist[(3, 2)] == 1 and dist[(2, 2)] == 2 and dist[(1, 2)] == 3
    assert dist[(0, 0)] == 6  # P: Down Down Right Right Down Right, or via the top row
    assert dist[(1, 1)] == 4  # a hole: 1 + its nearest ice neighbour's (2, 1) 3
    assert lake_potential(LAKE, (3, 3)) == 0.0
    assert lake_potential(LAKE, (0, 0)) == pytest.approx(-6 / 16)
    walled = ["PHFF", "HFFF", "FFFF", "FFFG"]  # P cannot reach G: the lowest potential
    assert lake_potential(walled, (0, 0)) == -1.0


def test_room_potential_by_hand() -> None:
    room = Room(["#####",
                 "#PX_#",
                 "#__O#",
                 "#####"])  # fmt: skip
    # The box (1,2) is 2 moves from the target (2,3); 6 floor cells, 1 box: Phi = -2/6.
    assert room_potential(room) == pytest.approx(-2 / 6)
    room.boxes = frozenset({(2, 3)})
    assert room_potential(room) == 0.0


def _play(family_name: str, options: dict, episodes: int, seed: int) -> list[tuple]:
    """Random legal episodes: (sum of the potential part, Phi(last) - Phi(start), success)."""
    family = env_family(family_name, options)
    rng = random.Random(seed)
    out = []
    for i in range(episodes):
        task = family.generate(1000 + i)
        env = family.make(task)
        reset = env.reset()
        messages = list(reset.messages)
        total, success, phi_start = 0.0, 0.0, _phi(family_name, env)
        for _ in range(env.max_turns):
            action = family.random_action(task, messages, rng) if rng.random() > 0.1 else "hm"
            step = env.step(action)
            total += step.rewards["potential"]
            success = max(success, step.rewards["success"])
            messages += [{"role": "assistant", "content": action}, *step.messages]
            if step.done:
                break
        out.append((total, _phi(family_name, env) - phi_start, success))
    return out


def _phi(family_name: str, env: object) -> float:
    if family_name == "frozenlake":
        rows = [str(r) for r in env.task.fields["rows"]]  # type: ignore[attr-defined]
        return lake_potential(rows, env.player)  # type: ignore[attr-defined]
    return room_potential(env.room)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("family_name", "options"),
    [("frozenlake", {}), ("frozenlake", {"slippery": True}), ("sokoban", {"size": 5})],
)
def test_shaped_return_is_unshaped_plus_the_telescoping_term(
    family_name: str, options: dict
) -> None:
    played = _play(family_name, options, episodes=40, seed=0)
    for total, telescoped, success in played:
        assert total == pytest.approx(telescoped, abs=1e-12)
        if success:  # the goal / a solved room has potential 0: the term is -Phi(start)
            assert telescoped > 0
    # The part moves: not every episode's shaping is 0.
    assert any(abs(total) > 0 for total, _, _ in played)


def test_the_part_is_logged_at_weight_zero_until_opted_in() -> None:
    for name in ("frozenlake", "sokoban"):
        assert env_family(name, {}).reward_weights["potential"] == 0.0
