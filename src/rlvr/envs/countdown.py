"""Countdown: reach a target number with the given numbers and + - * /.

The arithmetic game used to study RL from verifiable rewards in TinyZero (Pan et al., 2025) and in
"Cognitive Behaviors that Enable Self-Improving Reasoners" (Gandhi et al., 2025). Rules: write one
expression with + - * / and parentheses that uses each given number exactly once (`use_all`, the
default; otherwise at most once) and equals the target. Division is exact (fractions), so (7 / 2) * 4
equals 14; unary minus, powers, decimals and everything else are not allowed.

Instances are solvable by construction: the target is the value of a random expression tree over the
numbers whose intermediate values are all non-negative integers of bounded size. The answer is read
from the last `<answer>...</answer>` and checked by a small parser that walks the `ast` of the
expression (never `eval`). Reward parts: `success` (the expression is valid, uses the right numbers
and equals the target) and `format` (a parseable expression was given; weight 0.1, like TinyZero's
format score, earned at most once per episode). A wrong answer gets feedback and one more try.

Split: by puzzle (the id: sorted numbers and target; an expression that uses every number names
both, so no two puzzles share a solution). Under `use_all: false` an expression over a subset
solves every puzzle holding that subset and target, so there the key is the target alone.

Demonstration policies (rlvr.authoring.demos): `random_action` answers a random expression that uses
each number once with random operators and grouping (valid, rarely the target: a format warm-up);
`scripted_action` answers the expression the generator built (behaviour cloning).
"""

from __future__ import annotations

import ast
import random
from collections import Counter
from collections.abc import Mapping
from fractions import Fraction
from typing import Any, ClassVar

from pydantic import Field, ValidationInfo, field_validator

from rlvr.envs.base import (
    AnswerWithFeedbackEnv,
    Env,
    EnvFamily,
    EnvOptions,
    Message,
    register_env,
)
from rlvr.errors import ConfigError
from rlvr.records import Task
from rlvr.verifiers.builtin import extract_tagged

MAX_EXPRESSION_CHARS = 200
MAX_CONSTANT = 10**6
_ALLOWED_CHARS = frozenset("0123456789+-*/() ")
_UNICODE_OPS = str.maketrans({"×": "*", "÷": "/", "−": "-", "–": "-"})
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


class ExpressionError(ValueError):
    """The answer is not a valid Countdown expression; the message says why."""


def _walk(node: ast.AST, used: list[int]) -> Fraction:
    """Value of an allowed node, appending every number it uses to `used`. Checks the node type
    before touching its children, so a forbidden operator is rejected without computing anything."""
    if isinstance(node, ast.Constant):
        if type(node.value) is not int:
            raise ExpressionError(f"{node.value!r} is not a whole number")
        if node.value > MAX_CONSTANT:
            raise ExpressionError(f"the number {node.value} is too large")
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp):
        if type(node.op) not in _OPS:
            raise ExpressionError("only + - * / and parentheses are allowed")
        left, right = _walk(node.left, used), _walk(node.right, used)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if right == 0:
            raise ExpressionError("it divides by zero")
        return left / right
    if isinstance(node, ast.UnaryOp):
        raise ExpressionError("signs such as -3 are not allowed")
    raise ExpressionError("only numbers, + - * / and parentheses are allowed")


def parse_expression(text: str) -> tuple[Fraction, list[int]]:
    """(value, numbers used in order) of a Countdown expression; ExpressionError when invalid.

    A trailing "= 24" is ignored. Characters are whitelisted before `ast.parse` and the tree is
    walked node by node: names, calls, attributes, powers and decimals never get evaluated.
    """
    expr = " ".join(text.translate(_UNICODE_OPS).split("=")[0].split())
    if not expr:
        raise ExpressionError("the expression is empty")
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    if not set(expr) <= _ALLOWED_CHARS:
        raise ExpressionError("only numbers, + - * / and parentheses are allowed")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ExpressionError("it is not a valid expression") from None
    used: list[int] = []
    return _walk(tree.body, used), used


def _times(k: int) -> str:
    return {1: "once", 2: "twice"}.get(k, f"{k} times")


def number_problem(used: list[int], numbers: list[int], use_all: bool) -> str | None:
    """What is wrong with the multiset of numbers used, or None when it follows the rules."""
    have, given = Counter(used), Counter(numbers)
    for n, k in have.items():
        if given[n] == 0:
            return f"{n} is not one of the numbers."
        if k > given[n]:
            extra = "" if given[n] == 1 else f"; it is given {_times(given[n])}"
            return f"You used {n} {_times(k)}{extra}."
    missing = sorted((given - have).elements())
    if use_all and missing:
        return f"You did not use {', '.join(map(str, missing))}."
    return None


class CountdownOptions(EnvOptions):
    num_numbers: int = Field(3, ge=2, le=6, description="How many numbers each puzzle gives.")
    max_number: int = Field(
        25, ge=2, le=1000, description="The numbers are drawn uniformly from 1..max_number."
    )
    min_target: int = Field(1, ge=0, le=100_000, description="Smallest allowed target.")
    max_target: int = Field(100, ge=1, le=100_000, description="Largest allowed target.")
    use_all: bool = Field(
        True, description="Each number must be used exactly once (False: at most once)."
    )

    @field_validator("max_target")
    @classmethod
    def _check_range(cls, value: int, info: ValidationInfo) -> int:
        if value < info.data.get("min_target", 0):
            raise ValueError("max_target must be at least min_target")
        return value


