"""Unit tests for the built-in reward functions and the rubric that combines them (no model)."""

from __future__ import annotations

import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rlvr.errors import ConfigError
from rlvr.records import Task, Trajectory
from rlvr.verifiers import (
    BUILTIN_REWARDS,
    RewardFunction,
    Rubric,
    Score,
    answer_tag_format,
    exact_match,
    extract_last_number,
    extract_tagged,
    math_equiv,
    numeric_match,
    regex_format,
    resolve_reward_fn,
    trajectory_reward,
)


def make_trajectory(text: str, task_id: str = "t", finish_reason: Any = "stop") -> Trajectory:
    return Trajectory(
        task_id=task_id,
        token_ids=(1, 2, 3),
        policy_mask=(0, 1, 1),
        logprobs=(0.0, -0.5, -0.7),
        prompt_length=1,
        completion_text=text,
        finish_reason=finish_reason,
    )


def make_task(task_id: str = "t", **fields: Any) -> Task:
    return Task(id=task_id, messages=({"role": "user", "content": "q"},), fields=fields)


# --- extraction ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer> 42 </answer>", "42"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),  # the last pair wins
        ("<answer>\nmulti\nline\n</answer>", "multi\nline"),
        ("<answer></answer>", ""),
        ("no tag at all", None),
        ("<answer>unclosed", None),
        ("</answer>backwards<answer>", None),
    ],
)
def test_extract_tagged(text: str, expected: str | None) -> None:
    assert extract_tagged(text) == expected


def test_extract_tagged_custom_tag_is_escaped() -> None:
    assert extract_tagged("<final.x>7</final.x>", tag="final.x") == "7"
    assert extract_tagged("<finalxx>7</finalxx>", tag="final.x") is None
    assert extract_tagged("<answer>7</answer>", tag="result") is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 42", "42"),
        ("x = -3.", "-3"),  # sentence-ending full stop is not a decimal point
        ("from 2 to 3.25 meters", "3.25"),
        ("she paid $1,234 in total", "1234"),
        ("about 12,345.67.", "12345.67"),
        ("-0.5 and then -7", "-7"),
        ("(-5)", "-5"),
        ("−8 with a unicode minus", "-8"),
        ("3-5", "5"),  # a hyphen between numbers is not a sign
        ("1,2,3", "3"),  # a list, not a thousands number
        ("1,2345", "2345"),
        ("ends with .5", ".5"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_last_number(text: str, expected: str | None) -> None:
    assert extract_last_number(text) == expected


def test_extract_last_number_is_float_parsable() -> None:
    for text in ["1,000,000.5", "-12", ".25", "7."]:
        number = extract_last_number(text)
        assert number is not None
        float(number)


# --- answer_tag_format --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>reasoning</think>\n<answer>42</answer>", 1.0),
        ("<answer>42</answer>\n  \n", 1.0),  # trailing whitespace is fine
        ("<answer>42</answer> because", 0.0),  # text after the tag
        ("<answer>1</answer><answer>2</answer>", 0.0),  # two tags
        ("<answer>   </answer>", 0.0),  # empty inside
        ("<answer></answer>", 0.0),
        ("42", 0.0),
        ("<answer>42", 0.0),
        ("42</answer>", 0.0),
        ("</answer>42<answer>", 0.0),  # wrong order
    ],
)
def test_answer_tag_format(text: str, expected: float) -> None:
    assert answer_tag_format(text) == expected


def test_answer_tag_format_custom_tag_and_extra_fields_ignored() -> None:
    assert answer_tag_format("<final>x</final>", tag="final", answer="ignored") == 1.0
    assert answer_tag_format("<answer>x</answer>", tag="final") == 0.0


# --- regex_format -------------------------------------------------------------------------------


def test_regex_format_search_and_fullmatch() -> None:
    text = "<think>\nstep 1\nstep 2\n</think>\n<answer>5</answer>"
    assert regex_format(text, pattern=r"<answer>\d+</answer>") == 1.0
    assert regex_format(text, pattern=r"<answer>[a-z]+</answer>") == 0.0
    # DOTALL: `.` crosses the newlines of the reasoning block.
    assert regex_format(text, pattern=r"<think>.*</think>\s*<answer>.*</answer>", mode="fullmatch")
    assert regex_format("junk " + text, pattern=r"<think>.*</think>.*", mode="fullmatch") == 0.0
    assert regex_format("junk " + text, pattern=r"<think>.*</think>.*", mode="search") == 1.0


def test_regex_format_invalid_pattern_names_it() -> None:
    with pytest.raises(ConfigError, match=r"\(unclosed") as info:
        regex_format("text", pattern="(unclosed")
    assert "\n" not in str(info.value)


