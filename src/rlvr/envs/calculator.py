"""Calculator tool use: word problems that need several exact operations, and a calculator tool.

Each problem chains `num_operations` steps over operands too large for mental arithmetic at this
model scale (e.g. 47 * 83 - 259), so the reliable way to the answer is to call the tool, read the
result, and call it again or answer. The policy learns when and how to call the tool; the tool's
output reaches it as an observation and never receives gradient.

Turn protocol (ToolEnv): a turn with a `<tool_call>` runs the calculator and returns its result; a
turn without one is the final answer, checked against the exact value (`<answer>N</answer>`, else the
last number in the turn). Reward parts: `success` (1.0 for the exact answer), `format` (1.0 when the
final answer is in an answer tag; weight 0.1), `used_tool` (1.0 when the calls computed with
the whole question: calls that returned a result, each applying an operator, used between them
every number of the question; weight 0: logged, not optimised, so the policy is paid for answers,
not for calling). Why not any call that returned a result: given a shaping weight (the example
configs' 0.3), SmolLM2 learned within 5 steps to call the calculator on one bare number (`"18"`)
and answer it, and on 2-operation problems to multiply two of the three numbers and answer that;
the looser rule paid both in full (docs/efficacy_notes.md, calculator rows).

Demonstration policy (rlvr.authoring.demos): `random_action` calls the calculator once on an expression
over EVERY number of the question (in a random order, with random operators from + - * and a random
parenthesisation, e.g. `(56 * 35) - 235` or `56 * (35 - 235)`; two numbers and one operator when
the question has two), then answers the tool's result: the call and answer formats and the
protocol, with the expression chosen blindly (a format warm-up). Not one call on two of three
numbers: that demo teaches the habit RL collapsed onto on 2-operation problems (one call, its
result answered; the Echo Trap). As countdown's random expressions, it shows that one expression
can use every number, and still rarely hits the answer (tests/test_env_demos.py). A call on three
numbers is 38-40 SmolLM2 tokens: give it sampling.max_new_tokens 48, or the engine cuts (and the
demos drop) most of them (examples/env_calculator_2op_warmup.yaml). No scripted policy: a task
stores its answer, not the expression.

Split: by computation (`split_key`: the question's numbers and the answer), so two wordings of one
computation, or a product with its factors swapped, never sit on both sides; no instance is the
worked example's 12 * 14, whose answer every prompt shows.
"""

from __future__ import annotations

import ast
import json
import random
import re
from collections.abc import Callable
from fractions import Fraction
from typing import ClassVar

from pydantic import Field

from rlvr.envs.base import EnvFamily, EnvOptions, EnvReset, EnvStep, Message, register_env
from rlvr.envs.tools import Tool, ToolEnv
from rlvr.records import Task
from rlvr.verifiers.builtin import extract_last_number, extract_tagged

_MAX_EXPRESSION_CHARS = 200
_OPERATION = re.compile(r"\d\s*\)*\s*[-+*/×÷]\s*\(*\s*\d")  # an operator between two operands
_MAX_MAGNITUDE = 10**12


