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

# Each task's reference solution, shipped in code_tasks.json (the env's scripted solver).
REFERENCE: dict[str, str] = {s["name"]: s["solution"] for s in load_code_tasks()}

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
        assert set(spec) == {"name", "prompt", "entry", "solution", "tests", "hidden"}
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
