"""Code env: every bundled task against a reference solution, the split, code extraction, the
episode's feedback (never revealing hidden tests), the dataset reward and the example configs."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from rlvr.config import load_config
from rlvr.envs.base import stable_fraction
from rlvr.envs.code import (
    NO_CODE_FEEDBACK,
    CodeEnv,
    CodeFamily,
    extract_code,
    load_code_tasks,
    make_task,
)
from rlvr.errors import ConfigError
from rlvr.sandbox import SandboxResult, run_tests
from rlvr.sandbox import TestCase as Case
from rlvr.tasks import load_tasks
from rlvr.verifiers.code import code_tests

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# One reference solution per task in code_tasks.json, written alongside the tests (not shipped).
REFERENCE: dict[str, str] = {
    "count_vowels": """
def count_vowels(s):
    return sum(c in "aeiouAEIOU" for c in s)
""",
    "reverse_words": """
def reverse_words(s):
    return " ".join(reversed(s.split()))
""",
    "is_palindrome": """
def is_palindrome(s):
    t = [c.lower() for c in s if c.isalnum()]
    return t == t[::-1]
""",
    "running_sum": """
def running_sum(nums):
    out, total = [], 0
    for n in nums:
        total += n
        out.append(total)
    return out
""",
    "second_largest": """
def second_largest(nums):
    values = sorted(set(nums))
    return values[-2] if len(values) >= 2 else None
""",
    "fizzbuzz": """
def fizzbuzz(n):
    out = []
    for i in range(1, n + 1):
        out.append("FizzBuzz" if i % 15 == 0 else "Fizz" if i % 3 == 0 else "Buzz" if i % 5 == 0 else str(i))
    return out
""",
    "char_frequency": """
def char_frequency(s):
    counts = {}
    for c in s:
        counts[c] = counts.get(c, 0) + 1
    return counts
""",
    "flatten": """
def flatten(nested):
    out = []
    for item in nested:
        if isinstance(item, list):
            out.extend(flatten(item))
        else:
            out.append(item)
    return out
""",
    "gcd": """
def gcd(a, b):
    while b:
        a, b = b, a % b
    return a
""",
    "is_prime": """
def is_prime(n):
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True
""",
    "digit_sum": """
def digit_sum(n):
    return sum(int(d) for d in str(abs(n)))
""",
    "caesar_shift": """
def caesar_shift(s, k):
    out = []
    for c in s:
        if "a" <= c <= "z":
            out.append(chr((ord(c) - 97 + k) % 26 + 97))
        elif "A" <= c <= "Z":
            out.append(chr((ord(c) - 65 + k) % 26 + 65))
        else:
            out.append(c)
    return "".join(out)
""",
    "merge_sorted": """
def merge_sorted(a, b):
    i = j = 0
    out = []
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]
""",
    "chunk": """
def chunk(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]
""",
    "word_count": """
def word_count(text):
    counts, word = {}, ""
    for c in text.lower() + " ":
        if c.isalpha():
            word += c
        elif word:
            counts[word] = counts.get(word, 0) + 1
            word = ""
    return counts
""",
    "roman_to_int": """
def roman_to_int(s):
    v = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
    total = 0
    for i, c in enumerate(s):
        if i + 1 < len(s) and v[c] < v[s[i + 1]]:
            total -= v[c]
        else:
            total += v[c]
    return total
""",
    "int_to_roman": """
def int_to_roman(n):
    table = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
             (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]
    out = ""
    for value, sym in table:
        while n >= value:
            out += sym
            n -= value
    return out
""",
    "balanced_brackets": """
def balanced_brackets(s):
    pairs = {")": "(", "]": "[", "}": "{"}
    stack = []
    for c in s:
        if c in "([{":
            stack.append(c)
        elif c in pairs:
            if not stack or stack.pop() != pairs[c]:
                return False
    return not stack
""",
    "rle_encode": """
from itertools import groupby

def rle_encode(s):
    return "".join(f"{c}{len(list(g))}" for c, g in groupby(s))
""",
    "rle_decode": """
import re

def rle_decode(s):
    return "".join(c * int(n) for c, n in re.findall(r"(\\D)(\\d+)", s))
""",
    "transpose": """
def transpose(matrix):
    return [list(col) for col in zip(*matrix)]
""",
    "anagram_groups": """
def anagram_groups(words):
    groups = {}
    for w in words:
        groups.setdefault("".join(sorted(w)), []).append(w)
    return list(groups.values())
""",
    "are_anagrams": """
def are_anagrams(a, b):
    key = lambda s: sorted(s.replace(" ", "").lower())
    return key(a) == key(b)
""",
    "max_subarray_sum": """
def max_subarray_sum(nums):
    best = cur = nums[0]
    for n in nums[1:]:
        cur = max(n, cur + n)
        best = max(best, cur)
    return best
