"""Sokoban: push every box onto a target in a small walled room, one move a turn.

The puzzle used for multi-turn agent RL in RAGEN (Wang et al., 2025, "RAGEN: Understanding
Self-Evolution in LLM Agents via Multi-Turn Reinforcement Learning"), with RAGEN's legend: # wall,
_ floor, O target, X box, √ box on a target, P player, S player on a target. Rules: each turn the
model answers one move, Up, Down, Left or Right, inside <answer></answer> (case-insensitive). The
player walks onto free floor; walking into a box pushes it one cell if the cell behind it is floor or
an empty target. Boxes cannot be pulled, two boxes cannot be pushed at once and walls block, so such
a move leaves the room unchanged (valid, without effect). All boxes on targets wins (`success` 1.0,
episode over). An answer that is missing or not one of the four moves changes nothing and earns
`invalid_action` 1.0 (weight -0.1). `boxes_on_target` (weight 0, logged) is the change this turn in
the fraction of boxes on targets, so its sum over an episode is the net progress.

Shaping (`potential`, weight 0: logged, opt-in with `task.env.reward_weights.potential`, e.g.
0.5): potential-based reward shaping (Ng, Harada & Russell 1999) on box-to-target distance,
Phi = -(sum over boxes of BFS moves to the nearest target, walls blocking) / (boxes x floor cells),
each turn earning Phi(after) - Phi(before) (gamma 1). An episode's shaping telescopes to
Phi(last) - Phi(start): 0 - Phi(start) for every solved episode, so it ranks unsolved episodes by
how near their boxes ended and leaves the solved ones' order alone; Phi is 0 only when solved, so
whatever the weight a solved episode outscores every unsolved one from the same start.

Instances are solvable by construction ("reverse play", as in the generator RAGEN borrows from
gym-sokoban): random inner walls (keeping the floor connected), boxes placed on targets, then random
reverse moves in which the player walks and sometimes pulls a box. Levels that start solved are
rejected, and a BFS solver over (player, boxes) states with a node cap checks that a solution of at
most max_turns // 2 moves exists, so the turn cap leaves room for mistakes.

Split: by room (`split_key`: the walls and targets), not by level. Levels of one room reach one
another's starts in play (a 5x5 room split by level id held out 200 starts of which 178 were
reachable mid-game states of train levels, and 40 appeared in the warm-up's demonstrations); a
held-out room is one no train level, and so no train episode or demonstration, was ever in.

Demonstration policies (rlvr.authoring.demos): `random_action` answers one of the four moves uniformly
(a format warm-up); `scripted_action` plays the BFS solver's next move (behaviour cloning).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Mapping, Sequence, Set
from typing import Any, ClassVar

from pydantic import Field

from rlvr.envs.base import (
    STATE_KEY,
    Env,
    EnvFamily,
    EnvOptions,
    EnvReset,
    EnvStep,
    Message,
    register_env,
)
from rlvr.envs.frozenlake import ANSWER_FORMAT, MOVES, Cell, latest_grid, parse_move
from rlvr.errors import ConfigError
from rlvr.records import Task

State = tuple[Cell, frozenset[Cell]]  # (player, boxes)


def draw(
    shape: Cell, walls: Set[Cell], targets: Set[Cell], boxes: Set[Cell], player: Cell
) -> list[str]:
    """Legend rows of a room."""

    def char(p: Cell) -> str:
        if p in walls:
            return "#"
        if p == player:
            return "S" if p in targets else "P"
        if p in boxes:
            return "√" if p in targets else "X"
        return "O" if p in targets else "_"

    return ["".join(char((r, c)) for c in range(shape[1])) for r in range(shape[0])]


class Room:
    """Walls and targets (fixed) plus the player and boxes (moving), parsed from legend rows."""

    def __init__(self, rows: Sequence[str]) -> None:
        self.shape = (len(rows), max(len(r) for r in rows))
        cells = {(r, c): ch for r, row in enumerate(rows) for c, ch in enumerate(row)}
        self.walls = frozenset(p for p, ch in cells.items() if ch == "#")
        self.targets = frozenset(p for p, ch in cells.items() if ch in "OS√")
        self.boxes = frozenset(p for p, ch in cells.items() if ch in "X√")
        self.player = next(p for p, ch in cells.items() if ch in "PS")

    def rows(self) -> list[str]:
        return draw(self.shape, self.walls, self.targets, self.boxes, self.player)

    def solved(self) -> bool:
        return self.boxes <= self.targets


def room_rows(room: Room) -> list[str]:
    """The room's walls and targets alone, as legend rows (no player, no boxes)."""
    return draw(room.shape, room.walls, room.targets, frozenset(), (-1, -1))


