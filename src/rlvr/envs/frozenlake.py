"""FrozenLake: walk across a frozen lake to the goal without falling into a hole, one move a turn.

The grid game of Gymnasium's FrozenLake as used for multi-turn agent RL in RAGEN (Wang et al., 2025,
"RAGEN: Understanding Self-Evolution in LLM Agents via Multi-Turn Reinforcement Learning"). Rules:
the player P stands on frozen ice F; each turn the model answers one move, Up, Down, Left or Right,
inside <answer></answer> (case-insensitive). Reaching the goal G wins (`success` 1.0, episode over);
stepping onto a hole H loses (episode over). A move into the lake's edge leaves the player in place
(a valid move without effect; it earns `no_effect` 1.0, weight 0: logged as rewards/no_effect/mean,
the edge pushes an episode made, and not optimised unless `task.env.reward_weights.no_effect` is
set, e.g. -0.1, to shape the reward against wasted moves; on slippery ice a slip into the edge
counts too). An answer that is missing or not one of the four moves changes nothing and earns
`invalid_action` 1.0 (weight -0.1); the observation says what was wrong.

The dynamics are Gymnasium's FrozenLake-v1 (`desc=` the task's map, `is_slippery`), played through
the gymnasium adapter (rlvr.envs.gym_adapter); rlvr renders the lake, parses the answer and names the
reward parts. Slippery ice (`slippery: true`), Gymnasium's rule: a move goes in the intended
direction with probability 1/3 and to each of the two perpendicular directions with probability 1/3.
(Before rlvr used gymnasium, a move slipped only with probability 1/3.) The chance is the gym env's,
seeded from the task id and the episode's place in its group (`Env.episode_index`, set by the
engine): the G episodes of a group slip differently, and a replayed or resumed run slips the same.

Split: by lake (`split_key`: the holes and the goal, the player left out). Two instances that
differ only in the start cell reach one another's start in play, so the start never decides the
side: a held-out lake is one no train episode walked on.

Instances: start and goal are two random cells, every other cell is a hole with probability
`hole_fraction`; the map is redrawn from the same rng until BFS finds a path of 2 to max_turns - 2
moves, so every instance is solvable without slips within the env's turn cap.

Shaping (`potential`, weight 0: logged, opt-in with `task.env.reward_weights.potential`, e.g.
0.5): potential-based reward shaping (Ng, Harada & Russell 1999) on the BFS distance to the goal,
Phi(cell) = -(moves to G over non-hole cells) / (cells in the lake), each turn earning
Phi(after) - Phi(before) (gamma 1): +1/16 a move closer on a 4x4 lake, -1/16 a move away, 0 into
the edge. An episode's shaping telescopes to Phi(last) - Phi(start); the start is shared by a
group, so it only ranks the group's failures by where they ended (a hole counts its distance too:
a fall beside the goal ended closer than one beside the start), and under turn or GiGPO credit it
acts as a state baseline. The goal's potential is 0 and no other is higher, so whatever the
weight w a win earns 1 - w Phi(last) more than any failed episode from the same start; Ng et al.'s
guarantee for every MDP (slippery ice included) needs every terminal potential 0, which would pay
a fall as much as a win on this part, so it is not claimed for slippery ice.

Observation (`observation`): "grid" shows the lake as text, as RAGEN does; "positions" adds a line
naming the player's and the goal's row and column and what each move would step onto (ice, hole,
goal or the edge), for models too small to read a text grid.

Demonstration policies (rlvr.authoring.demos): `random_action` answers one of the four moves uniformly
(well formed, chosen blindly: a format warm-up); `scripted_action` walks a shortest safe path from
where the newest observation shows the player (behaviour cloning: it teaches the task).
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

from pydantic import Field

from rlvr.envs.base import (
    Env,
    EnvFamily,
    EnvOptions,
    EnvStep,
    Message,
    register_env,
)
from rlvr.envs.gym_adapter import GymEnv, GymSpec, InvalidAction
from rlvr.errors import ConfigError
from rlvr.records import Task
from rlvr.verifiers.builtin import extract_tagged

Cell = tuple[int, int]
MOVES: dict[str, Cell] = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}
# Gymnasium FrozenLake's action numbers.
GYM_ACTIONS: dict[str, int] = {"Left": 0, "Down": 1, "Right": 2, "Up": 3}
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


def goal_distances(rows: Sequence[str]) -> dict[Cell, int]:
    """Moves from each cell to the goal G over cells that are not holes (BFS outward from G); a
    hole gets 1 + its nearest non-hole neighbour's distance (where the episode ended, how far from
    the goal). Cells that cannot reach the goal are left out."""
    n = len(rows)
    goal = next((r, c) for r in range(n) for c in range(n) if rows[r][c] == "G")
    dist = {goal: 0}
    queue = deque([goal])
    holes: dict[Cell, int] = {}
    while queue:
        cell = queue.popleft()
        for dr, dc in MOVES.values():
            r, c = nxt = (cell[0] + dr, cell[1] + dc)
            if not (0 <= r < n and 0 <= c < n) or nxt in dist:
                continue
            if rows[r][c] == "H":
                holes.setdefault(nxt, dist[cell] + 1)
                continue
            dist[nxt] = dist[cell] + 1
            queue.append(nxt)
    return {**holes, **dist}


def lake_potential(rows: Sequence[str], cell: Cell) -> float:
    """Phi(cell) = -(moves to the goal) / (cells in the lake): 0 at the goal, in (-1, 0] on every
    cell that reaches it, -1 where the goal cannot be reached. The potential of the `potential`
    reward part (FrozenLakeEnv.step)."""
    area = len(rows) * len(rows[0])
    return -goal_distances(rows).get(cell, area) / area


def latest_grid(task: Task, messages: Sequence[Message], alphabet: str) -> list[str]:
    """The newest grid drawn in the conversation (the last observation showing one, else the task's
    prompt), as rows without their spaces: a grid line is two or more single cells of `alphabet`
    separated by spaces, which no narration or instruction line is."""
    for message in [*task.messages, *messages][::-1]:
        if message.get("role") == "assistant":
            continue
        rows = [
            line.replace(" ", "")
            for line in str(message.get("content", "")).splitlines()
            if len(cells := line.split()) >= 2 and all(len(c) == 1 and c in alphabet for c in cells)
        ]
        if rows:
            return rows
    raise ValueError(f"no grid of {alphabet!r} in the conversation of task {task.id}")


def render_lake(rows: Sequence[str], player: Cell) -> str:
    """The lake, one character per cell separated by spaces, top row first; P marks the player
    (the start cell is frozen ice once the player has left it)."""

    def char(r: int, c: int) -> str:
        if (r, c) == player:
            return "P"
        return "F" if rows[r][c] == "P" else rows[r][c]

    n = len(rows)
    return "\n".join(" ".join(char(r, c) for c in range(n)) for r in range(n))


# What a neighbouring cell is, in words, for the "positions" observation.
_CELL_WORDS = {"F": "ice", "P": "ice", "H": "hole", "G": "goal"}


def describe_positions(rows: Sequence[str], player: Cell) -> str:
    """The player's and the goal's cells (row and column, counted from 1 at the top left) and what
    each move would step onto: the lake's facts a small model may not read off the grid (cloning the
    solver on the grid alone, SmolLM2-135M's move loss stayed high, docs/efficacy_notes.md).
    It states no advice: which way is safe *and* leads to the goal is still the policy's to find."""
    n = len(rows)
    goal = next((r, c) for r in range(n) for c in range(n) if rows[r][c] == "G")
    around = []
    for move, (dr, dc) in MOVES.items():
        r, c = player[0] + dr, player[1] + dc
        around.append(f"{move}: {_CELL_WORDS[rows[r][c]] if 0 <= r < n and 0 <= c < n else 'edge'}")
    return (
        f"You are at row {player[0] + 1}, column {player[1] + 1}. The goal is at row {goal[0] + 1}, "
        f"column {goal[1] + 1}. Next cells: {', '.join(around)}."
    )