""",
    "binary_search": """
def binary_search(nums, target):
    lo, hi = 0, len(nums) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if nums[mid] == target:
            return mid
        if nums[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
""",
    "dedupe": """
def dedupe(items):
    seen, out = set(), []
    for x in items:
        if (type(x), x) not in seen:
            seen.add((type(x), x))
            out.append(x)
    return out
""",
    "pascal_row": """
def pascal_row(n):
    row = [1]
    for _ in range(n):
        row = [a + b for a, b in zip([0] + row, row + [0])]
    return row
""",
    "fibonacci": """
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
""",
    "title_case": """
def title_case(s):
    return " ".join(w[:1].upper() + w[1:].lower() for w in s.split(" "))
""",
    "count_islands": """
def count_islands(grid):
    seen = set()
    count = 0
    for r, row in enumerate(grid):
        for c, cell in enumerate(row):
            if cell != "#" or (r, c) in seen:
                continue
            count += 1
            stack = [(r, c)]
            seen.add((r, c))
            while stack:
                y, x = stack.pop()
                for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                    if 0 <= ny < len(grid) and 0 <= nx < len(grid[ny]) and grid[ny][nx] == "#" and (ny, nx) not in seen:
                        seen.add((ny, nx))
                        stack.append((ny, nx))
    return count
""",
    "matrix_multiply": """
def matrix_multiply(a, b):
    return [[sum(x * y for x, y in zip(row, col)) for col in zip(*b)] for row in a]
""",
    "common_prefix": """
def common_prefix(words):
    if not words:
        return ""
    prefix = words[0]
    for w in words[1:]:
        while not w.startswith(prefix):
            prefix = prefix[:-1]
    return prefix
""",
    "snake_to_camel": """
def snake_to_camel(s):
    first, *rest = s.split("_")
    return first + "".join(p[:1].upper() + p[1:] for p in rest)
""",
    "camel_to_snake": """
def camel_to_snake(s):
    out = ""
    for i, c in enumerate(s):
        if c.isupper():
            out += ("_" if i else "") + c.lower()
        else:
            out += c
    return out
""",
    "sum_of_multiples": """
def sum_of_multiples(n):
    return sum(i for i in range(1, n) if i % 3 == 0 or i % 5 == 0)
""",
    "collatz_steps": """
def collatz_steps(n):
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps
""",
    "primes_up_to": """
def primes_up_to(n):
    return [p for p in range(2, n + 1) if all(p % d for d in range(2, int(p ** 0.5) + 1))]
""",
    "rotate_right": """
def rotate_right(items, k):
    if not items:
        return []
    k %= len(items)
    return items[len(items) - k:] + items[:len(items) - k]
""",
    "invert_dict": """
def invert_dict(d):
    out = {}
    for k, v in d.items():
        out.setdefault(v, []).append(k)
    return {v: sorted(ks) for v, ks in out.items()}
""",
    "nested_get": """
def nested_get(data, path):
    cur = data
    for key in path:
        if not isinstance(cur, dict) or key not in cur:
            return None
        cur = cur[key]
    return cur
""",
    "deep_merge": """
def deep_merge(a, b):
    out = dict(a)
    for k, v in b.items():
        if isinstance(out.get(k), dict) and isinstance(v, dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out
""",
    "median": """
def median(nums):
    s = sorted(nums)
    mid = len(s) // 2
    return float(s[mid]) if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
""",
    "count_bits": """
def count_bits(n):
    return bin(n).count("1")
""",
    "to_binary": """
def to_binary(n):
    return format(n, "b")
""",
    "most_common": """
def most_common(items):
    counts = {}
    for x in items:
        counts[x] = counts.get(x, 0) + 1
    best = max(counts.values())
    return next(x for x in items if counts[x] == best)
""",
    "is_valid_ipv4": """
def is_valid_ipv4(s):
    parts = s.split(".")
    if len(parts) != 4:
        return False
    for p in parts:
        if not p or any(c not in "0123456789" for c in p):
            return False
        if len(p) > 1 and p[0] == "0":
            return False
        if int(p) > 255:
            return False
    return True
""",
    "compress_ranges": """
def compress_ranges(nums):
    out = []
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}..{nums[j]}")
        i = j + 1
    return out
""",
    "spiral_order": """
def spiral_order(matrix):
    out = []
    m = [list(r) for r in matrix]
    while m:
        out.extend(m.pop(0))
        m = [list(r) for r in zip(*m)][::-1]
    return out
""",
    "rank_people": """
def rank_people(people):
    return sorted(people, key=lambda p: (-p[1], p[0]))
""",
    "hamming_distance": """
def hamming_distance(a, b):
    if len(a) != len(b):
        return None
    return sum(x != y for x, y in zip(a, b))
""",
}

SPECS = {spec["name"]: spec for spec in load_code_tasks()}


def run_all(code: str, spec: dict[str, Any]) -> SandboxResult:
    cases = [Case(tuple(t["args"]), t["expected"]) for t in spec["tests"]]
    cases += [Case(tuple(t["args"]), t["expected"], hidden=True) for t in spec["hidden"]]
    return run_tests(code, spec["entry"], cases)


def hard_coded(spec: dict[str, Any]) -> str:
    """A solution that memorises the visible examples and returns None for anything else."""
    table = {json.dumps(t["args"], sort_keys=True): t["expected"] for t in spec["tests"]}
    return (
        f"import json\nTABLE = json.loads({json.dumps(table)!r})\n"
        f"def {spec['entry']}(*args):\n"
        "    return TABLE.get(json.dumps(list(args), sort_keys=True))\n"
    )


def test_task_file_is_well_formed() -> None:
    assert len(SPECS) >= 40 and len(SPECS) == len(load_code_tasks())
    assert set(REFERENCE) == set(SPECS)
    for spec in SPECS.values():
        assert set(spec) == {"name", "prompt", "entry", "tests", "hidden"}
        assert f"def {spec['entry']}(" in spec["prompt"]
        assert len(spec["tests"]) == 2 and len(spec["hidden"]) >= 3
        for test in spec["tests"] + spec["hidden"]:
            assert set(test) == {"args", "expected"} and isinstance(test["args"], list)


def test_every_reference_passes_and_trivial_solutions_fail() -> None:
    jobs: list[tuple[str, str, bool]] = []
    for name, spec in SPECS.items():
        jobs.append((name, REFERENCE[name], True))
        jobs.append((name, f"def {spec['entry']}(*args):\n    return None\n", False))
        jobs.append((name, hard_coded(spec), False))
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda job: run_all(job[1], SPECS[job[0]]), jobs))
    wrong = [
        (name, result.outcomes, result.load_error)
        for (name, _, should_pass), result in zip(jobs, results, strict=True)
        if result.all_passed != should_pass
    ]
    assert not wrong


def test_splits_are_disjoint_non_empty_and_cover_the_set() -> None:
    family = CodeFamily()
    train, heldout = family.make_splits(1000, 1000, 0.25)
    assert train and heldout
    assert not {t.id for t in train} & {t.id for t in heldout}
    assert len(train) + len(heldout) == len(SPECS)
    assert all(stable_fraction(t.id) < 0.25 for t in heldout)
    assert all(stable_fraction(t.id) >= 0.25 for t in train)
    # Tiny or huge fractions still leave both sides non-empty; the caps only cut.
    for fraction in (0.001, 0.999):
        tr, he = family.make_splits(1000, 1000, fraction)
        assert tr and he and len(tr) + len(he) == len(SPECS)
    tr, he = family.make_splits(5, 2, 0.25)
    assert len(tr) == 5 and len(he) == 2
    assert {t.id for t in he} <= {t.id for t in heldout}
    # Ids are canonical: a seed that lands on the same task gives the same id.
    assert family.generate(3).id == family.generate(3 + len(SPECS)).id


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("Here:\n```python\ndef f():\n    return 1\n```\n", "def f():\n    return 1\n"),
        (
            "```python\ndef f(): return 1\n```\nbetter:\n```python\ndef f(): return 2\n```",
            "def f(): return 2\n",
        ),
        ("```\ndef f(): return 3\n```", "def f(): return 3\n"),
        ("```python\ndef f(): return 4\n```\n```\nplain\n```", "def f(): return 4\n"),
        ("```py\ndef f(): return 5\n```", "def f(): return 5\n"),
        ("def f(x):\n    return x\n", "def f(x):\n    return x\n"),
        ("The answer is 42.", None),
        ("```python\n\n```", None),
        ("```python\ndef f(): return 1", None),
    ],
)
def test_extract_code(text: str, code: str | None) -> None:
    assert extract_code(text) == code


def env_for(name: str, **options: Any) -> CodeEnv:
    family = CodeFamily(options)
    env = family.make(make_task(SPECS[name]))
    assert isinstance(env, CodeEnv)
    return env


def test_prompt_shows_visible_tests_only() -> None:
    env = env_for("fibonacci")
    text = "\n".join(m["content"] for m in env.reset().messages)
    assert "fibonacci(10) -> 55" in text and "```python" in text
    assert "12586269025" not in text and "fibonacci(50)" not in text


def test_right_answer_succeeds_at_once() -> None:
    env = env_for("fibonacci")
    step = env.step(f"Sure.\n```python\n{REFERENCE['fibonacci'].strip()}\n```")
    assert step.done and step.rewards == {"success": 1.0, "format": 1.0}


def test_wrong_answer_names_a_visible_test_and_hides_hidden_ones() -> None:
    env = env_for("fibonacci")
    slow = "```python\ndef fibonacci(n):\n    return n\n```"  # right on 1, wrong on 10 and beyond
    step = env.step(slow)
    assert not step.done and step.rewards == {"success": 0.0, "format": 1.0}
    feedback = step.messages[0]["content"]
    assert "fibonacci(10)" in feedback and "wrong output" in feedback
    assert "hidden tests failed" in feedback
    hidden = SPECS["fibonacci"]["hidden"]
    for test in hidden:
        if test["expected"] > 9:
            assert str(test["expected"]) not in feedback
        assert f"fibonacci({test['args'][0]})" not in feedback


def test_passing_visible_but_not_hidden_is_not_success() -> None:
    env = env_for("is_valid_ipv4")
    step = env.step(f"```python\n{hard_coded(SPECS['is_valid_ipv4'])}```")
    feedback = step.messages[0]["content"]
    assert step.rewards["success"] == 0.0 and not step.done
    assert "All 2 example tests pass" in feedback and "hidden tests failed" in feedback
    for test in SPECS["is_valid_ipv4"]["hidden"]:
        assert test["args"][0] not in feedback or test["args"][0] == ""


def test_errors_timeouts_and_missing_code_are_explained() -> None:
    env = env_for("gcd")
    step = env.step("I think the answer is to use Euclid.")
    assert step.messages[0]["content"].startswith(NO_CODE_FEEDBACK)
    assert step.rewards == {"success": 0.0, "format": 0.0}
    step = env.step("```python\ndef gcd(a, b):\n    return a // 0\n```")
    assert "gcd(12, 18) raised an error: ZeroDivisionError" in step.messages[0]["content"]
    assert step.rewards == {"success": 0.0, "format": 1.0}

    env = env_for("gcd", wall_seconds=1)
    step = env.step("```python\ndef gcd(a, b):\n    while True:\n        pass\n```")
    assert "timed out" in step.messages[0]["content"]
    env = env_for("gcd")
    step = env.step("```python\ndef gcd(a, b)\n    return 1\n```")
    assert "could not be run: SyntaxError" in step.messages[0]["content"]
    step = env_for("gcd").step("```python\ndef my_gcd(a, b):\n    return 1\n```")
    assert "does not define a function named `gcd`" in step.messages[0]["content"]


def test_options_and_turn_cap() -> None:
    assert env_for("gcd").max_turns == 2
    assert env_for("gcd", max_turns=3).max_turns == 3
    with pytest.raises(ConfigError, match="wall_seconds"):
        CodeFamily({"wall_seconds": 60})
    assert CodeFamily({"wall_seconds": 2}).generate(0).fields["wall_seconds"] == 2


def test_code_tests_reward() -> None:
    spec = SPECS["rle_decode"]
    right = f"```python\n{REFERENCE['rle_decode']}```"
    kwargs = {"tests": spec["tests"], "entry": spec["entry"], "hidden_tests": spec["hidden"]}
    assert code_tests(right, **kwargs) == 1.0
    assert code_tests(right, **{**kwargs, "tests": json.dumps(spec["tests"])}) == 1.0
    assert code_tests(f"```python\n{hard_coded(spec)}```", **kwargs) == 0.0
    assert code_tests("no code here", **kwargs) == 0.0
    assert code_tests(right, tests=spec["tests"], entry=spec["entry"], unrelated=1) == 1.0
    with pytest.raises(ValueError, match="no tests"):
        code_tests(right, tests=[], entry="rle_decode")
    with pytest.raises(ValueError, match="args"):
        code_tests(right, tests=[{"input": 1}], entry="rle_decode")


def test_example_configs_load() -> None:
    env_cfg = load_config(EXAMPLES / "env_code.yaml")
    assert env_cfg.task.env is not None and env_cfg.task.env.name == "code"
    splits = load_tasks(env_cfg.task)
    assert splits.train and splits.heldout
    assert len(splits.train) + len(splits.heldout) == len(SPECS)

    cfg = load_config(EXAMPLES / "code_dataset.yaml")
    assert cfg.task.dataset is not None and cfg.rewards[0].fn == "rlvr.verifiers.code:code_tests"
    dataset = cfg.task.dataset.model_copy(update={"path": str(EXAMPLES / cfg.task.dataset.path)})
    splits = load_tasks(cfg.task.model_copy(update={"dataset": dataset}))
    tasks = splits.train + splits.heldout
    assert len(tasks) == 5 and splits.train and splits.heldout
    for task in tasks:
        assert set(task.fields) == {"entry", "tests", "hidden_tests"}
        assert code_tests("```python\ndef nothing(): pass\n```", **task.fields) == 0.0