def test_regex_format_invalid_mode() -> None:
    with pytest.raises(ConfigError, match="mode"):
        regex_format("text", pattern="t", mode="match")


# --- exact_match --------------------------------------------------------------------------------


def test_exact_match_modes() -> None:
    tagged = "I think... <answer>  Paris </answer>"
    assert exact_match(tagged, answer="paris") == 1.0  # tag_or_text, case-insensitive by default
    assert exact_match(tagged, answer="paris", extract="tag") == 1.0
    assert exact_match(tagged, answer="paris", extract="text") == 0.0  # whole text is compared
    assert exact_match("  Paris\n", answer="Paris", extract="text") == 1.0
    assert exact_match("Paris", answer="Paris", extract="tag") == 0.0  # no tag -> 0.0
    assert exact_match("Paris", answer="Paris", extract="tag_or_text") == 1.0  # falls back


def test_exact_match_whitespace_and_case() -> None:
    assert exact_match("<answer>New   York\nCity</answer>", answer="new york city") == 1.0
    assert exact_match("<answer>Paris</answer>", answer="paris", case_sensitive=True) == 0.0
    assert exact_match("<answer>Paris</answer>", answer="Paris", case_sensitive=True) == 1.0
    assert exact_match("<answer>42</answer>", answer=42) == 1.0  # answer compared as str()
    assert exact_match("<result>x</result>", answer="x", tag="result", extract="tag") == 1.0


def test_exact_match_bad_extract_is_config_error() -> None:
    with pytest.raises(ConfigError, match="extract"):
        exact_match("x", answer="x", extract="last_number")


# --- numeric_match ------------------------------------------------------------------------------


def test_numeric_match_right_and_wrong() -> None:
    assert numeric_match("48 + 24 = 72. The answer is 72.", answer="72") == 1.0
    assert numeric_match("The answer is 71", answer="72") == 0.0
    assert numeric_match("It costs $1,234.", answer=1234) == 1.0
    assert numeric_match("The answer is 1234", answer="1,234") == 1.0
    assert numeric_match("x = -0.5", answer=-0.5) == 1.0
    assert numeric_match("0.3333333", answer=1 / 3, tolerance=1e-6) == 1.0
    assert numeric_match("0.33", answer=1 / 3) == 0.0
    assert numeric_match("0.33", answer=1 / 3, tolerance=0.01) == 1.0


def test_numeric_match_tolerance_is_relative_for_large_answers() -> None:
    # |1000000.5 - 1000000| = 0.5 <= 1e-6 * max(1, 1e6) = 1.0
    assert numeric_match("1000000.5", answer=1_000_000) == 1.0
    # |0.5 - 0| = 0.5 > 1e-6 * max(1, 0) = 1e-6: absolute near zero
    assert numeric_match("0.5", answer=0) == 0.0


def test_numeric_match_no_number_is_wrong_not_error() -> None:
    assert numeric_match("I don't know", answer="72") == 0.0
    assert numeric_match("", answer="72") == 0.0


def test_numeric_match_tag_mode() -> None:
    text = "First 10, then 20. <answer>The result is 30</answer> (check: 40)"
    assert numeric_match(text, answer=30, extract="tag") == 1.0
    assert numeric_match(text, answer=40) == 1.0  # last_number looks at the whole text
    assert numeric_match("no tag but 30", answer=30, extract="tag") == 0.0
    assert numeric_match("<answer>none</answer> 30", answer=30, extract="tag") == 0.0


@pytest.mark.parametrize("answer", ["seventy-two", "", None, "nan", True])
def test_numeric_match_broken_answer_raises(answer: Any) -> None:
    with pytest.raises(ValueError, match="numeric_match"):
        numeric_match("72", answer=answer)


# --- math_equiv ---------------------------------------------------------------------------------


def test_math_equiv_equivalent_forms() -> None:
    assert math_equiv("So the result is \\boxed{\\frac{1}{2}}", answer="0.5") == 1.0
    assert math_equiv("The answer is $2$", answer=2) == 1.0
    assert math_equiv("0.5", answer="\\frac{1}{2}") == 1.0
    assert math_equiv("We get $\\frac{\\sqrt{2}}{2}$", answer="\\frac{1}{\\sqrt{2}}") == 1.0


def test_math_equiv_wrong_or_missing_answer() -> None:
    assert math_equiv("The answer is $3$", answer=2) == 0.0
    assert math_equiv("\\boxed{\\frac{1}{3}}", answer="0.5") == 0.0
    assert math_equiv("I have no idea", answer=2) == 0.0
    assert math_equiv("", answer=2) == 0.0


