"""FrozenLake: walk across a frozen lake to the goal without falling into a hole, one move a turn.

The grid game of Gymnasium's FrozenLake as used for multi-turn agent RL in RAGEN (Wang et al., 2025,
"RAGEN: Understanding Self-Evolution in LLM Agents via Multi-Turn Reinforcement Learning"). Rules:
the player P stands on frozen ice F; each turn the model answers one move, Up, Down, Left or Right,
inside <answer></answer> (case-insensitive). Reaching the goal G wins (`success` 1.0, episode over);
stepping onto a hole H loses (episode over). A move into the lake's edge leaves the player in place
(a valid move without effect). An answer that is missing or not one of the four moves changes
nothing and earns `invalid_action` 1.0 (weight -0.1); the observation says what was wrong.

Slippery ice (`slippery: true`): a move slips with probability 1/3 to one of the two perpendicular
directions, each equally likely (Gymnasium instead keeps the intended direction with probability
1/3). Slips are drawn from the env's own `random.Random(seed)`. `make` gives each env a seed fixed by
the task id and how many envs of that task this family made before, so the G envs of one group slip
differently while a run replays exactly; without a seed the env seeds from the task id.

Instances: start and goal are two random cells, every other cell is a hole with probability
`hole_fraction`; the map is redrawn from the same rng until BFS finds a path of 2 to max_turns - 2
moves, so every instance is solvable without slips within the env's turn cap.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections import deque
from collections.abc import Mapping, Sequence
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
from rlvr.errors import ConfigError
from rlvr.records import Task
from rlvr.verifiers.builtin import extract_tagged

Cell = tuple[int, int]
MOVES: dict[str, Cell] = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}
_SIDEWAYS = ("Left", "Right")
_PERPENDICULAR = {
    "Up": _SIDEWAYS,
    "Down": _SIDEWAYS,
    "Left": ("Up", "Down"),
    "Right": ("Up", "Down"),
}
ANSWER_FORMAT = "Answer with one action inside <answer></answer>, e.g. <answer>Left</answer>."
VALID_ACTIONS = "Valid actions: Up, Down, Left, Right."


def parse_move(text: str) -> tuple[str | None, str]:
    """(canonical move, "") for a valid answer, else (None, what was wrong)."""
    answer = extract_tagged(text, "answer")
    if answer is None:
        return None, f"No action found: put one action inside <answer></answer>. {VALID_ACTIONS}"
    key = answer.strip().strip(".!'\"`").lower()
    for move in MOVES:
        if key == move.lower():
            return move, ""
    return None, f"{answer[:30]!r} is not a valid action. {VALID_ACTIONS}"


def solve_frozenlake(rows: Sequence[str]) -> list[str] | None:
    """A shortest list of moves from P to G avoiding holes (no slips), or None when there is none."""
    n = len(rows)
    start = next((r, c) for r in range(n) for c in range(n) if rows[r][c] == "P")
    came: dict[Cell, tuple[Cell, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if rows[cell[0]][cell[1]] == "G":
            path: list[str] = []
            while (prev := came[cell]) is not None:
                cell, move = prev
                path.append(move)
            return path[::-1]
        for move, (dr, dc) in MOVES.items():
            r, c = nxt = (cell[0] + dr, cell[1] + dc)
            if 0 <= r < n and 0 <= c < n and rows[r][c] != "H" and nxt not in came:
                came[nxt] = (cell, move)
                queue.append(nxt)
    return None


def _seed_of(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


class FrozenLakeOptions(EnvOptions):
    size: int = Field(4, ge=4, le=6, description="Side of the square lake (4..6 cells).")
    hole_fraction: float = Field(
        0.2, ge=0.0, le=0.5, description="Chance that a cell other than start and goal is a hole."
    )
    slippery: bool = Field(
        False, description="Each move slips to a perpendicular direction with probability 1/3."
    )


class FrozenLakeEnv(Env):
    """One FrozenLake episode on a 4x4 lake (subclasses set the turn cap of bigger lakes)."""

    max_turns = 8

    def __init__(self, task: Task, seed: int | None = None) -> None:
        rows = [str(r) for r in task.fields["rows"]]
        self.task, self.size = task, len(rows)
        cells = [(r, c) for r in range(self.size) for c in range(self.size)]
        self.holes = {(r, c) for r, c in cells if rows[r][c] == "H"}
        self.goal = next((r, c) for r, c in cells if rows[r][c] == "G")
        self.player = next((r, c) for r, c in cells if rows[r][c] == "P")
        self.slippery = bool(task.fields.get("slippery", False))
        self.seed = _seed_of(task.id) if seed is None else seed
        self.rng = random.Random(self.seed)
        self.done = False

    def render(self) -> str:
        """The lake, one character per cell separated by spaces, top row first."""

        def char(cell: Cell) -> str:
            if cell == self.player:
                return "P"
            return "G" if cell == self.goal else "H" if cell in self.holes else "F"

        n = self.size
        return "\n".join(" ".join(char((r, c)) for c in range(n)) for r in range(n))

    def reset(self) -> EnvReset:
        return EnvReset(messages=[dict(m) for m in self.task.messages])

    def step(self, assistant_text: str) -> EnvStep:
        if self.done:
            raise RuntimeError("step() called after the episode ended")
        move, problem = parse_move(assistant_text)
        if move is None:
            content = f"{problem}\n{self.render()}\n{ANSWER_FORMAT}"
            return EnvStep(
                messages=[{"role": "user", "content": content}],
                rewards={"success": 0.0, "invalid_action": 1.0},
                info={"invalid_action": 1, STATE_KEY: self.player},
            )
        direction = move
        if self.slippery and self.rng.random() < 1 / 3:
            direction = self.rng.choice(_PERPENDICULAR[move])
        note = (
            f"You moved {move}."
            if direction == move
            else f"You tried {move} but slipped {direction}."
        )
        info: dict[str, Any] = {"slipped": int(direction != move)}
        dr, dc = MOVES[direction]
        r, c = self.player[0] + dr, self.player[1] + dc
        if 0 <= r < self.size and 0 <= c < self.size:
            self.player = (r, c)
        else:
            note += " The edge stopped you; you did not move."
            info["no_effect"] = 1
        won = self.player == self.goal
        if won or self.player in self.holes:
            self.done = True
            info["fell"] = int(not won)
            return EnvStep(
                rewards={"success": float(won), "invalid_action": 0.0}, done=True, info=info
            )
        observation: list[Message] = [
            {"role": "user", "content": f"{note}\n{self.render()}\n{ANSWER_FORMAT}"}
        ]
        # The lake is the task's; the player's cell is the whole state. GiGPO groups turns by it:
        # the observation's text also narrates the last move, which would split equal positions.
        info[STATE_KEY] = self.player
        return EnvStep(
            messages=observation, rewards={"success": 0.0, "invalid_action": 0.0}, info=info
        )


# Turn cap by map size: bigger lakes need longer walks.
MAX_TURNS_BY_SIZE: dict[int, int] = {4: 8, 5: 10, 6: 12}


def make_task(rows: Sequence[str], slippery: bool = False) -> Task:
    """The task for one lake given as rows of P/F/H/G; its id is the rows (and the slip rule)."""
    rows = list(rows)
    env = FrozenLakeEnv(Task(id="", messages=(), fields={"rows": rows}))
    system = (
        "You are playing FrozenLake. Move the player P over the frozen ice F to the goal G. "
        "Stepping into a hole H loses the game. Each turn make one move: Up, Down, Left or Right."
        + (" The ice is slippery: a move sometimes goes sideways." if slippery else "")
        + "\nLegend: P player, F frozen ice, H hole, G goal."
    )
    user = f"{env.render()}\n{ANSWER_FORMAT}"
    key = "frozenlake:" + "/".join(rows) + (":slippery" if slippery else "")
    messages = ({"role": "system", "content": system}, {"role": "user", "content": user})
    return Task(id=key, messages=messages, fields={"rows": rows, "slippery": slippery})


@register_env
class FrozenLakeFamily(EnvFamily):
    name: ClassVar[str] = "frozenlake"
    description: ClassVar[str] = (
        "Walk a frozen lake to the goal avoiding holes, one move a turn (RAGEN)."
    )
    Options: ClassVar[type[EnvOptions]] = FrozenLakeOptions
    success_metric: ClassVar[str] = "success"
    reward_weights: ClassVar[Mapping[str, float]] = {"success": 1.0, "invalid_action": -0.1}
    example_config: ClassVar[str] = "examples/env_frozenlake.yaml"

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        self._made: dict[str, int] = {}
        self._lock = threading.Lock()

    def generate(self, seed: int) -> Task:
        opts = self.options
        assert isinstance(opts, FrozenLakeOptions)
        rng = random.Random(seed)
        n = opts.size
        longest = MAX_TURNS_BY_SIZE[n] - 2
        cells = [(r, c) for r in range(n) for c in range(n)]
        for _ in range(10_000):
            start, goal = rng.sample(cells, 2)
            grid = [["F"] * n for _ in range(n)]
            for r, c in cells:
                if (r, c) not in (start, goal) and rng.random() < opts.hole_fraction:
                    grid[r][c] = "H"
            grid[start[0]][start[1]], grid[goal[0]][goal[1]] = "P", "G"
            rows = ["".join(row) for row in grid]
            path = solve_frozenlake(rows)
            if path is not None and 2 <= len(path) <= longest:
                return make_task(rows, opts.slippery)
        raise ConfigError(
            f"frozenlake: no solvable lake found for seed {seed}; lower task.env.options.hole_fraction"
        )

    def make(self, task: Task) -> Env:
        """A fresh env; its slip seed is fixed by the task id and the count of envs made for it."""
        with self._lock:
            k = self._made.get(task.id, 0)
            self._made[task.id] = k + 1
        env = FrozenLakeEnv(task, seed=_seed_of(f"{task.id}#{k}"))
        env.max_turns = MAX_TURNS_BY_SIZE.get(len(task.fields["rows"]), env.max_turns)
        return env