def evaluate_arithmetic(expression: str) -> Fraction:
    """The exact value of + - * / ( ) over numbers, by walking the syntax tree: never eval().

    Raises ValueError with a short reason for anything else (names, calls, powers, huge values).
    """
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = walk(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp):
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Add):
                result = left + right
            elif isinstance(node.op, ast.Sub):
                result = left - right
            elif isinstance(node.op, ast.Mult):
                result = left * right
            elif isinstance(node.op, ast.Div):
                if right == 0:
                    raise ValueError("division by zero")
                result = left / right
            else:
                raise ValueError(f"operator {type(node.op).__name__} is not supported")
            if abs(result) > _MAX_MAGNITUDE:
                raise ValueError("value too large")
            return result
        raise ValueError(f"only numbers and + - * / ( ) are allowed, not {type(node).__name__}")

    return walk(tree.body)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Numbers with + - * / and parentheses, e.g. "(12 + 7) * 3".
    """
    value = evaluate_arithmetic(expression)
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"


CALCULATOR = Tool.from_function(calculator)

SYSTEM_PROMPT = (
    "Solve the problem exactly. Do every computation with the calculator tool, one call per turn. "
    "When you know the result, reply with <answer>NUMBER</answer>."
)

# A worked exchange placed before the question (option `demonstration`): a 135M model follows a
# shown conversation far more readily than a described format.
DEMONSTRATION = (
    {"role": "user", "content": "A box has 12 rows of 14 eggs. How many eggs?"},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 14"}}'
        "\n</tool_call>",
    },
    {"role": "tool", "content": "168"},
    {"role": "assistant", "content": "<answer>168</answer>"},
)


def exercise_key(question: str, answer: int) -> str:
    """The computation a question asks for, wording aside: its numbers (sorted) and the answer."""
    numbers = sorted(int(n) for n in re.findall(r"\d+", question))
    return f"calculator:{numbers}={answer}"


_DEMONSTRATED = exercise_key(str(DEMONSTRATION[0]["content"]), 168)

# (template, answer(a, b, c)); a, b two-digit, c three-digit. Each needs len(ops) exact operations.
_Problem = tuple[str, Callable[[int, int, int], int]]
_PROBLEMS: dict[int, list[_Problem]] = {
    1: [
        ("A crate holds {a} bottles. How many bottles are in {b} crates?", lambda a, b, c: a * b),
        ("A farm had {c} sheep and bought {a} more. How many sheep now?", lambda a, b, c: c + a),
        ("A library has {c} books and lends out {b}. How many are left?", lambda a, b, c: c - b),
    ],
    2: [
        (
            "A shop has {a} boxes of {b} pens and sells {c} pens. How many pens are left?",
            lambda a, b, c: a * b - c,
        ),
        (
            "A school orders {a} packs of {b} pencils and already has {c}. How many pencils in all?",
            lambda a, b, c: a * b + c,
        ),
        (
            "A train carries {c} people; at the stop {a} get off and {b} get on. How many now?",
            lambda a, b, c: c - a + b,
        ),
    ],
    3: [
        (
            "A bakery makes {a} trays of {b} rolls, sells {c}, then bakes {a} more rolls. "
            "How many rolls does it have?",
            lambda a, b, c: a * b - c + a,
        ),
        (
            "A hall has {a} rows of {b} seats; {c} are taken and {b} are broken. How many are free?",
            lambda a, b, c: a * b - c - b,
        ),
    ],
}


class CalculatorOptions(EnvOptions):
    num_operations: int = Field(
        2, ge=1, le=3, description="Exact operations each problem needs (1-3)."
    )
    max_operand: int = Field(
        99, ge=12, le=999, description="Largest multiplicand (two-digit by default)."
    )
    demonstration: bool = Field(
        True, description="Open with one worked tool-call exchange before the question."
    )


class CalculatorEnv(ToolEnv):
    max_turns = 4

    def __init__(self, task: Task) -> None:
        super().__init__([CALCULATOR])
        self.task = task
        self.answer = int(task.fields["answer"])
        self.question_numbers = set(re.findall(r"\d+", str(task.messages[-1]["content"])))
        # The question's numbers that the calls which returned a result computed with.
        self.numbers_used: set[str] = set()

    def reset(self) -> EnvReset:
        return EnvReset([dict(m) for m in self.task.messages], self.tool_schemas)

    def step(self, assistant_text: str) -> EnvStep:
        result = super().step(assistant_text)
        # The question's numbers each returned call computed with (an operator applied: a bare
        # number is no computation); used_tool asks for all of them (see the module docstring).
        calls = self.tool_format.parse(assistant_text)
        for call, message in zip(calls, result.messages, strict=False):
            expression = call.arguments.get("expression") if call.error is None else None
            returned = not str(message.get("content", "")).startswith("Error")
            if returned and isinstance(expression, str) and _OPERATION.search(expression):
                self.numbers_used |= self.question_numbers & set(re.findall(r"\d+", expression))
        return result

    def finish(self, assistant_text: str) -> EnvStep:
        tagged = extract_tagged(assistant_text, "answer")
        candidate = extract_last_number(tagged if tagged is not None else assistant_text)
        try:
            correct = candidate is not None and Fraction(candidate) == self.answer
        except (ValueError, ZeroDivisionError):
            correct = False
        rewards = {
            "success": float(correct),
            "format": float(tagged is not None),
            "used_tool": float(
                bool(self.numbers_used) and self.numbers_used == self.question_numbers
            ),
        }
        return EnvStep(rewards=rewards, done=True)


@register_env
class CalculatorFamily(EnvFamily):
    name = "calculator"
    description = "Word problems needing several exact operations, solved with a calculator tool."
    Options = CalculatorOptions
    success_metric = "success"
    reward_weights: ClassVar[dict[str, float]] = {"format": 0.1, "used_tool": 0.0}
    example_config = "examples/env_calculator.yaml"

    def generate(self, seed: int) -> Task:
        options = self.options
        assert isinstance(options, CalculatorOptions)
        rng = random.Random(seed)
        template, solve = rng.choice(_PROBLEMS[options.num_operations])
        answer, question = 0, ""
        # Word problems about counts: keep the answer positive. Never the worked example's
        # computation (12 * 14): every prompt shows its answer.
        while answer <= 0 or exercise_key(question, answer) == _DEMONSTRATED:
            a = rng.randint(12, options.max_operand)
            b = rng.randint(12, options.max_operand)
            c = rng.randint(100, 999)
            answer = solve(a, b, c)
            question = template.format(a=a, b=b, c=c)
        shown = DEMONSTRATION if options.demonstration else ()
        return Task(
            id=f"calculator:{question}",
            messages=(
                {"role": "system", "content": SYSTEM_PROMPT},
                *shown,
                {"role": "user", "content": question},
            ),
            fields={"answer": answer},
        )

    def split_key(self, task: Task) -> str:
        """The question's numbers (sorted) and the answer: two wordings of one computation, or one
        product with its factors swapped, are the same exercise and stay on one side."""
        return exercise_key(str(task.messages[-1]["content"]), int(task.fields["answer"]))

    def make(self, task: Task) -> CalculatorEnv:
        return CalculatorEnv(task)

    def random_action(self, task: Task, messages: list[Message], rng: random.Random) -> str:
        """First turn: one calculator call (Hermes format, as the prompt's demonstration) on a random
        expression over every number of the question: the numbers in a random order, random
        operators from + - *, a random parenthesisation (two numbers: `a op b`). Then the answer
        tag around the tool's last result (a random number of the question when the call failed).

        Why every number: a demo of one call on two of three numbers teaches exactly the collapse
        RL fell into on 2-operation problems (one call, its result answered, zero reward variance).
        An expression over all of them teaches that a call can combine every number, as countdown's
        random expressions do; the choice is blind (it never reads the answer), so it rarely hits
        the answer and stays a format warm-up, not a solver."""
        numbers = re.findall(r"\d+", str(task.messages[-1]["content"]))
        if not any(m.get("role") == "assistant" for m in messages):
            # every question has two or more numbers (a 3-operation one repeats one of them)
            expression = _random_expression(rng.sample(numbers, len(numbers)), rng)
            call = {"name": "calculator", "arguments": {"expression": expression}}
            return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        result = str(messages[-1].get("content", "")).strip() if messages else ""
        if not re.fullmatch(r"-?\d+(\.\d+)?", result):
            result = rng.choice(numbers or ["0"])
        return f"<answer>{result}</answer>"


def _random_expression(numbers: list[str], rng: random.Random) -> str:
    """The numbers in this order, joined by random operators from + - * under a random binary
    bracketing (split point uniform at each level); every compound operand is parenthesised, the
    whole is not: `(56 * 35) - 235`, `56 * (35 - 235)`."""

    def build(part: list[str]) -> tuple[str, bool]:  # (text, compound)
        if len(part) == 1:
            return part[0], False
        # two numbers: no split drawn, so `a op b` takes the same random draws as before
        k = 1 if len(part) == 2 else rng.randint(1, len(part) - 1)
        (left, lc), (right, rc) = build(part[:k]), build(part[k:])
        op = rng.choice("+-*")
        return f"{f'({left})' if lc else left} {op} {f'({right})' if rc else right}", True

    return build(numbers)[0]
