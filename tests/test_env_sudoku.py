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
    render,
    unique_solution,
)
from rlvr.errors import ConfigError
from rlvr.verifiers.builtin import extract_tagged

SOLUTION = "1234341221434321"
PUZZLE = "1.3.3..22.4...21"  # 8 blanks, unique
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
    assert step.rewards == {"success": 1.0, "format": 1.0, "cells": 1.0}
    assert step.done and not step.messages
    with pytest.raises(RuntimeError):
        env.step(GRID_ANSWER)


@pytest.mark.parametrize(
    ("answer", "fmt", "share", "feedback"),
    [
        ("<answer>2134341221434321</answer>", 1.0, 0.0, "Row 1, column 1 is given as 1, not 2."),
        (
            "<answer>1234341221433421</answer>",  # 6 of 8 blanks right, givens kept
            1.0,
            0.75,
            "Column 1 has 3 twice. Column 2 has 4 twice.",
        ),
        ("<answer>1234\n3412\n2143</answer>", 0.0, 0.0, "found 12 digits"),
        ("<answer>1.3.\n3..2\n2.4.\n..21</answer>", 0.0, 0.0, "still has blanks"),
        ("1234\n3412\n2143\n4321", 0.0, 0.0, "inside <answer></answer>"),
    ],
)
def test_wrong_answers_get_feedback(answer: str, fmt: float, share: float, feedback: str) -> None:
    step = make_env().step(answer)
    assert step.rewards == {"success": 0.0, "format": fmt, "cells": share}
    assert not step.done
    [message] = step.messages
    assert message["role"] == "user"
    assert feedback in message["content"] and message["content"].endswith("Try again.")


def test_retry_after_feedback_pays_format_once() -> None:
    env = make_env()
    first = env.step("<answer>1234341221433421</answer>")
    second = env.step(GRID_ANSWER)
    # The first grid keeps every given and gets 6 of the 8 blanks right (cells 0.75); the second
    # is the solution, whose `cells` is paid as the rest: 0.25, so the episode's sum is 1.0.
    assert (first.rewards, first.done) == ({"success": 0.0, "format": 1.0, "cells": 0.75}, False)
    assert (second.rewards, second.done) == ({"success": 1.0, "format": 0.0, "cells": 0.25}, True)


