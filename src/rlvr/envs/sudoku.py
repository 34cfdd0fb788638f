"""Sudoku 4x4: fill the blanks so every row, column and 2x2 box holds the digits 1-4 once.

A small logic puzzle with a cheap exact verifier, in the spirit of the puzzle environments of
Reasoning Gym (Stojanovski et al., 2025) and Enigmata (Chen et al., 2025), shrunk to 4x4 so that a
small model can solve it. Each instance has a unique solution: a full grid is made by a seeded shuffle
of a base pattern (digits, rows within bands, bands, columns within stacks, stacks, transpose), then
cells are removed one at a time as long as a backtracking solver still finds exactly one solution.

The puzzle is shown with '.' for blanks, one row per line. The answer is the full grid inside
`<answer>...</answer>`: 4 lines of 4 digits (spaces, commas, bars or one line of 16 digits are also
read). A wrong answer gets feedback naming what is wrong and one more try.

Reward parts (weights in `SudokuFamily.reward_weights`):
- `success` (1.0): a valid grid that keeps every given digit (for a unique puzzle: the solution).
- `format` (0.1): a 16-digit grid was read; earned at most once per episode.
- `cells` (0.5): the share of the puzzle's BLANK cells the answer fills with the solution's digit,
  and 0 when the answer changes any given or is not a 16-digit grid. Copying the puzzle earns 0
  (its blanks are not digits, or are 0s, which no solution holds), and every point of it is a blank
  filled right, so it pays only for solving part of the grid. It is paid as the change from the
  previous answer of the episode (as Sokoban's `boxes_on_target`), so over an episode it sums to
  the FINAL answer's share: a partial answer then a worse one earns the worse one's share, and a
  partial answer before the solution earns `cells` 1.0 in all, as answering the solution at once
  does (nothing to gain by holding back). A grid with every blank right and every given kept is the
  solution, so the final answer's `cells` is 1.0 exactly when `success` is paid.
  Why 0.5: a dense part gives GRPO something to compare when no rollout of a group solves the grid
  (docs/efficacy_notes.md: with `success` and `format` alone, 0.0% -> 0.0%), while success stays
  dominant: a solved episode earns 1.0 + 0.1 + 0.5 = 1.6, an unsolved one at most
  0.1 + 0.5 (k-1)/k < 0.6 for k blanks, and a full `cells` is worth half a solve.
  What it does not stop: correct digits by luck. A constant digit earns the share of blanks whose
  answer is that digit, a uniform random digit a quarter in expectation, a fill from each blank's
  candidates (digits no given peer holds) 0.9. That floor is open to every member of a group, so
  only answers with more blanks right than their group's others get a positive advantage. Puzzles
  without a stored solution and with more than one completion (hand-made ones only) pay `cells`
  1.0 on a valid grid and 0 otherwise.

Split: by answer grid (`split_key`). A 4x4 Sudoku has only 288 full grids, so a split by puzzle
held out puzzles whose answer grid was the answer of a train puzzle (all of them, measured); now a
held-out puzzle's grid is the answer of no train puzzle, at any number of blanks.

Demonstration policies (rlvr.authoring.demos): `random_action` keeps the givens and fills each blank with
a uniform random digit: the answer's shape and "keep the givens", not the logic (it solves a 6-blank
puzzle with probability 4^-6). Filling each blank from its candidates instead (the digits no given
in its row, column or box holds) was tried and rejected for the warm-up: most blanks of a
4x4 puzzle have one candidate, so 52% of such fills were the solution over 2000 train puzzles
(6 blanks, 5 fills each, 2026-12-01; 72% with 5 blanks, 89% with 4): a warm-up on them would teach
single-candidate elimination, i.e. much of the task, and the efficacy table's warm-up rows promise
a format-only warm-up.
`scripted_action` answers the stored solution (behaviour cloning).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from typing import ClassVar

from pydantic import Field

from rlvr.envs.base import (
    AnswerWithFeedbackEnv,
    Env,
    EnvFamily,
    EnvOptions,
    EnvStep,
    Message,
    register_env,
)
from rlvr.errors import ConfigError
from rlvr.records import Task
from rlvr.verifiers.builtin import extract_tagged

Grid = list[int]  # 16 cells, row-major; 0 is a blank
_BOX_NAMES = ("top-left", "top-right", "bottom-left", "bottom-right")
_SEPARATORS = re.compile(r"[\s,;|+\-_\[\]]")


def box_of(cell: int) -> int:
    return (cell // 8) * 2 + (cell % 4) // 2


def _units() -> list[tuple[str, list[int]]]:
    rows = [(f"Row {r + 1}", [r * 4 + c for c in range(4)]) for r in range(4)]
    cols = [(f"Column {c + 1}", [r * 4 + c for r in range(4)]) for c in range(4)]
    boxes = [
        (f"The {_BOX_NAMES[b]} box", [i for i in range(16) if box_of(i) == b]) for b in range(4)
    ]
    return rows + cols + boxes


UNITS = _units()
_PEERS = [{j for _, unit in UNITS if i in unit for j in unit if j != i} for i in range(16)]


def count_solutions(grid: Grid, limit: int = 2) -> int:
    """Number of completions of `grid` (0 = blank), counting no further than `limit`."""
    try:
        cell = grid.index(0)
    except ValueError:
        return 1
    total = 0
    taken = {grid[j] for j in _PEERS[cell]}
    for digit in range(1, 5):
        if digit not in taken:
            grid[cell] = digit
            total += count_solutions(grid, limit - total)
            grid[cell] = 0
            if total >= limit:
                break
    return total


def unique_solution(puzzle: Grid) -> Grid | None:
    """The puzzle's only valid completion, or None when it has none or more than one."""
    found: list[Grid] = []

    def search(grid: Grid) -> None:
        try:
            cell = grid.index(0)
        except ValueError:
            found.append(list(grid))
            return
        taken = {grid[j] for j in _PEERS[cell]}
        for digit in range(1, 5):
            if digit not in taken and len(found) < 2:
                grid[cell] = digit
                search(grid)
                grid[cell] = 0

    search(list(puzzle))
    if len(found) != 1 or grid_problems(found[0], puzzle):
        return None
    return found[0]