def test_math_equiv_unparsable_gold_raises() -> None:
    with pytest.raises(ValueError, match="math_equiv"):
        math_equiv("2", answer="")


def test_math_equiv_is_fast_once_warm() -> None:
    math_equiv("$1$", answer=1)  # first call pays for math_verify's import and grammar setup
    start = time.perf_counter()
    for _ in range(10):
        assert math_equiv("The answer is \\boxed{\\frac{3}{4}}", answer="0.75") == 1.0
    assert (time.perf_counter() - start) / 10 < 0.2  # milliseconds in practice; loose for CI


def test_math_equiv_works_off_the_main_thread() -> None:
    # math_verify's signal.alarm timeout raises off the main thread; math_equiv disables it there.
    results: list[float] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            results.append(math_equiv("The answer is $2$", answer=2))
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert errors == []
    assert results == [1.0]


def test_math_equiv_timeout_becomes_timeout_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # math_verify reports a timeout with a BaseException subclass, which `except Exception` in the
    # rubric would not catch; math_equiv must turn it into an ordinary error, not a 0.0.
    import math_verify
    from math_verify.errors import TimeoutException

    def slow_parse(*args: Any, **kwargs: Any) -> list[Any]:
        raise TimeoutException("Operation timed out!")

    math_equiv("$1$", answer=1)  # warm the gold cache for 1 so only the completion parse times out
    monkeypatch.setattr(math_verify, "parse", slow_parse)
    with pytest.raises(TimeoutError, match="math_equiv"):
        math_equiv("some completion", answer=1)


def test_builtin_registry() -> None:
    assert set(BUILTIN_REWARDS) == {
        "answer_tag_format",
        "regex_format",
        "exact_match",
        "numeric_match",
        "math_equiv",
        "json_schema_format",
        "think_answer_format_with_success",
        "tool_trace",
    }
    assert BUILTIN_REWARDS["numeric_match"] is numeric_match


# --- RewardFunction / Rubric --------------------------------------------------------------------


def test_rubric_weighted_total() -> None:
    rubric = Rubric(
        [
            RewardFunction("format", answer_tag_format, weight=1.0),
            RewardFunction("correct", numeric_match, weight=0.5),
        ]
    )
    task = make_task(answer="72")
    score = rubric.score(make_trajectory("<answer>71</answer>"), task)
    # total = 1.0*1 (format ok) + 0.5*0 (71 != 72) = 1.0
    assert score == Score(rewards={"format": 1.0, "correct": 0.0}, total=1.0, errors={})
    assert score.ok
    score = rubric.score(make_trajectory("<answer>72</answer>"), task)
    # total = 1.0*1 + 0.5*1 = 1.5
    assert score.total == pytest.approx(1.5)
    score = rubric.score(make_trajectory("72, I think"), task)
    # total = 1.0*0 (no tag) + 0.5*1 (last number is 72) = 0.5
    assert score.total == pytest.approx(0.5)
    assert rubric.names == ("format", "correct")
    assert rubric.weights == {"format": 1.0, "correct": 0.5}


def test_rubric_negative_weight_penalty() -> None:
    @trajectory_reward
    def truncated(trajectory: Trajectory) -> float:
        return 1.0 if trajectory.finish_reason == "length" else 0.0

    rubric = Rubric(
        [RewardFunction("correct", numeric_match), RewardFunction("cut", truncated, weight=-0.5)]
    )
    score = rubric.score(make_trajectory("72", finish_reason="length"), make_task(answer=72))
    # total = 1.0*1 + (-0.5)*1 = 0.5
    assert score.total == pytest.approx(0.5)


def test_weight_zero_is_reported_but_not_counted() -> None:
    rubric = Rubric(
        [
            RewardFunction("format", answer_tag_format, weight=1.0),
            RewardFunction("correct", numeric_match, weight=0.0),
        ]
    )
    score = rubric.score(make_trajectory("<answer>72</answer>"), make_task(answer=72))
    # total = 1.0*1 + 0.0*1 = 1.0: "correct" is logged only
    assert score.rewards == {"format": 1.0, "correct": 1.0}
    assert score.total == 1.0


def test_raising_function_is_recorded_and_others_still_score() -> None:
    def broken(completion: str) -> float:
        raise RuntimeError("sandbox\nunavailable")

    rubric = Rubric(
        [
            RewardFunction("broken", broken),
            RewardFunction("format", answer_tag_format, weight=2.0),
        ]
    )
    score = rubric.score(make_trajectory("<answer>1</answer>"), make_task())
    assert score.errors == {"broken": "RuntimeError: sandbox unavailable"}  # one line
    assert score.rewards == {"format": 1.0}
    assert not score.ok
    assert score.total == 2.0  # only meaningful when errors is empty, but still the successful sum