def _random_target(rng: random.Random, numbers: list[int], cap: int) -> tuple[int, str] | None:
    """Combine the numbers by a random tree of + - * /; None when an intermediate value is not a
    non-negative integer <= cap. Returns (value, expression)."""
    items: list[tuple[int, str]] = [(n, str(n)) for n in numbers]
    while len(items) > 1:
        (a, ea), (b, eb) = (
            items.pop(rng.randrange(len(items))),
            items.pop(rng.randrange(len(items))),
        )
        op = rng.choice("+-*/")
        if op == "+":
            value = a + b
        elif op == "-":
            value = a - b
        elif op == "*":
            value = a * b
        elif b == 0 or a % b:
            return None
        else:
            value = a // b
        if not 0 <= value <= cap:
            return None
        items.append((value, f"({ea} {op} {eb})"))
    value, expr = items[0]
    return value, expr[1:-1] if expr.startswith("(") else expr


@register_env
class CountdownFamily(EnvFamily):
    name: ClassVar[str] = "countdown"
    description: ClassVar[str] = "Reach a target with the given numbers and + - * / (TinyZero)."
    Options: ClassVar[type[EnvOptions]] = CountdownOptions
    success_metric: ClassVar[str] = "success"
    reward_weights: ClassVar[Mapping[str, float]] = {"success": 1.0, "format": 0.1}
    example_config: ClassVar[str] = "examples/env_countdown.yaml"

    def generate(self, seed: int) -> Task:
        opts = self.options
        assert isinstance(opts, CountdownOptions)
        rng = random.Random(seed)
        cap = max(1000, opts.max_target)
        for _ in range(2000):
            numbers = sorted(rng.randint(1, opts.max_number) for _ in range(opts.num_numbers))
            pool = numbers if opts.use_all else rng.sample(numbers, rng.randint(2, len(numbers)))
            made = _random_target(rng, pool, cap)
            if made is None or shows_answer(numbers, made[0], opts.use_all):
                continue
            if opts.min_target <= made[0] <= opts.max_target:
                return make_task(numbers, made[0], opts.use_all, solution=made[1])
        raise ConfigError(
            f"countdown: no target in {opts.min_target}..{opts.max_target} found for seed {seed}; "
            "widen task.env.options.min_target / max_target or change max_number"
        )

    def split_key(self, task: Task) -> str:
        """The id; the target alone when not every number must be used (see the docstring)."""
        f = task.fields
        return task.id if f["use_all"] else f"countdown-target:{f['target']}"

    def make(self, task: Task) -> Env:
        f = task.fields
        return CountdownEnv(task, list(f["numbers"]), int(f["target"]), bool(f["use_all"]))

    def random_action(self, task: Task, messages: list[Message], rng: random.Random) -> str:
        """Every number once, in a random order, joined by random operators in a random tree; a
        tree that divides by zero is redrawn (after 20 tries, a sum)."""
        numbers = [str(n) for n in task.fields["numbers"]]
        for _ in range(20):
            items = rng.sample(numbers, len(numbers))
            while len(items) > 1:
                left = items.pop(rng.randrange(len(items)))
                right = items.pop(rng.randrange(len(items)))
                items.append(f"({left} {rng.choice('+-*/')} {right})")
            expression = items[0][1:-1] if len(numbers) > 1 else items[0]
            try:
                parse_expression(expression)
            except ExpressionError:
                continue
            return f"<answer>{expression}</answer>"
        return f"<answer>{' + '.join(numbers)}</answer>"

    def scripted_action(self, task: Task, messages: list[Message]) -> str:
        """The generator's own expression (`fields["solution"]`)."""
        return f"<answer>{task.fields['solution']}</answer>"


def shows_answer(numbers: list[int], target: int, use_all: bool) -> bool:
    """Whether the system prompt's example expression, "(3 + 5) * 2", solves this puzzle (every
    prompt would show its answer; such puzzles are never generated)."""
    return target == 16 and number_problem([3, 5, 2], numbers, use_all) is None


def make_task(numbers: list[int], target: int, use_all: bool = True, solution: str = "") -> Task:
    """The task for one puzzle; its id is the sorted numbers, the target and the rule."""
    numbers = sorted(numbers)
    rule = "exactly once" if use_all else "at most once"
    system = (
        "Make the target number from the given numbers using + - * / and parentheses. "
        f"Use each number {rule}. Give only the expression in <answer></answer>, "
        "e.g. <answer>(3 + 5) * 2</answer>."
    )
    user = f"Numbers: {', '.join(map(str, numbers))}\nTarget: {target}"
    key = f"countdown:{','.join(map(str, numbers))}={target}{'' if use_all else ':any'}"
    fields: dict[str, Any] = {"numbers": numbers, "target": target, "use_all": use_all}
    if solution:
        fields["solution"] = solution
    messages = ({"role": "system", "content": system}, {"role": "user", "content": user})
    return Task(id=key, messages=messages, fields=fields)


class CountdownEnv(AnswerWithFeedbackEnv):
    """One Countdown episode: answer, get feedback on a wrong answer, answer again."""

    def __init__(self, task: Task, numbers: list[int], target: int, use_all: bool) -> None:
        self.task, self.numbers, self.target, self.use_all = task, numbers, target, use_all
        super().__init__()

    def check(self, assistant_text: str) -> tuple[bool, bool, str]:
        """(parsed, solved, feedback) for one answer."""
        answer = extract_tagged(assistant_text, "answer")
        if answer is None:
            return False, False, "Put your expression inside <answer></answer>."
        try:
            value, used = parse_expression(answer)
        except ExpressionError as err:
            return False, False, f"Could not parse {answer[:40]!r}: {err}."
        problem = number_problem(used, self.numbers, self.use_all)
        if problem is not None:
            return True, False, problem
        if value != self.target:
            return True, False, f"Your expression equals {value}, not {self.target}."
        return True, True, ""