def _parse_action(text: str) -> int:
    move, problem = parse_move(text)
    if move is None:
        raise InvalidAction(problem)
    return GYM_ACTIONS[move]


def _gym_lake(task: Task) -> Any:
    import gymnasium

    desc = [str(r).replace("P", "S") for r in task.fields["rows"]]
    slippery = bool(task.fields.get("slippery", False))
    return gymnasium.make("FrozenLake-v1", desc=desc, is_slippery=slippery)


def _lake_and_player(state: Any, gym_env: Any) -> tuple[list[str], Cell]:
    """The gym env's map as rows of P/F/H/G (its start S read as P) and the player's cell."""
    rows = ["".join(b.decode() for b in row).replace("S", "P") for row in gym_env.unwrapped.desc]
    return rows, divmod(int(state), len(rows[0]))


def _render_state(state: Any, gym_env: Any) -> str:
    return render_lake(*_lake_and_player(state, gym_env))


def _render_with_positions(state: Any, gym_env: Any) -> str:
    rows, player = _lake_and_player(state, gym_env)
    return f"{render_lake(rows, player)}\n{describe_positions(rows, player)}"


def _success(
    reward: float, terminated: bool, truncated: bool, info: Mapping[str, Any]
) -> dict[str, float]:
    return {"success": 1.0 if reward > 0 else 0.0}


