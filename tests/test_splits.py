"""Train and held-out instances share nothing at the level that matters, for every env family.

Each family's overlaps are counted here by their own measure, independent of the family's
`split_key` (which is how the split achieves them), at every level a held-out score could leak:
- content: the same instance (id), or the same exercise in other words (calculator: the numbers and
  the answer; bandit: the payout tables under other names);
- solution: a held-out instance solved by a train instance's answer (sudoku: its answer grid;
  countdown: a train puzzle's expression; code: a train task's reference solution);
- reachable start state (frozenlake, sokoban): a held-out start that playing a train level, with
  legal moves within the turn cap, reaches (what the warm-up's demonstrations and RL episodes see);
- the prompt's own example: a held-out instance whose answer every prompt shows.
With the default options and with those of every example config and efficacy row (curriculum
levels included: each level's train against the final held-out set). Every count must be 0.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rlvr.config import load_config
from rlvr.envs import get_env_family
from rlvr.envs.countdown import ExpressionError, number_problem, parse_expression
from rlvr.envs.frozenlake import MAX_TURNS_BY_SIZE as LAKE_TURNS
from rlvr.envs.frozenlake import MOVES
from rlvr.envs.sokoban import MAX_TURNS_BY_SIZE as ROOM_TURNS
from rlvr.envs.sokoban import Room, push
from rlvr.envs.sudoku import solution_of
from rlvr.pipeline import first_rl_config, load_pipeline_config
from rlvr.records import Task

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
Setting = tuple[str, tuple[tuple[str, Any], ...], int, int, float, tuple[Any, ...]]


def _frozen(options: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(options.items()))


def _efficacy_rows() -> list[Any]:
    spec = importlib.util.spec_from_file_location("efficacy", ROOT / "benchmarks" / "efficacy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("efficacy", module)
    spec.loader.exec_module(module)
    return list(module.ROWS)


def _setting(cfg: Any) -> Setting | None:
    env = cfg.task.env
    if cfg.task.source != "env" or env is None:
        return None
    levels = tuple(_frozen(level) for level in (cfg.curriculum.levels or []))
    return (
        env.name,
        _frozen(dict(env.options)),
        env.num_train,
        env.num_heldout,
        env.heldout_fraction,
        levels,
    )


def _load_rl(path: Path, overrides: tuple[str, ...] = ()) -> Any:
    """The RL config of an example (a pipeline's RL stage), with a row's overrides."""
    if "stages:" in path.read_text():
        pipeline = load_pipeline_config(path)
        rl = next(i for i, s in enumerate(pipeline.stages) if s.kind == "rl")
        sets = [f"stages.{rl}.config.{o}" for o in overrides]
        return first_rl_config(load_pipeline_config(path, sets), EXAMPLES)
    return load_config(path, list(overrides))


def settings() -> list[Setting]:
    """Defaults of each family, then each example config's and each efficacy row's split."""
    found: dict[Setting, None] = {}
    for name in ("sokoban", "frozenlake", "sudoku", "countdown", "calculator", "bandit", "code"):
        found[(name, (), 2000 if name != "sokoban" else 500, 200, 0.1, ())] = None
    for path in sorted(EXAMPLES.glob("env_*.yaml")):
        if (s := _setting(_load_rl(path))) is not None:
            found[s] = None
    for row in _efficacy_rows():
        if (s := _setting(_load_rl(EXAMPLES / row.config, row.overrides))) is not None:
            found[s] = None
    return list(found)


# ------------------------------------------------------------------------- overlap measures
def _reachable_rooms(task: Task) -> Iterator[tuple[str, Any]]:
    """Every (room, player, boxes) a Sokoban level reaches within its turn cap."""
    room = Room(task.fields["rows"])
    key = (sorted(room.walls), sorted(room.targets))
    start = (room.player, room.boxes)
    depth = {start: 0}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        yield str(key), state
        if depth[state] == ROOM_TURNS[room.shape[0]] or state[1] <= room.targets:
            continue
        for move in MOVES:
            nxt = push(room.walls, *state, move)
            if nxt is not None and nxt not in depth:
                depth[nxt] = depth[state] + 1
                queue.append(nxt)


def _room_start(task: Task) -> tuple[str, Any]:
    room = Room(task.fields["rows"])
    return str((sorted(room.walls), sorted(room.targets))), (room.player, room.boxes)


def _reachable_cells(task: Task) -> Iterator[tuple[str, Any]]:
    """Every (lake, cell) a FrozenLake walk reaches within its turn cap; a slip moves to a
    neighbouring cell too, so slippery ice reaches the same ball."""
    rows = [str(r) for r in task.fields["rows"]]
    n = len(rows)
    lake = "/".join(rows).replace("P", "F") + str(task.fields.get("slippery"))
    start = next((r, c) for r in range(n) for c in range(n) if rows[r][c] == "P")
    depth = {start: 0}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        yield lake, cell
        if depth[cell] == LAKE_TURNS[n] or rows[cell[0]][cell[1]] in "HG":
            continue
        for dr, dc in MOVES.values():
            nxt = (min(max(cell[0] + dr, 0), n - 1), min(max(cell[1] + dc, 0), n - 1))
            if nxt not in depth:
                depth[nxt] = depth[cell] + 1
                queue.append(nxt)


def _lake_start(task: Task) -> tuple[str, Any]:
    return next(_reachable_cells(task))  # the walk's first state is its start


def _numbers_and_answer(task: Task) -> str:
    numbers = sorted(int(n) for n in re.findall(r"\d+", str(task.messages[-1]["content"])))
    return f"{numbers}={task.fields['answer']}"


def _payouts(task: Task) -> str:
    return str(sorted((a["coins"], a["percent"]) for a in task.fields["arms"]))


def _solved_by_train_expression(train: list[Task], heldout: list[Task]) -> int:
    """Held-out Countdown puzzles that some train puzzle's expression solves."""
    by_target: dict[int, list[list[int]]] = defaultdict(list)
    for t in train:
        try:
            value, used = parse_expression(t.fields["solution"])
        except ExpressionError:
            continue
        by_target[int(value)].append(used)
    return sum(
        any(
            number_problem(used, h.fields["numbers"], h.fields["use_all"]) is None
            for used in by_target[h.fields["target"]]
        )
        for h in heldout
    )


def _shown_example_answers(family: str, heldout: list[Task]) -> int:
    """Held-out instances whose answer the prompt's own example shows (every prompt has it)."""
    if family == "countdown":  # the system prompt's "(3 + 5) * 2"
        return sum(
            h.fields["target"] == 16
            and number_problem([3, 5, 2], h.fields["numbers"], h.fields["use_all"]) is None
            for h in heldout
        )
    if family == "calculator":  # the worked example: 12 * 14 = 168
        return sum(_numbers_and_answer(h) == "[12, 14]=168" for h in heldout)
    return 0


Overlaps = dict[str, int]


def _shared(train: list[Task], heldout: list[Task], key: Callable[[Task], Any]) -> int:
    seen = {key(t) for t in train}
    return sum(key(h) in seen for h in heldout)


def count_overlaps(family: str, train: list[Task], heldout: list[Task]) -> Overlaps:
    """Held-out instances that share something with train, per level (see the module docstring)."""
    counts = {"content": _shared(train, heldout, lambda t: t.id)}
    counts["shown example"] = _shown_example_answers(family, heldout)
    if family == "sokoban":
        reached = {state for t in train for state in _reachable_rooms(t)}
        counts["reachable start"] = sum(_room_start(h) in reached for h in heldout)
    elif family == "frozenlake":
        reached = {state for t in train for state in _reachable_cells(t)}
        counts["reachable start"] = sum(_lake_start(h) in reached for h in heldout)
    elif family == "sudoku":
        counts["solution"] = _shared(train, heldout, lambda t: str(solution_of(t)))
    elif family == "countdown":
        counts["solution"] = _solved_by_train_expression(train, heldout)
    elif family == "calculator":
        counts["content"] += _shared(train, heldout, _numbers_and_answer)
    elif family == "bandit":
        counts["content"] += _shared(train, heldout, _payouts)
    elif family == "code":
        counts["content"] += _shared(train, heldout, lambda t: t.messages[-1]["content"])
        counts["content"] += _shared(train, heldout, lambda t: t.fields["entry"])
    return counts


@pytest.mark.parametrize("setting", settings(), ids=lambda s: f"{s[0]}{dict(s[1])}-{s[2]}/{s[3]}")
def test_heldout_shares_nothing_with_train(setting: Setting) -> None:
    name, options, num_train, num_heldout, fraction, levels = setting
    family = get_env_family(name, dict(options))
    train, heldout = family.make_splits(num_train, num_heldout, fraction)
    assert heldout, "no held-out instances"
    for level in levels:  # a curriculum trains on each level, scored on the final held-out set
        level_train, _ = get_env_family(name, {**dict(options), **dict(level)}).make_splits(
            num_train, num_heldout, fraction
        )
        train = train + level_train
    counts = count_overlaps(name, train, heldout)
    assert not any(counts.values()), counts


def test_the_measures_see_the_leaks_a_split_by_id_had() -> None:
    """The counters are not vacuous: split by id alone (the old split), the 5x5 Sokoban row held
    out starts reachable from train levels, and 4x4 Sudoku held out train answer grids."""
    from rlvr.envs.base import split_instances

    sokoban = get_env_family("sokoban", {"size": 5})
    train, heldout = split_instances(sokoban.generate, 230, 200, 0.5)
    assert count_overlaps("sokoban", train, heldout)["reachable start"] > 100
    sudoku = get_env_family("sudoku", {})
    train, heldout = split_instances(sudoku.generate, 500, 50)
    assert count_overlaps("sudoku", train, heldout)["solution"] > 40