def test_broken_answer_field_is_an_error_not_zero() -> None:
    rubric = Rubric([RewardFunction("correct", numeric_match)])
    score = rubric.score(make_trajectory("72"), make_task(answer="n/a"))
    assert score.rewards == {}
    assert score.errors["correct"].startswith("ValueError: numeric_match: answer 'n/a'")


@pytest.mark.parametrize(
    ("value", "error_start"),
    [
        (math.nan, "ValueError: returned nan"),
        (math.inf, "ValueError: returned inf"),
        (None, "TypeError: returned NoneType"),
        ("1.0", "TypeError: returned str"),
    ],
)
def test_bad_return_values_are_errors(value: Any, error_start: str) -> None:
    rubric = Rubric([RewardFunction("bad", lambda completion: value)])
    score = rubric.score(make_trajectory("x"), make_task())
    assert score.rewards == {}
    assert score.errors["bad"].startswith(error_start)


def test_bool_and_int_returns_become_floats() -> None:
    rubric = Rubric(
        [
            RewardFunction("yes", lambda completion: True),
            RewardFunction("no", lambda completion: False),
            RewardFunction("three", lambda completion: 3, weight=0.5),
        ]
    )
    score = rubric.score(make_trajectory("x"), make_task())
    # total = 1*1.0 + 1*0.0 + 0.5*3 = 2.5
    assert score.rewards == {"yes": 1.0, "no": 0.0, "three": 3.0}
    assert all(type(v) is float for v in score.rewards.values())
    assert score.total == 2.5


def test_options_override_task_fields() -> None:
    seen: dict[str, Any] = {}

    def spy(completion: str, answer: str, tag: str = "answer") -> float:
        seen.update(answer=answer, tag=tag)
        return 1.0

    function = RewardFunction("spy", spy, options={"answer": "from-options"})
    Rubric([function]).score(make_trajectory("x"), make_task(answer="from-task", tag="t"))
    assert seen == {"answer": "from-options", "tag": "t"}


def test_builtin_options_reach_the_function() -> None:
    rubric = Rubric(
        [RewardFunction("fmt", answer_tag_format, options={"tag": "final"})],
    )
    assert rubric.score(make_trajectory("<final>4</final>"), make_task()).rewards == {"fmt": 1.0}


def test_signature_filtering() -> None:
    calls: list[tuple[str, dict[str, Any]]] = []

    def only_answer(completion: str, answer: str) -> float:
        calls.append((completion, {"answer": answer}))
        return 1.0

    def takes_all(completion: str, **fields: Any) -> float:
        calls.append((completion, fields))
        return 1.0

    task = make_task(answer="a", tests=["t1"], difficulty=3)
    rubric = Rubric([RewardFunction("one", only_answer), RewardFunction("all", takes_all)])
    score = rubric.score(make_trajectory("text"), task)
    assert score.errors == {}
    assert calls == [
        ("text", {"answer": "a"}),  # no `tests`, no `difficulty`: not in its signature
        ("text", {"answer": "a", "tests": ["t1"], "difficulty": 3}),
    ]


def test_keyword_arguments_are_worked_out_once() -> None:
    function = RewardFunction("m", numeric_match, options={"tolerance": 0.1})
    assert function.keyword_arguments(make_task(answer=1, other=2)) == {
        "answer": 1,
        "other": 2,  # numeric_match takes **_, so everything is passed through
        "tolerance": 0.1,
    }


def test_missing_task_field_names_the_field() -> None:
    def needs_answer(completion: str, answer: str) -> float:
        return 1.0

    score = Rubric([RewardFunction("f", needs_answer)]).score(make_trajectory("x"), make_task("q7"))
    assert score.errors == {
        "f": "TypeError: task 'q7' has no field 'answer' needed by reward function 'f'"
    }


def test_unknown_option_is_config_error() -> None:
    def f(completion: str, answer: str) -> float:
        return 1.0

    with pytest.raises(ConfigError, match="tolerence"):
        RewardFunction("f", f, options={"tolerence": 0.1})


def test_function_without_positional_argument_is_config_error() -> None:
    def f(*, answer: str) -> float:
        return 1.0

    with pytest.raises(ConfigError, match="first argument"):
        RewardFunction("f", f)


def test_bad_weight_is_config_error() -> None:
    with pytest.raises(ConfigError, match="weight"):
        RewardFunction("f", answer_tag_format, weight=math.nan)
    with pytest.raises(ConfigError, match="weight"):
        RewardFunction("f", answer_tag_format, weight="1")  # type: ignore[arg-type]