SPEC = GymSpec(
    make=_gym_lake,
    render=_render_state,
    parse=_parse_action,
    rewards=_success,
    reward_parts=("success", "no_effect", "potential"),  # the last two: FrozenLakeEnv.step
    instruction=ANSWER_FORMAT,
)
SPEC_WITH_POSITIONS = dataclasses.replace(SPEC, render=_render_with_positions)
Observation = Literal["grid", "positions"]


class FrozenLakeOptions(EnvOptions):
    size: int = Field(4, ge=4, le=6, description="Side of the square lake (4..6 cells).")
    hole_fraction: float = Field(
        0.2, ge=0.0, le=0.5, description="Chance that a cell other than start and goal is a hole."
    )
    slippery: bool = Field(
        False,
        description=(
            "Gymnasium's slippery ice: a move goes the intended way with probability 1/3, "
            "else to either perpendicular direction (1/3 each)."
        ),
    )
    observation: Observation = Field(
        "grid",
        description=(
            "What each turn shows: 'grid' the lake as text (RAGEN); 'positions' the grid plus the "
            "player's and goal's row and column and what each move would step onto."
        ),
    )


class FrozenLakeEnv(GymEnv):
    """One FrozenLake episode on a 4x4 lake (subclasses set the turn cap of bigger lakes): gymnasium's
    FrozenLake-v1 on the task's map. `seed` overrides the episode seed (see GymEnv)."""

    max_turns = 8

    def __init__(self, task: Task, seed: int | None = None) -> None:
        rows = [str(r) for r in task.fields["rows"]]
        self.size = len(rows)
        spec = SPEC_WITH_POSITIONS if task.fields.get("observation") == "positions" else SPEC
        super().__init__(task, spec, seed=seed)

    def step(self, assistant_text: str) -> EnvStep:
        self.start()
        before = self._cell(self.observation)
        out = super().step(assistant_text)
        out.rewards["no_effect"] = float(out.info.get("no_effect", 0))  # a push into the edge
        # Potential-based shaping (Ng, Harada & Russell 1999), gamma 1: Phi(after) - Phi(before),
        # so an episode's sum telescopes to Phi(last cell) - Phi(start cell) (module docstring).
        rows = [str(r) for r in self.task.fields["rows"]]
        after = self._cell(self.observation)
        out.rewards["potential"] = lake_potential(rows, after) - lake_potential(rows, before)
        return out

    def state_key(self, observation: Any) -> Cell:
        """The player's cell: the lake is the task's, so the cell is the whole state. GiGPO groups
        turns by it (the observation's text also narrates the last move)."""
        return self._cell(observation)

    def _cell(self, state: Any) -> Cell:
        r, c = divmod(int(state), self.size)
        return (r, c)

    @property
    def player(self) -> Cell:
        """The player's cell (row, column)."""
        self.start()
        return self._cell(self.observation)

    def describe(
        self, action: Any, before: Any, after: Any, reward: float, terminated: bool
    ) -> tuple[str, dict[str, Any]]:
        move = next(m for m, a in GYM_ACTIONS.items() if a == action)
        old, new = self._cell(before), self._cell(after)
        # Which way the player went: the intended move if it leads to the new cell, else the
        # perpendicular one that does (the two cannot both stop at an edge on a lake this wide).
        direction = next(d for d in (move, *_PERPENDICULAR[move]) if self._target(old, d) == new)
        note = (
            f"You moved {move}."
            if direction == move
            else f"You tried {move} but slipped {direction}."
        )
        info: dict[str, Any] = {"slipped": int(direction != move)}
        if new == old:
            note += " The edge stopped you; you did not move."
            info["no_effect"] = 1
        if terminated:
            info["fell"] = int(reward <= 0)
        return note, info

    def _target(self, cell: Cell, move: str) -> Cell:
        dr, dc = MOVES[move]
        return (min(max(cell[0] + dr, 0), self.size - 1), min(max(cell[1] + dc, 0), self.size - 1))