@pytest.mark.parametrize(
    ("options", "name"),
    [({"num_blanks": 3}, "num_blanks"), ({"num_blanks": 11}, "num_blanks"), ({"size": 9}, "size")],
)
def test_bad_options_raise_config_error(options: dict[str, object], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        SudokuFamily(options)


# ------------------------------------------------------------------------------- the `cells` part
# A hand-worked puzzle: the solution with its diagonal blanked, k = 4 blanks whose answers are
# 1 (row 1), 4 (row 2), 4 (row 3), 1 (row 4).
DIAGONAL = ".234\n3.12\n21.3\n432."
WEIGHTS = SudokuFamily.reward_weights


def diagonal_env() -> SudokuEnv:
    env = SudokuFamily().make(make_task(cells(DIAGONAL.replace("\n", "")), cells(SOLUTION)))
    assert isinstance(env, SudokuEnv)
    env.reset()
    return env


def fill(digits: str, puzzle: str = DIAGONAL) -> str:
    """The puzzle's blanks filled in order with `digits`, as a tagged 4-line answer."""
    it = iter(digits)
    return "<answer>\n" + "".join(next(it) if ch == "." else ch for ch in puzzle) + "\n</answer>"


def total(rewards: dict[str, float]) -> float:
    return sum(WEIGHTS.get(name, 1.0) * value for name, value in rewards.items())


def test_the_family_declares_the_cells_weight_below_success() -> None:
    assert dict(WEIGHTS) == {"success": 1.0, "format": 0.1, "cells": 0.5}


@pytest.mark.parametrize(
    ("blanks", "share"),
    [
        ("2332", 0.0),  # every blank wrong (1 4 4 1 is the answer)
        ("1332", 0.25),
        ("2432", 0.25),
        ("1432", 0.5),
        ("1442", 0.75),
        ("2441", 0.75),
        ("1441", 1.0),  # the solution
    ],
)
def test_cells_is_the_share_of_blanks_right(blanks: str, share: float) -> None:
    step = diagonal_env().step(fill(blanks))
    assert step.rewards == {"success": float(share == 1.0), "format": 1.0, "cells": share}
    assert step.done == (share == 1.0)
    expected = 1.0 * (share == 1.0) + 0.1 + 0.5 * share
    assert total(step.rewards) == pytest.approx(expected)


@pytest.mark.parametrize(
    "answer",
    [
        "<answer>\n1134\n3412\n2143\n4321\n</answer>",  # given 2 -> 1, every blank right
        "<answer>\n1234\n3412\n2143\n4311\n</answer>",  # given 2 -> 1 in row 4, blanks right
    ],
)
def test_a_changed_given_earns_no_cells(answer: str) -> None:
    step = diagonal_env().step(answer)
    assert step.rewards == {"success": 0.0, "format": 1.0, "cells": 0.0}


@pytest.mark.parametrize(
    "answer",
    [
        f"<answer>{DIAGONAL}</answer>",  # the puzzle copied: blanks are not digits
        "<answer>\n1234\n3412\n2143\n</answer>",  # 12 digits
        "1234\n3412\n2143\n4321",  # no tag
        "",
        "<answer></answer>",
    ],
)
def test_a_malformed_answer_earns_neither_cells_nor_format(answer: str) -> None:
    assert diagonal_env().step(answer).rewards == {"success": 0.0, "format": 0.0, "cells": 0.0}


def test_copying_the_puzzle_with_zeros_earns_no_cells() -> None:
    step = diagonal_env().step(f"<answer>{DIAGONAL.replace('.', '0')}</answer>")
    assert step.rewards == {"success": 0.0, "format": 1.0, "cells": 0.0}  # well formed, no digit


def test_a_constant_fill_earns_only_the_blanks_whose_answer_it_is() -> None:
    """The floor that luck buys (module docstring): the digit 1 is the answer of 2 of 4 blanks."""
    shares = {d: diagonal_env().step(fill(d * 4)).rewards["cells"] for d in "1234"}
    assert shares == {"1": 0.5, "2": 0.0, "3": 0.0, "4": 0.5}


def test_the_solution_out_earns_every_other_answer() -> None:
    """Every fill of the 4 blanks with 1-4 (256), each also with a given changed: the solution's
    total (1.6) beats the best other (3 of 4 blanks right: 0.1 + 0.5 * 0.75) by more than 1."""
    import itertools

    totals = {}
    for digits in map("".join, itertools.product("1234", repeat=4)):
        answer = fill(digits)
        lines = answer.split("\n")  # "<answer>", 4 rows, "</answer>"
        changed = "\n".join([*lines[:2], "4" + lines[2][1:], *lines[3:]])  # row 2's given 3 -> 4
        totals[digits] = total(diagonal_env().step(answer).rewards)
        totals[digits + " changed"] = total(diagonal_env().step(changed).rewards)
    solved = totals.pop("1441")
    assert solved == pytest.approx(1.6)
    assert max(totals.values()) == pytest.approx(0.1 + 0.5 * 0.75)
    assert totals["1441 changed"] == pytest.approx(0.1)
    assert solved > max(totals.values()) + 1.0


def test_cells_sums_to_the_final_answers_share_over_an_episode() -> None:
    """Paid as the change from the previous answer: a partial answer, then the solution, earns
    the same in all as the solution at once; a partial then a worse answer earns the worse one."""
    at_once = diagonal_env().step(fill("1441")).rewards
    env = diagonal_env()
    first, second = env.step(fill("1442")), env.step(fill("1441"))
    assert first.rewards["cells"] == 0.75 and second.rewards["cells"] == pytest.approx(0.25)
    both = {k: first.rewards[k] + second.rewards[k] for k in first.rewards}
    assert both == pytest.approx(at_once) and total(both) == pytest.approx(1.6)
    env = diagonal_env()
    first, second = env.step(fill("1442")), env.step("<answer>no idea</answer>")
    assert first.rewards["cells"] + second.rewards["cells"] == 0.0  # malformed last: nothing
    env = diagonal_env()
    first, second = env.step(fill("1442")), env.step(fill("1332"))
    assert first.rewards["cells"] + second.rewards["cells"] == pytest.approx(0.25)
    assert total(first.rewards) + total(second.rewards) < 0.6


def test_cells_without_a_stored_solution_uses_the_unique_one() -> None:
    env = SudokuFamily().make(make_task(cells(PUZZLE)))  # no fields["solution"]
    assert isinstance(env, SudokuEnv) and env.solution == cells(SOLUTION)
    assert env.step("<answer>1234341221433421</answer>").rewards["cells"] == 0.75
    assert unique_solution(cells(PUZZLE)) == cells(SOLUTION)
    assert unique_solution([0] * 16) is None  # 288 completions
    assert unique_solution(cells("11" + "." * 14)) is None  # givens clash
    # An ambiguous hand-made puzzle: `cells` is 1 for any valid grid, 0 for anything else.
    open_env = SudokuFamily().make(make_task([0] * 16))
    assert open_env.step(GRID_ANSWER).rewards == {"success": 1.0, "format": 1.0, "cells": 1.0}
    open_env = SudokuFamily().make(make_task([0] * 16))
    assert open_env.step("<answer>1111222233334444</answer>").rewards["cells"] == 0.0


def test_the_red_team_kit_and_sudoku_farming_probes_pay_no_cells() -> None:
    """rlvr check-reward's kit (verifiers/redteam.py) probes rubric functions, not env parts; the
    `cells` part run as one, on generated puzzles with their solution as the reference answer,
    pays the reference and no hack. The kit's wrong answers are malformed grids for Sudoku, so
    Sudoku's own probes follow: well-formed grids that keep the form and dodge the logic."""
    import dataclasses

    from rlvr.verifiers import RewardFunction
    from rlvr.verifiers.redteam import red_team

    def sudoku_cells(completion: str, puzzle: str, solution: str) -> float:
        env = SudokuEnv(make_task(cells(puzzle), cells(solution)), cells(puzzle))
        return env.step(completion).rewards["cells"]

    family = SudokuFamily()
    tasks = [family.generate(seed) for seed in range(12)]
    tasks = [
        dataclasses.replace(t, fields={**t.fields, "answer": render(cells(t.fields["solution"]))})
        for t in tasks
    ]
    reward = RewardFunction("sudoku_cells", sudoku_cells)
    report = red_team(reward, tasks)
    assert report.ok and report.reference_paid == len(tasks), report.paid_hacks
    for task in tasks:
        puzzle, solution = task.fields["puzzle"], task.fields["solution"]
        changed = list(solution)  # every blank right but one given changed
        given = next(i for i, ch in enumerate(puzzle) if ch != ".")
        changed[given] = str(int(changed[given]) % 4 + 1)
        probes = [
            f"<answer>{render(cells(puzzle))}</answer>",  # the puzzle copied
            f"<answer>{puzzle.replace('.', '0')}</answer>",  # ... with 0 for blanks
            f"<answer>{''.join(changed)}</answer>",
            f"<think>{solution}</think><answer>{puzzle.replace('.', '0')}</answer>",
            f"<answer>{solution}</answer>\n<answer>{puzzle}</answer>",  # right first, copy last
        ]
        for probe in probes:
            assert sudoku_cells(probe, puzzle, solution) == 0.0, probe


# ------------------------------------------------------------------------- demonstrations (demos)
def test_random_action_keeps_givens_and_fills_blanks_with_random_digits() -> None:
    import random

    family = SudokuFamily()
    solved_count = 0
    blank_digits: set[int] = set()
    for seed in range(40):
        task = family.generate(seed)
        puzzle = cells(task.fields["puzzle"])
        text = family.random_action(task, [], random.Random(seed))
        assert text == family.random_action(task, [], random.Random(seed))  # seeded
        answer = extract_tagged(text, "answer")
        assert answer is not None
        grid = parse_grid(answer)
        assert grid is not None and len(answer.splitlines()) == 4
        assert all(p in (0, g) for p, g in zip(puzzle, grid, strict=True))  # givens kept
        blank_digits |= {g for p, g in zip(puzzle, grid, strict=True) if p == 0}
        step = family.make(task).step(text)
        assert step.info["parsed"] and step.rewards["format"] == 1.0
        solved = grid == cells(task.fields["solution"])
        assert step.rewards["success"] == float(solved)
        solved_count += solved
    # Blind: every digit shows up in the blanks, and a 6-blank fill is the solution with 4^-6.
    assert blank_digits == {1, 2, 3, 4}
    assert solved_count <= 2
    # The choices come from the rng: other generators give other grids (on some puzzle).
    tasks = [family.generate(seed) for seed in range(40)]
    assert any(
        family.random_action(t, [], random.Random(1))
        != family.random_action(t, [], random.Random(2))
        for t in tasks
    )


def test_the_sudoku_example_curriculum_builds() -> None:
    """examples/env_sudoku.yaml: 4-blank train puzzles first, 6-blank held-out puzzles (its final
    level) from the start; the `cells` part is a reward component of the run."""
    from pathlib import Path

    from rlvr.config import load_config
    from rlvr.train.curriculum import Curriculum
    from rlvr.train.sources import Sources

    path = Path(__file__).resolve().parent.parent / "examples" / "env_sudoku.yaml"
    cfg = load_config(path, ["task.env.num_train=40", "task.env.num_heldout=10"])
    cur = Curriculum(cfg, Sources(cfg, path.parent))
    assert cur.levels == [{"num_blanks": 4}, {"num_blanks": 6}] and cur.metric == "success"
    source = cur.sources.by_name[cur.name]
    assert {t.fields["puzzle"].count(".") for t in source.splits.train} == {4}
    assert {t.fields["puzzle"].count(".") for t in source.splits.heldout} == {6}
    assert source.scoring.env_weights == {"success": 1.0, "format": 0.1, "cells": 0.5}
    assert load_config(path, ["curriculum={}"]).curriculum.levels == []
