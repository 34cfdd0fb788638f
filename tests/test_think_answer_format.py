"""think_answer_format_with_success: the <think>/<answer> structure pays only together with success."""

from __future__ import annotations

import pytest

from rlvr.errors import ConfigError
from rlvr.records import Task, Trajectory
from rlvr.verifiers import BUILTIN_REWARDS, RewardFunction, Rubric
from rlvr.verifiers.builtin import think_answer_format_with_success, think_answer_parts

REWARD = think_answer_format_with_success


@pytest.mark.parametrize(
    "text",
    [
        "<think>12 + 30 = 42</think><answer>42</answer>",
        "  <think>\nadd them\n</think>\n\n<answer> 42 </answer>\n",
    ],
)
def test_a_right_reasoned_answer_earns_the_bonus(text: str) -> None:
    assert REWARD(text, answer=42) == 1.0
    assert REWARD(text, answer="42", bonus=0.25) == 0.25


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("<think>12 + 30</think><answer>41</answer>", "wrong answer, perfect format"),
        ("<answer>42</answer>", "no think"),
        ("<think>42</think>", "no answer"),
        ("<think></think><answer>42</answer>", "empty think"),
        ("<think>   </think><answer>42</answer>", "blank think"),
        ("<think>x</think><answer></answer>", "empty answer"),
        ("<answer>42</answer><think>x</think>", "wrong order"),
        ("<think>x</think><answer>42</answer> done", "text after the answer"),
        ("So: <think>x</think><answer>42</answer>", "text before the think"),
        ("<think>x</think>because<answer>42</answer>", "text between"),
        ("<think>x <answer>42</answer></think><answer>42</answer>", "nested answer tag"),
        ("<think><think>x</think></think><answer>42</answer>", "nested think"),
        ("<think>x</think><answer>41</answer><answer>42</answer>", "repeated answer tag"),
        ("<think>the answer is 42</think><answer>unknown</answer>", "right number only in think"),
    ],
)
def test_format_hacks_and_wrong_answers_earn_nothing(text: str, why: str) -> None:
    assert REWARD(text, answer=42) == 0.0, why


def test_the_structure_parser() -> None:
    assert think_answer_parts("<think> a </think><answer> b </answer>") == ("a", "b")
    assert think_answer_parts("<think>a</think><answer>b</answer>x") is None


def test_the_success_check_is_configurable_and_gets_its_options() -> None:
    text = "<think>capital of France</think><answer>paris</answer>"
    assert REWARD(text, answer="Paris", check="exact_match") == 1.0
    assert REWARD(text, answer="Paris", check="exact_match", case_sensitive=True) == 0.0
    near = "<think>about</think><answer>100.4</answer>"
    assert REWARD(near, answer=100, tolerance=0.01) == 1.0
    assert REWARD(near, answer=100) == 0.0
    half = "<think>one over two</think><answer>\\frac{1}{2}</answer>"
    assert REWARD(half, answer="0.5", check="math_equiv") == 1.0


def test_config_mistakes_and_broken_data_raise() -> None:
    with pytest.raises(ConfigError, match="check must be one of"):
        REWARD("<think>x</think><answer>1</answer>", answer=1, check="answer_tag_format")
    with pytest.raises(ConfigError, match="bonus"):
        REWARD("<think>x</think><answer>1</answer>", answer=1, bonus=0)
    for text in ("<think>x</think><answer>1</answer>", "no format at all"):
        with pytest.raises(ValueError, match="not a number"):
            REWARD(text, answer="n/a")  # broken data, whatever the completion's format


def test_in_a_rubric_next_to_the_accuracy_component() -> None:
    """Config use: accuracy + the gated format bonus; a well-formatted wrong answer scores 0."""
    rubric = Rubric(
        [
            RewardFunction("correct", BUILTIN_REWARDS["numeric_match"]),
            RewardFunction(
                "format",
                BUILTIN_REWARDS["think_answer_format_with_success"],
                weight=0.2,
                options={"check": "numeric_match"},
            ),
        ]
    )
    task = Task("t", ({"role": "user", "content": "12 + 30?"},), {"answer": 42})

    def score(text: str) -> dict[str, float]:
        traj = Trajectory("t", (), (), (), 0, completion_text=text, finish_reason="stop")
        return dict(rubric.score(traj, task).rewards)

    assert score("<think>add</think><answer>42</answer>") == {"correct": 1.0, "format": 1.0}
    assert score("<answer>42</answer>") == {"correct": 1.0, "format": 0.0}
    assert score("<think>add</think><answer>41</answer>") == {"correct": 0.0, "format": 0.0}