def test_options_are_copied() -> None:
    options = {"tag": "a"}
    function = RewardFunction("f", answer_tag_format, options=options)
    options["tag"] = "b"
    assert function.options == {"tag": "a"}


def test_trajectory_reward_gets_the_trajectory() -> None:
    received: list[Any] = []

    @trajectory_reward
    def by_length(trajectory: Trajectory, answer: str) -> float:
        received.append(trajectory)
        return float(trajectory.num_policy_tokens)

    trajectory = make_trajectory("hello")
    score = Rubric([RewardFunction("len", by_length)]).score(trajectory, make_task(answer="x"))
    assert received == [trajectory]
    assert score.rewards == {"len": 2.0}


def test_rubric_rejects_duplicates_and_empty() -> None:
    with pytest.raises(ConfigError, match="used twice"):
        Rubric([RewardFunction("a", answer_tag_format), RewardFunction("a", numeric_match)])
    with pytest.raises(ConfigError, match="at least one"):
        Rubric([])


def test_score_many_keeps_order() -> None:
    rubric = Rubric([RewardFunction("correct", numeric_match)])
    pairs = [
        (make_trajectory("1"), make_task(answer=1)),
        (make_trajectory("2"), make_task(answer=3)),
        (make_trajectory("5"), make_task(answer="bad")),
    ]
    scores = rubric.score_many(pairs)
    assert [s.total for s in scores[:2]] == [1.0, 0.0]
    assert list(scores[2].errors) == ["correct"]


# --- resolve_reward_fn --------------------------------------------------------------------------


def test_resolve_builtin_and_module() -> None:
    assert resolve_reward_fn("numeric_match") is numeric_match
    assert resolve_reward_fn("rlvr.verifiers.builtin:numeric_match") is numeric_match
    assert resolve_reward_fn("rlvr.verifiers:RewardFunction.keyword_arguments") is (
        RewardFunction.keyword_arguments
    )


def test_resolve_file(tmp_path: Path) -> None:
    source = tmp_path / "my_rewards.py"
    source.write_text(
        "def starts_with_yes(completion, **_):\n"
        "    return 1.0 if completion.startswith('yes') else 0.0\n"
        "NOT_CALLABLE = 3\n"
    )
    fn = resolve_reward_fn(f"{source}:starts_with_yes")
    assert fn("yes indeed") == 1.0
    assert fn("no") == 0.0
    # The same file loads once: both specs see the same module.
    assert resolve_reward_fn(f"{source}:starts_with_yes") is fn
    # Relative paths resolve against base_dir (the config's folder).
    assert resolve_reward_fn("my_rewards.py:starts_with_yes", base_dir=tmp_path) is fn


def _config_error(spec: str, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_reward_fn(spec, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    assert repr(spec) in message
    return message


def test_resolve_errors_are_one_line(tmp_path: Path) -> None:
    message = _config_error("foo")
    assert "is not a known reward function (one of: answer_tag_format, regex_format" in message
    assert "'file.py:Name', 'package.module:Name', or a plug-in" in message

    assert "module 'no_such_module_xyz' not found" in _config_error("no_such_module_xyz:f")
    assert "has no attribute 'nope'" in _config_error("rlvr.verifiers.builtin:nope")
    assert "not callable" in _config_error("rlvr.verifiers.builtin:BUILTIN_REWARDS")
    assert "not found" in _config_error(f"{tmp_path / 'missing.py'}:f")
    assert "expected 'module:name'" in _config_error("rlvr.verifiers:")

    source = tmp_path / "rewards.py"
    source.write_text("VALUE = 1\n")
    assert "has no attribute 'f'" in _config_error(f"{source}:f")
    assert "not callable" in _config_error(f"{source}:VALUE")

    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_dependency_xyz\n")
    message = _config_error(f"{broken}:f")
    assert "importing" in message
    assert "ModuleNotFoundError" in message

    syntax = tmp_path / "syntax.py"
    syntax.write_text("def f(:\n    pass\n")
    assert "SyntaxError" in _config_error(f"{syntax}:f")


def test_resolve_module_with_missing_dependency(tmp_path: Path, monkeypatch: Any) -> None:
    # A module that exists but fails to import is not reported as "not found".
    (tmp_path / "needs_dep_xyz.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    message = _config_error("needs_dep_xyz:f")
    assert "importing 'needs_dep_xyz' failed: ModuleNotFoundError" in message
    sys.modules.pop("needs_dep_xyz", None)
