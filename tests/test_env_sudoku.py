"""Sudoku 4x4 env: the solver, generated puzzles, the grid parser and the episode loop."""

from __future__ import annotations

import json

import pytest

from rlvr.envs.base import split_instances
from rlvr.envs.sudoku import (
    SudokuEnv,
    SudokuFamily,
    count_solutions,
    grid_problems,
    make_task,
    parse_grid,
    random_full_grid,
)
from rlvr.errors import ConfigError

SOLUTION = "1234341221434321"
PUZZLE = "1.3.3..22.4...21"  # 7 blanks, unique
GRID_ANSWER = "<answer>\n1234\n3412\n2143\n4321\n</answer>"


def cells(text: str) -> list[int]:
    return [0 if ch == "." else int(ch) for ch in text]


def is_valid(grid: list[int]) -> bool:
    units = [[r * 4 + c for c in range(4)] for r in range(4)]
    units += [[r * 4 + c for r in range(4)] for c in range(4)]
    units += [
        [(br + r) * 4 + bc + c for r in (0, 1) for c in (0, 1)] for br in (0, 2) for bc in (0, 2)
    ]
    return all(sorted(grid[i] for i in unit) == [1, 2, 3, 4] for unit in units)


def test_solver_counts_solutions() -> None:
    assert count_solutions(cells(SOLUTION)) == 1
    assert count_solutions(cells(PUZZLE)) == 1
    assert count_solutions([0] * 16, limit=2) == 2
    assert count_solutions([0] * 16, limit=1000) == 288  # all 4x4 Sudoku grids
    assert count_solutions(cells("11" + "." * 14)) == 0


def test_random_full_grids_are_valid_and_varied() -> None:
    import random

    grids = {tuple(random_full_grid(random.Random(seed))) for seed in range(300)}
    assert all(is_valid(list(g)) for g in grids)
    assert len(grids) > 100


@pytest.mark.parametrize("num_blanks", [4, 6, 10])
def test_generated_puzzles_are_unique(num_blanks: int) -> None:
    family = SudokuFamily({"num_blanks": num_blanks})
    for seed in range(50):
        task = family.generate(seed)
        assert task == family.generate(seed)
        json.dumps(dict(task.fields))
        puzzle, solution = cells(task.fields["puzzle"]), cells(task.fields["solution"])
        assert puzzle.count(0) == num_blanks
        assert count_solutions(list(puzzle)) == 1
        assert is_valid(solution)
        assert all(p in (0, s) for p, s in zip(puzzle, solution, strict=True))
        assert task.id == f"sudoku:{task.fields['puzzle']}"
        assert task.messages[1]["content"].splitlines()[1:] == [
            task.fields["puzzle"][r * 4 : r * 4 + 4] for r in range(4)
        ]


def test_ids_are_distinct_and_splits_disjoint() -> None:
    family = SudokuFamily()
    ids = [family.generate(seed).id for seed in range(200)]
    assert len(set(ids)) > 190
    train, heldout = split_instances(family.generate, 200, 20)
    assert len(train) == 200 and len(heldout) == 20
    assert not {t.id for t in train} & {t.id for t in heldout}


@pytest.mark.parametrize(
    "text",
    [
        "1234\n3412\n2143\n4321",
        "1 2 3 4\n3 4 1 2\n2 1 4 3\n4 3 2 1",
        "1,2,3,4, 3,4,1,2, 2,1,4,3, 4,3,2,1",
        "1234341221434321",
        "|1 2|3 4|\n|3 4|1 2|\n+---+---+\n|2 1|4 3|\n|4 3|2 1|",
    ],
)
def test_parse_grid_accepts_layouts(text: str) -> None:
    assert parse_grid(text) == cells(SOLUTION)


@pytest.mark.parametrize(
    "text", ["123\n3412\n2143\n4321", "1.34341221434321", "12343412214343210", "abcd"]
)
def test_parse_grid_rejects_wrong_shape(text: str) -> None:
    assert parse_grid(text) is None


def test_grid_problems_name_the_mistake() -> None:
    puzzle = cells(PUZZLE)
    assert grid_problems(cells(SOLUTION), puzzle) == []
    changed = cells("2134341221434321")  # a given 1 replaced; columns repeat too
    assert grid_problems(changed, puzzle)[0] == "Row 1, column 1 is given as 1, not 2."
    swapped = cells("1234341221434312")  # row 4 keeps its givens but repeats nothing; columns do
    problems = grid_problems(swapped, cells("1234341221434..."))
    assert (
        "Column 3 has 1 twice." in problems and "The bottom-right box has 1 twice." not in problems
    )
    assert "Row 4 has 4 twice." in grid_problems(cells("1234341221434324"), [0] * 16)
    assert "The top-left box has 1 twice." in grid_problems(cells("1234312424134321"), [0] * 16)
    assert "Only digits 1-4 are allowed, not 7 (row 1)." in grid_problems(
        cells("7" + SOLUTION[1:]), [0] * 16
    )


def make_env() -> SudokuEnv:
    env = SudokuFamily().make(make_task(cells(PUZZLE), cells(SOLUTION)))
    assert isinstance(env, SudokuEnv) and env.max_turns == 2
    return env


def test_correct_grid_ends_the_episode() -> None:
    env = make_env()
    reset = env.reset()
    assert reset.messages[1]["content"] == "Puzzle:\n1.3.\n3..2\n2.4.\n..21"
    assert "<answer></answer>" in reset.messages[0]["content"]
    step = env.step("Let me fill it in. " + GRID_ANSWER)
    assert step.rewards == {"success": 1.0, "format": 1.0} and step.done and not step.messages
    with pytest.raises(RuntimeError):
        env.step(GRID_ANSWER)


@pytest.mark.parametrize(
    ("answer", "fmt", "feedback"),
    [
        ("<answer>2134341221434321</answer>", 1.0, "Row 1, column 1 is given as 1, not 2."),
        ("<answer>1234341221433421</answer>", 1.0, "Column 1 has 3 twice. Column 2 has 4 twice."),
        ("<answer>1234\n3412\n2143</answer>", 0.0, "found 12 digits"),
        ("<answer>1.3.\n3..2\n2.4.\n..21</answer>", 0.0, "still has blanks"),
        ("1234\n3412\n2143\n4321", 0.0, "inside <answer></answer>"),
    ],
)
def test_wrong_answers_get_feedback(answer: str, fmt: float, feedback: str) -> None:
    step = make_env().step(answer)
    assert step.rewards == {"success": 0.0, "format": fmt}
    assert not step.done
    [message] = step.messages
    assert message["role"] == "user"
    assert feedback in message["content"] and message["content"].endswith("Try again.")


def test_retry_after_feedback_pays_format_once() -> None:
    env = make_env()
    first = env.step("<answer>1234341221433421</answer>")
    second = env.step(GRID_ANSWER)
    assert (first.rewards, first.done) == ({"success": 0.0, "format": 1.0}, False)
    assert (second.rewards, second.done) == ({"success": 1.0, "format": 0.0}, True)


@pytest.mark.parametrize(
    ("options", "name"),
    [({"num_blanks": 3}, "num_blanks"), ({"num_blanks": 11}, "num_blanks"), ({"size": 9}, "size")],
)
def test_bad_options_raise_config_error(options: dict[str, object], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        SudokuFamily(options)
