"""The calculator tool-use env (rlvr.envs.calculator): the parser, the tool, generation, the verifier."""

from __future__ import annotations

import json
import re
from fractions import Fraction

import pytest

from rlvr.envs.calculator import (
    CalculatorEnv,
    CalculatorFamily,
    calculator,
    evaluate_arithmetic,
)
from rlvr.errors import ConfigError


def call(expression: str) -> str:
    payload = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>\n{json.dumps(payload)}\n</tool_call>"


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("12 * 14", Fraction(168)),
        ("(12 + 7) * 3", Fraction(57)),
        ("47 * 83 - 259", Fraction(3642)),
        ("7 / 2", Fraction(7, 2)),
        ("-3 + 5", Fraction(2)),
        ("12 × 3 ÷ 4", Fraction(9)),
        ("0.5 * 4", Fraction(2)),
    ],
)
def test_evaluate_arithmetic_is_exact(expression: str, value: Fraction) -> None:
    assert evaluate_arithmetic(expression) == value


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os')", "only numbers"),
        ("abs(-3)", "only numbers"),
        ("2 ** 10", "not supported"),
        ("7 // 2", "not supported"),
        ("1 / 0", "division by zero"),
        ("1 +", "cannot parse"),
        ("9" * 30 + " * " + "9" * 30, "too large"),
        ("1+" * 150 + "1", "longer than"),
        ("x", "only numbers"),
    ],
)
def test_evaluate_arithmetic_rejects_everything_else(expression: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        evaluate_arithmetic(expression)


def test_the_tool_returns_integers_plainly_and_fractions_as_decimals() -> None:
    assert calculator("12 * 14") == "168"
    assert calculator("1 / 3") == "0.333333"


@pytest.mark.parametrize("ops", [1, 2, 3])
def test_generated_problems_have_positive_integer_answers_from_their_numbers(ops: int) -> None:
    family = CalculatorFamily({"num_operations": ops})
    for seed in range(60):
        task = family.generate(seed)
        question = task.messages[-1]["content"]
        numbers = [int(n) for n in re.findall(r"\d+", question)]
        answer = task.fields["answer"]
        assert isinstance(answer, int) and answer > 0
        # Every operand the answer needs is written in the question (nothing hidden).
        assert numbers and max(numbers) <= 999
        assert task.id == f"calculator:{question}"


def test_the_demonstration_is_a_worked_tool_call_exchange() -> None:
    shown = CalculatorFamily({"num_operations": 2}).generate(0).messages
    assert [m["role"] for m in shown] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
    ]
    assert shown[3]["content"] == calculator("12 * 14")
    bare = CalculatorFamily({"demonstration": False}).generate(0).messages
    assert [m["role"] for m in bare] == ["system", "user"]


def _env(answer: int = 168) -> CalculatorEnv:
    task = CalculatorFamily({"num_operations": 1}).generate(0)
    question = {"role": "user", "content": "A crate holds 12 bottles. How many in 14 crates?"}
    return CalculatorEnv(type(task)(task.id, (*task.messages[:-1], question), {"answer": answer}))


def test_a_tool_call_then_the_right_answer_succeeds_and_counts_the_call() -> None:
    env = _env()
    opening = env.reset()
    assert opening.tools[0]["function"]["name"] == "calculator"
    step = env.step(call("12 * 14"))
    assert not step.done and step.messages == [
        {"role": "tool", "name": "calculator", "content": "168"}
    ]
    assert step.info["tool_calls"] == 1 and step.info["tool_failures"] == 0
    final = env.step("<answer>168</answer>")
    assert final.done and final.rewards == {"success": 1.0, "format": 1.0, "used_tool": 1.0}


@pytest.mark.parametrize(
    ("reply", "success", "fmt"),
    [
        ("<answer>168</answer>", 1.0, 1.0),
        ("The answer is 168.", 1.0, 0.0),  # untagged: the last number is read, no format credit
        ("<answer>167</answer>", 0.0, 1.0),
        ("<answer>168.0</answer>", 1.0, 1.0),
        ("I do not know.", 0.0, 0.0),
        ("<answer>168</answer> or maybe 3", 1.0, 1.0),  # the tag wins over trailing numbers
    ],
)
def test_the_verifier_on_known_answers(reply: str, success: float, fmt: float) -> None:
    step = _env().step(reply)
    assert step.done
    assert step.rewards["success"] == success and step.rewards["format"] == fmt
    assert step.rewards["used_tool"] == 0.0


@pytest.mark.parametrize(
    ("expression", "counts"),
    [
        ("12 * 14", True),
        ("(14 * 12)", True),
        ("12 + 14", True),  # a wrong operation still computes with the question: success decides
        ("12 * (14 - 12)", True),
        ("(12 + 1) * 14", True),
        ("18", False),  # the collapse seen in training: one bare number, its result answered
        ("168", False),
        ("12", False),
        ("12 * 3", False),  # one of the question's numbers
        ("99 * 98", False),  # none of them
        ("12 14", False),  # no operator: not an arithmetic expression (and it fails to parse)
    ],
)
def test_used_tool_counts_only_calls_computing_with_the_question(
    expression: str, counts: bool
) -> None:
    env = _env()
    env.step(call(expression))
    assert env.step("<answer>168</answer>").rewards["used_tool"] == float(counts)


def test_used_tool_counts_the_question_numbers_over_several_calls() -> None:
    env = _env()
    env.step(call("12 * 3"))  # 14 not used yet
    env.step(call("36 + 14"))
    assert env.step("<answer>168</answer>").rewards["used_tool"] == 1.0
    # two of three numbers (the 2-operation collapse): no shaping credit
    task = CalculatorFamily({"num_operations": 2}).generate(0)
    numbers = re.findall(r"\d+", str(task.messages[-1]["content"]))
    assert len(set(numbers)) == 3, task.messages[-1]
    env = CalculatorEnv(task)
    env.step(call(f"{numbers[0]} * {numbers[1]}"))
    assert env.step("<answer>1</answer>").rewards["used_tool"] == 0.0


def test_a_failed_call_does_not_count_as_using_the_tool() -> None:
    env = _env()
    step = env.step(call("12 ** 14"))
    assert step.info["tool_failures"] == 1 and step.messages[0]["content"].startswith("Error:")
    assert env.step("<answer>168</answer>").rewards["used_tool"] == 0.0


def test_options_are_validated() -> None:
    with pytest.raises(ConfigError, match="num_operations"):
        CalculatorFamily({"num_operations": 4})
    with pytest.raises(ConfigError, match="max_operand"):
        CalculatorFamily({"max_operand": 5})
