"""Countdown env: the expression parser, the rules, generated instances and the episode loop."""

from __future__ import annotations

import builtins
import itertools
import json
import time
from fractions import Fraction

import pytest

from rlvr.envs.base import split_instances
from rlvr.envs.countdown import (
    CountdownEnv,
    CountdownFamily,
    CountdownOptions,
    ExpressionError,
    make_task,
    number_problem,
    parse_expression,
)
from rlvr.errors import ConfigError


def solvable(numbers: list[int], target: int, use_all: bool) -> bool:
    """Brute force: combine any two values with + - * / until one value is left (or any value hits
    the target when numbers may be left out)."""

    def search(values: tuple[Fraction, ...]) -> bool:
        if (not use_all or len(values) == 1) and Fraction(target) in values:
            return True
        for i, j in itertools.permutations(range(len(values)), 2):
            a, b = values[i], values[j]
            rest = tuple(v for k, v in enumerate(values) if k not in (i, j))
            results = [a + b, a - b, a * b] + ([a / b] if b else [])
            if any(search((*rest, r)) for r in results):
                return True
        return False

    return search(tuple(Fraction(n) for n in numbers))


@pytest.mark.parametrize(
    ("text", "value", "used"),
    [
        ("(3 + 5) * 2", 16, [3, 5, 2]),
        ("7 / 2 * 4", 14, [7, 2, 4]),
        ("((10 - 4)) / 4", Fraction(3, 2), [10, 4, 4]),
        ("(3+5)*2 = 16", 16, [3, 5, 2]),
        ("3 × 4 − 2 ÷ 2", 11, [3, 4, 2, 2]),
        ("  6\n* 7 ", 42, [6, 7]),
    ],
)
def test_parse_valid(text: str, value: Fraction, used: list[int]) -> None:
    assert parse_expression(text) == (value, used)


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",
        "abs(3) + 1",
        "x + 1",
        "(3).real",
        "2 ** 3",
        "9 ** 9 ** 9 ** 9",
        "7 // 2",
        "7 % 2",
        "-3 + 5",
        "+3",
        "3.5 + 1",
        "1_000 + 1",
        "9999999 + 1",
        "1 + " * 60 + "1",
        "3 +",
        "(3 + 5",
        "3 5",
        "(3)(5)",
        "",
        "1 / (2 - 2)",
        "[1, 2]",
    ],
)
def test_parse_rejects_without_evaluating(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*_: object) -> None:
        raise AssertionError("eval/exec must never be used")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    start = time.perf_counter()
    with pytest.raises(ExpressionError):
        parse_expression(text)
    assert time.perf_counter() - start < 0.1


def test_number_rules() -> None:
    assert number_problem([3, 5, 2], [2, 3, 5], use_all=True) is None
    assert number_problem([5, 5, 2], [2, 3, 5], use_all=True) == "You used 5 twice."
    assert number_problem([9, 2], [2, 3, 5], use_all=True) == "9 is not one of the numbers."
    assert number_problem([3, 2], [2, 3, 5], use_all=True) == "You did not use 5."
    assert number_problem([3, 2], [2, 3, 5], use_all=False) is None
    assert (
        number_problem([3, 3, 3], [3, 3], use_all=False) == "You used 3 3 times; it is given twice."
    )


@pytest.mark.parametrize(
    "options",
    [{}, {"num_numbers": 4}, {"num_numbers": 4, "use_all": False, "max_target": 50}],
)
def test_generated_instances_are_solvable(options: dict[str, object]) -> None:
    family = CountdownFamily(options)
    opts = family.options
    assert isinstance(opts, CountdownOptions)
    for seed in range(50):
        task = family.generate(seed)
        assert task == family.generate(seed)  # seeded
        f = task.fields
        json.dumps(dict(f))
        assert len(f["numbers"]) == opts.num_numbers
        assert all(1 <= n <= opts.max_number for n in f["numbers"])
        assert opts.min_target <= f["target"] <= opts.max_target
        assert solvable(f["numbers"], f["target"], f["use_all"])
        value, used = parse_expression(f["solution"])
        assert value == f["target"]
        assert number_problem(used, f["numbers"], f["use_all"]) is None


def test_ids_are_content_keys_and_splits_are_disjoint() -> None:
    family = CountdownFamily({"num_numbers": 4})
    ids = [family.generate(seed).id for seed in range(200)]
    assert len(set(ids)) > 190
    assert make_task([5, 3, 2], 16).id == make_task([2, 3, 5], 16).id
    train, heldout = split_instances(family.generate, 200, 20)
    assert len(train) == 200 and len(heldout) == 20
    assert not {t.id for t in train} & {t.id for t in heldout}


def play(answers: list[str]) -> list[tuple[dict[str, float], bool, str]]:
    env = CountdownFamily().make(make_task([2, 3, 5], 16))
    assert isinstance(env, CountdownEnv) and env.max_turns == 2
    out = []
    for answer in answers:
        step = env.step(answer)
        out.append((step.rewards, step.done, step.messages[0]["content"] if step.messages else ""))
    return out


def test_correct_answer_ends_the_episode() -> None:
    task = make_task([2, 3, 5], 16)
    env = CountdownFamily().make(task)
    assert env.reset().messages == [dict(m) for m in task.messages]
    assert "Target: 16" in env.reset().messages[1]["content"]
    step = env.step("I think so. <answer>(3 + 5) * 2</answer>")
    assert step.rewards == {"success": 1.0, "format": 1.0} and step.done and not step.messages
    with pytest.raises(RuntimeError):
        env.step("<answer>(3 + 5) * 2</answer>")


@pytest.mark.parametrize(
    ("answer", "fmt", "feedback"),
    [
        ("<answer>3 + 5 + 2</answer>", 1.0, "Your expression equals 10, not 16."),
        ("<answer>(5 + 5) + 3</answer>", 1.0, "You used 5 twice."),
        ("<answer>(3 + 5) * 2 * 1</answer>", 1.0, "1 is not one of the numbers."),
        ("<answer>5 / 2 + 3</answer>", 1.0, "Your expression equals 11/2, not 16."),
        ("<answer>(3 + 5) ** 2</answer>", 0.0, "Could not parse"),
        ("<answer>5 / (3 - 3)</answer>", 0.0, "divides by zero"),
        ("(3 + 5) * 2", 0.0, "inside <answer></answer>"),
    ],
)
def test_wrong_answers_get_feedback(answer: str, fmt: float, feedback: str) -> None:
    [(rewards, done, message)] = play([answer])
    assert rewards == {"success": 0.0, "format": fmt}
    assert not done
    assert feedback in message and message.endswith("Try again.")


def test_retry_after_feedback_pays_format_once() -> None:
    (r1, d1, _), (r2, d2, _) = play(["<answer>3 + 5 + 2</answer>", "<answer>2 * (3 + 5)</answer>"])
    assert (r1, d1) == ({"success": 0.0, "format": 1.0}, False)
    assert (r2, d2) == ({"success": 1.0, "format": 0.0}, True)


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"num_numbers": 9}, "num_numbers"),
        ({"max_number": 1}, "max_number"),
        ({"use_all": "perhaps"}, "use_all"),
        ({"target": 5}, "target"),
        ({"min_target": 50, "max_target": 10}, "max_target"),
    ],
)
def test_bad_options_raise_config_error(options: dict[str, object], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        CountdownFamily(options)