def push(walls: frozenset[Cell], player: Cell, boxes: frozenset[Cell], move: str) -> State | None:
    """(player, boxes) after a move, or None when a wall, or a box that cannot move, blocks it."""
    dr, dc = MOVES[move]
    nxt = (player[0] + dr, player[1] + dc)
    if nxt in walls:
        return None
    if nxt in boxes:
        beyond = (nxt[0] + dr, nxt[1] + dc)
        if beyond in walls or beyond in boxes:
            return None
        return nxt, (boxes - {nxt}) | {beyond}
    return nxt, boxes


def target_distances(
    walls: frozenset[Cell], targets: frozenset[Cell], shape: Cell
) -> dict[Cell, int]:
    """Moves from each floor cell to the nearest target, walls blocking, other boxes ignored (BFS
    outward from every target at once). Cells that reach no target are left out."""
    dist = dict.fromkeys(targets, 0)
    queue = deque(targets)
    while queue:
        cell = queue.popleft()
        for dr, dc in MOVES.values():
            r, c = nxt = (cell[0] + dr, cell[1] + dc)
            if 0 <= r < shape[0] and 0 <= c < shape[1] and nxt not in walls and nxt not in dist:
                dist[nxt] = dist[cell] + 1
                queue.append(nxt)
    return dist


def room_potential(room: Room, distances: Mapping[Cell, int] | None = None) -> float:
    """Phi(room) = -(sum over boxes of moves to the nearest target) / (boxes x floor cells): 0 when
    solved, in (-1, 0) otherwise. The potential of the `potential` reward part (SokobanEnv.step)."""
    dist = distances or target_distances(room.walls, room.targets, room.shape)
    floor = room.shape[0] * room.shape[1] - len(room.walls)
    return -sum(dist.get(b, floor) for b in room.boxes) / (len(room.boxes) * floor)


def solve_sokoban(rows: Sequence[str], max_nodes: int = 200_000) -> list[str] | None:
    """A shortest list of moves that puts every box on a target; None if none was found within
    `max_nodes` visited states (BFS over (player, boxes))."""
    room = Room(rows)
    start = (room.player, room.boxes)
    came: dict[State, tuple[State, str] | None] = {start: None}
    queue = deque([start])
    while queue and len(came) <= max_nodes:
        state = queue.popleft()
        if state[1] <= room.targets:
            path: list[str] = []
            while (prev := came[state]) is not None:
                state, move = prev
                path.append(move)
            return path[::-1]
        for move in MOVES:
            nxt = push(room.walls, *state, move)
            if nxt is not None and nxt not in came:
                came[nxt] = (state, move)
                queue.append(nxt)
    return None


def _connected(floor: set[Cell]) -> bool:
    start = next(iter(floor))
    seen, queue = {start}, deque([start])
    while queue:
        r, c = queue.popleft()
        for dr, dc in MOVES.values():
            if (nxt := (r + dr, c + dc)) in floor and nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return len(seen) == len(floor)