# Turn cap by map size: bigger lakes need longer walks.
MAX_TURNS_BY_SIZE: dict[int, int] = {4: 8, 5: 10, 6: 12}


def make_task(
    rows: Sequence[str], slippery: bool = False, observation: Observation = "grid"
) -> Task:
    """The task for one lake given as rows of P/F/H/G; its id is the rows (and the slip rule, and the
    observation when it is not the plain grid)."""
    rows = list(rows)
    n = len(rows)
    start = next((r, c) for r in range(n) for c in range(n) if rows[r][c] == "P")
    system = (
        "You are playing FrozenLake. Move the player P over the frozen ice F to the goal G. "
        "Stepping into a hole H loses the game. Each turn make one move: Up, Down, Left or Right."
        + (" The ice is slippery: a move sometimes goes sideways." if slippery else "")
        + "\nLegend: P player, F frozen ice, H hole, G goal."
    )
    shown = render_lake(rows, start)
    if observation == "positions":
        shown += "\n" + describe_positions(rows, start)
    user = f"{shown}\n{ANSWER_FORMAT}"
    key = "frozenlake:" + "/".join(rows) + (":slippery" if slippery else "")
    key += f":{observation}" if observation != "grid" else ""
    messages = ({"role": "system", "content": system}, {"role": "user", "content": user})
    fields: dict[str, Any] = {"rows": rows, "slippery": slippery}
    if observation != "grid":  # a plain-grid task stays as it was before the option existed
        fields["observation"] = observation
    return Task(id=key, messages=messages, fields=fields)


@register_env
class FrozenLakeFamily(EnvFamily):
    name: ClassVar[str] = "frozenlake"
    description: ClassVar[str] = (
        "Walk a frozen lake to the goal avoiding holes, one move a turn (RAGEN)."
    )
    Options: ClassVar[type[EnvOptions]] = FrozenLakeOptions
    success_metric: ClassVar[str] = "success"
    reward_weights: ClassVar[Mapping[str, float]] = {
        "success": 1.0,
        "invalid_action": -0.1,
        "no_effect": 0.0,  # logged; a negative weight shapes against edge pushes
        "potential": 0.0,  # logged; a positive weight turns on the distance shaping
    }
    example_config: ClassVar[str] = "examples/env_frozenlake.yaml"

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
                return make_task(rows, opts.slippery, opts.observation)
        raise ConfigError(
            f"frozenlake: no solvable lake found for seed {seed}; lower task.env.options.hole_fraction"
        )

    def random_action(self, task: Task, messages: list[Message], rng: random.Random) -> str:
        """A well-formed move chosen uniformly: teaches the answer format, not where to go."""
        return f"<answer>{rng.choice(list(MOVES))}</answer>"

    def scripted_action(self, task: Task, messages: list[Message]) -> str:
        """The first move of a shortest safe path from the player's cell in the newest lake shown
        (replanned every turn, so slips are followed); "Up" when no path is left."""
        path = solve_frozenlake(latest_grid(task, messages, "PFHG"))
        return f"<answer>{path[0] if path else 'Up'}</answer>"

    def split_key(self, task: Task) -> str:
        """The lake with the player's cell as ice: every cell a walk reaches keeps the map."""
        rows = "/".join(str(r) for r in task.fields["rows"]).replace("P", "F")
        return f"frozenlake-lake:{rows}{':slippery' if task.fields.get('slippery') else ''}"

    def make(self, task: Task) -> Env:
        """A fresh env; its slips are seeded by the task id and the episode's `episode_index`."""
        env = FrozenLakeEnv(task)
        env.max_turns = MAX_TURNS_BY_SIZE.get(len(task.fields["rows"]), env.max_turns)
        return env