def blank_share(grid: Grid, puzzle: Grid, solution: Grid) -> float:
    """Share of the puzzle's blanks that `grid` fills with `solution`'s digit; 0.0 when `grid`
    changes a given (a puzzle without blanks: 1.0 when every given is kept)."""
    if any(given and got != given for given, got in zip(puzzle, grid, strict=True)):
        return 0.0
    blanks = [i for i, given in enumerate(puzzle) if not given]
    if not blanks:
        return 1.0
    return sum(grid[i] == solution[i] for i in blanks) / len(blanks)


def random_full_grid(rng: random.Random) -> Grid:
    """A valid full grid: the base pattern under a random symmetry of the 4x4 Sudoku."""

    def order() -> list[int]:
        bands = rng.sample([0, 1], 2)
        return [2 * b + i for b in bands for i in rng.sample([0, 1], 2)]

    digits = rng.sample([1, 2, 3, 4], 4)
    rows, cols = order(), order()
    grid = [
        digits[(2 * (rows[r] % 2) + rows[r] // 2 + cols[c]) % 4] for r in range(4) for c in range(4)
    ]
    if rng.random() < 0.5:
        grid = [grid[c * 4 + r] for r in range(4) for c in range(4)]
    return grid


def render(grid: Grid) -> str:
    cells = "".join(str(d) if d else "." for d in grid)
    return "\n".join(cells[r * 4 : r * 4 + 4] for r in range(4))


def parse_grid(text: str) -> Grid | None:
    """The 16 digits of an answer grid, or None when it is not exactly 16 digits."""
    cleaned = _SEPARATORS.sub("", text)
    return [int(ch) for ch in cleaned] if re.fullmatch(r"\d{16}", cleaned) else None


def grid_problems(grid: Grid, puzzle: Grid) -> list[str]:
    """Everything that makes `grid` not a valid completion of `puzzle`, in plain words."""
    problems = []
    for i, (given, got) in enumerate(zip(puzzle, grid, strict=True)):
        if given and got != given:
            problems.append(f"Row {i // 4 + 1}, column {i % 4 + 1} is given as {given}, not {got}.")
    for i, d in enumerate(grid):
        if not 1 <= d <= 4:
            problems.append(f"Only digits 1-4 are allowed, not {d} (row {i // 4 + 1}).")
    for label, unit in UNITS:
        counts = Counter(grid[i] for i in unit)
        for d, k in sorted(counts.items()):
            if k > 1 and 1 <= d <= 4:
                problems.append(f"{label} has {d} {'twice' if k == 2 else f'{k} times'}.")
    return problems


class SudokuOptions(EnvOptions):
    num_blanks: int = Field(
        6,
        ge=4,
        le=10,
        description="Blank cells per puzzle (more is harder); the solution stays unique.",
    )


@register_env
class SudokuFamily(EnvFamily):
    name: ClassVar[str] = "sudoku"
    description: ClassVar[str] = "4x4 Sudoku with a unique solution; answer the full grid."
    Options: ClassVar[type[EnvOptions]] = SudokuOptions
    success_metric: ClassVar[str] = "success"
    reward_weights: ClassVar[Mapping[str, float]] = {"success": 1.0, "format": 0.1, "cells": 0.5}
    example_config: ClassVar[str] = "examples/env_sudoku.yaml"

    def generate(self, seed: int) -> Task:
        opts = self.options
        assert isinstance(opts, SudokuOptions)
        rng = random.Random(seed)
        for _ in range(100):
            solution = random_full_grid(rng)
            puzzle = list(solution)
            blanks = 0
            for cell in rng.sample(range(16), 16):
                if blanks == opts.num_blanks:
                    break
                puzzle[cell] = 0
                if count_solutions(puzzle) == 1:
                    blanks += 1
                else:
                    puzzle[cell] = solution[cell]
            if blanks == opts.num_blanks:
                return make_task(puzzle, solution)
        raise ConfigError(f"sudoku: no puzzle with {opts.num_blanks} blanks for seed {seed}")

    def split_key(self, task: Task) -> str:
        """The answer grid (the id for a hand-made puzzle with more than one)."""
        solution = solution_of(task)
        return task.id if solution is None else "sudoku-grid:" + "".join(map(str, solution))

    def make(self, task: Task) -> Env:
        return SudokuEnv(task, puzzle_of(task))

    def random_action(self, task: Task, messages: list[Message], rng: random.Random) -> str:
        """The givens kept, each blank a uniform random digit: the answer's format, not the logic
        (candidate fills would solve half the puzzles: see the module docstring)."""
        grid = [digit or rng.randint(1, 4) for digit in puzzle_of(task)]
        return f"<answer>\n{render(grid)}\n</answer>"

    def scripted_action(self, task: Task, messages: list[Message]) -> str:
        """The stored solution (generated puzzles keep it in `fields["solution"]`)."""
        return f"<answer>\n{render([int(ch) for ch in task.fields['solution']])}\n</answer>"


def puzzle_of(task: Task) -> Grid:
    """The task's puzzle as 16 cells, 0 for a blank."""
    return [0 if ch == "." else int(ch) for ch in task.fields["puzzle"]]


def make_task(puzzle: Grid, solution: Grid | None = None) -> Task:
    """The task for one puzzle; its id is the puzzle row-major with '.' for blanks."""
    flat = render(puzzle).replace("\n", "")
    system = (
        "Solve the 4x4 Sudoku: each row, column and 2x2 box must contain 1, 2, 3, 4 once. "
        "'.' is a blank. Give the full grid, 4 lines of 4 digits, inside <answer></answer>."
    )
    messages = (
        {"role": "system", "content": system},
        {"role": "user", "content": f"Puzzle:\n{render(puzzle)}"},
    )
    fields = {"puzzle": flat}
    if solution is not None:
        fields["solution"] = "".join(map(str, solution))
    return Task(id=f"sudoku:{flat}", messages=messages, fields=fields)


def solution_of(task: Task) -> Grid | None:
    """The stored solution (generated puzzles), else the puzzle's unique one; None if ambiguous."""
    stored = task.fields.get("solution")
    return [int(ch) for ch in stored] if stored else unique_solution(puzzle_of(task))


class SudokuEnv(AnswerWithFeedbackEnv):
    """One Sudoku episode: answer, get feedback on a wrong grid, answer again. Each turn's rewards
    are the base class's `success` and `format`, plus `cells` as the change in the blank share
    since the previous answer (see the module docstring)."""

    def __init__(self, task: Task, puzzle: Grid) -> None:
        self.task, self.puzzle = task, puzzle
        self.solution = solution_of(task)
        self.share = 0.0  # the blank share of the last answer (0 before any)
        super().__init__()

    def step(self, assistant_text: str) -> EnvStep:
        result = super().step(assistant_text)
        share = self.answer_share(assistant_text, solved=result.rewards["success"] == 1.0)
        delta, self.share = share - self.share, share
        return replace(result, rewards={**result.rewards, "cells": delta})

    def answer_share(self, assistant_text: str, solved: bool) -> float:
        """This answer's `cells` value: the share of blanks right, 0 for a malformed answer."""
        answer = extract_tagged(assistant_text, "answer")
        grid = parse_grid(answer) if answer is not None else None
        if grid is None:
            return 0.0
        if self.solution is None:  # an ambiguous hand-made puzzle: any valid grid is right
            return 1.0 if solved else 0.0
        return blank_share(grid, self.puzzle, self.solution)

    def check(self, assistant_text: str) -> tuple[bool, bool, str]:
        """(parsed, solved, feedback) for one answer."""
        answer = extract_tagged(assistant_text, "answer")
        if answer is None:
            return False, False, "Put the full grid inside <answer></answer>, 4 lines of 4 digits."
        grid = parse_grid(answer)
        if grid is None:
            cleaned = _SEPARATORS.sub("", answer)
            if "." in cleaned:
                return False, False, "Your grid still has blanks; fill every '.' with a digit."
            found = sum(ch.isdigit() for ch in cleaned)
            return False, False, f"Wrong shape: give 4 lines of 4 digits (found {found} digits)."
        problems = grid_problems(grid, self.puzzle)
        return True, not problems, " ".join(problems[:2])