def reverse_play(rng: random.Random, size: int, num_boxes: int) -> list[str]:
    """A random room whose boxes started on targets and were pulled back by random reverse moves."""
    floor = {(r, c) for r in range(1, size - 1) for c in range(1, size - 1)}
    for cell in rng.sample(sorted(floor), rng.randint(0, len(floor) // 6)):
        if _connected(floor - {cell}):
            floor.discard(cell)
    walls = {(r, c) for r in range(size) for c in range(size)} - floor
    free = sorted(floor)
    targets = rng.sample(free, num_boxes)
    boxes = set(targets)
    player = rng.choice([p for p in free if p not in boxes])
    for _ in range(rng.randint(3 * size, 8 * size)):
        dr, dc = MOVES[rng.choice(list(MOVES))]
        nxt, behind = (player[0] + dr, player[1] + dc), (player[0] - dr, player[1] - dc)
        if nxt in walls or nxt in boxes:
            continue
        if behind in boxes and rng.random() < 0.8:
            boxes.remove(behind)
            boxes.add(player)
        player = nxt
    return draw((size, size), walls, set(targets), boxes, player)


class SokobanOptions(EnvOptions):
    size: int = Field(6, ge=5, le=7, description="Side of the square room, outer walls included.")
    num_boxes: int = Field(1, ge=1, le=2, description="Boxes (and targets) in the room.")


class SokobanEnv(Env):
    """One Sokoban episode in a 5x5 room (subclasses set the turn cap of bigger rooms)."""

    max_turns = 10

    def __init__(self, task: Task) -> None:
        self.task = task
        self.room = Room([str(r) for r in task.fields["rows"]])
        self.distances = target_distances(self.room.walls, self.room.targets, self.room.shape)
        self.done = False

    def render(self) -> str:
        return "\n".join(" ".join(row) for row in self.room.rows())

    def on_target(self) -> float:
        return len(self.room.boxes & self.room.targets) / len(self.room.boxes)

    def reset(self) -> EnvReset:
        return EnvReset(messages=[dict(m) for m in self.task.messages])

    def step(self, assistant_text: str) -> EnvStep:
        if self.done:
            raise RuntimeError("step() called after the episode ended")
        move, problem = parse_move(assistant_text)
        rewards = {"success": 0.0, "invalid_action": 0.0, "boxes_on_target": 0.0, "potential": 0.0}
        info: dict[str, Any] = {}
        if move is None:
            rewards["invalid_action"], info["invalid_action"] = 1.0, 1
            note = problem
        else:
            before = self.on_target()
            phi_before = room_potential(self.room, self.distances)
            moved = push(self.room.walls, self.room.player, self.room.boxes, move)
            if moved is None:
                note, info["no_effect"] = f"You tried {move} but it is blocked; nothing moved.", 1
            else:
                pushed = moved[1] != self.room.boxes
                self.room.player, self.room.boxes = moved
                note = f"You moved {move}{' and pushed a box' if pushed else ''}."
            rewards["boxes_on_target"] = self.on_target() - before
            # Potential-based shaping (Ng et al. 1999), gamma 1: telescopes over the episode.
            rewards["potential"] = room_potential(self.room, self.distances) - phi_before
            if self.room.solved():
                self.done = True
                rewards["success"] = 1.0
                return EnvStep(rewards=rewards, done=True, info=info)
        content = f"{note}\n{self.render()}\n{ANSWER_FORMAT}"
        observation: list[Message] = [{"role": "user", "content": content}]
        # The walls and targets are the task's; the player and the boxes are the state. GiGPO groups
        # turns by it (the observation's text also narrates the last move).
        info[STATE_KEY] = (self.room.player, tuple(sorted(self.room.boxes)))
        return EnvStep(messages=observation, rewards=rewards, info=info)


# Turn cap by room size: bigger rooms need more pushes.
MAX_TURNS_BY_SIZE: dict[int, int] = {5: 10, 6: 14, 7: 20}


def make_task(rows: Sequence[str]) -> Task:
    """The task for one level given as legend rows; its id is the rows."""
    rows = list(rows)
    system = (
        "You are playing Sokoban. Push every box onto a target. Each turn make one move: Up, Down, "
        "Left or Right. Walking into a box pushes it if the cell behind it is free; you cannot pull "
        "boxes, push two at once or walk through walls.\n"
        "Legend: # wall, _ floor, O target, X box, √ box on target, P player, S player on target."
    )
    user = "\n".join(" ".join(row) for row in rows) + f"\n{ANSWER_FORMAT}"
    messages = ({"role": "system", "content": system}, {"role": "user", "content": user})
    return Task(id="sokoban:" + "/".join(rows), messages=messages, fields={"rows": rows})


@register_env
class SokobanFamily(EnvFamily):
    name: ClassVar[str] = "sokoban"
    description: ClassVar[str] = "Push boxes onto targets in a small room, one move a turn (RAGEN)."
    Options: ClassVar[type[EnvOptions]] = SokobanOptions
    success_metric: ClassVar[str] = "success"
    reward_weights: ClassVar[Mapping[str, float]] = {
        "success": 1.0,
        "invalid_action": -0.1,
        "boxes_on_target": 0.0,
        "potential": 0.0,  # logged; a positive weight turns on the distance shaping
    }
    example_config: ClassVar[str] = "examples/env_sokoban.yaml"

    def generate(self, seed: int) -> Task:
        opts = self.options
        assert isinstance(opts, SokobanOptions)
        rng = random.Random(seed)
        longest = MAX_TURNS_BY_SIZE[opts.size] // 2
        for _ in range(1000):
            rows = reverse_play(rng, opts.size, opts.num_boxes)
            if Room(rows).solved():
                continue
            solution = solve_sokoban(rows)
            if solution is not None and len(solution) <= longest:
                return make_task(rows)
        raise ConfigError(f"sokoban: no level found for seed {seed}; change task.env.options")

    def random_action(self, task: Task, messages: list[Message], rng: random.Random) -> str:
        """A well-formed move chosen uniformly: teaches the answer format, not the puzzle."""
        return f"<answer>{rng.choice(list(MOVES))}</answer>"

    def scripted_action(self, task: Task, messages: list[Message]) -> str:
        """The solver's first move from the newest room shown; "Up" when the level is lost (a box
        in a corner) or the solver's node cap is reached."""
        path = solve_sokoban(latest_grid(task, messages, "#_OX√PS"))
        return f"<answer>{path[0] if path else 'Up'}</answer>"

    def split_key(self, task: Task) -> str:
        """The room without its player and boxes: every state a level can reach keeps them."""
        room = Room([str(r) for r in task.fields["rows"]])
        return "sokoban-room:" + "/".join(room_rows(room))

    def make(self, task: Task) -> Env:
        env = SokobanEnv(task)
        env.max_turns = MAX_TURNS_BY_SIZE.get(len(task.fields["rows"]), env.max_turns)
        return env
