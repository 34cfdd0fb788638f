"""Two-armed bandit env family: scoring, generated arms, ids and splits, options."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from rlvr.envs.bandit import (
    EXAMPLE_ARM,
    NAME_PAIRS,
    BanditEnv,
    BanditFamily,
    expected_value,
    make_task,
)
from rlvr.envs.base import split_instances
from rlvr.errors import ConfigError

ARMS: list[dict[str, Any]] = [
    {"name": "gold", "coins": 5, "percent": 90, "risk": "low"},  # EV 4.5
    {"name": "silver", "coins": 20, "percent": 10, "risk": "high"},  # EV 2.0
]


def step(text: str) -> tuple[dict[str, float], dict[str, Any], bool]:
    env = BanditFamily().make(make_task(ARMS))
    out = env.step(text)
    assert out.messages == []
    return out.rewards, out.info, out.done


def test_task_messages_and_reset() -> None:
    task = make_task(ARMS)
    assert task.id == "bandit:gold=5@90,silver=20@10"
    assert [m["role"] for m in task.messages] == ["system", "user"]
    user = task.messages[1]["content"]
    assert "Arm gold: 5 coins with probability 90%, else 0." in user
    assert "Arm silver: 20 coins with probability 10%, else 0." in user
    # the format example names no offered arm (copying it must not pay)
    assert user.endswith("for an arm named kestrel that would be <answer>kestrel</answer>.")
    assert all(EXAMPLE_ARM not in pair for pair in NAME_PAIRS)
    assert "risk" not in user
    env = BanditFamily().make(task)
    assert env.reset().messages == [dict(m) for m in task.messages]
    assert BanditEnv.max_turns == 1


def test_better_arm_succeeds() -> None:
    rewards, info, done = step("Gold pays 4.5 on average. <answer>Gold</answer>")
    assert done
    assert rewards == {"success": 1.0, "payout": 1.0, "invalid_action": 0.0}
    assert info == {"high_risk": 0}
    assert step("<answer> arm GOLD. </answer>")[0]["success"] == 1.0


def test_worse_arm_fails_with_partial_payout() -> None:
    rewards, info, done = step("<answer>gold</answer> hmm, <answer>silver</answer>")
    assert done
    assert rewards == {"success": 0.0, "payout": pytest.approx(2.0 / 4.5), "invalid_action": 0.0}
    assert info == {"high_risk": 1}


@pytest.mark.parametrize(
    "text", ["<answer>copper</answer>", "gold", "<answer></answer>", "<answer>kestrel</answer>"]
)
def test_invalid_answers_are_penalised(text: str) -> None:
    rewards, info, done = step(text)
    assert done
    assert rewards == {"success": 0.0, "payout": 0.0, "invalid_action": 1.0}
    assert info == {"invalid_action": 1}


def test_env_is_single_use() -> None:
    env = BanditFamily().make(make_task(ARMS))
    env.step("<answer>gold</answer>")
    with pytest.raises(RuntimeError):
        env.step("<answer>gold</answer>")


def test_generated_arms_follow_the_rules() -> None:
    family = BanditFamily({"min_gap": 0.3})
    better: Counter[str] = Counter()
    first_is_low = 0
    for seed in range(300):
        task = family.generate(seed)
        assert task == family.generate(seed)
        low, high = sorted(task.fields["arms"], key=lambda a: a["risk"] != "low")
        assert (low["risk"], high["risk"]) == ("low", "high")
        assert (low["name"], high["name"]) in NAME_PAIRS or (
            high["name"],
            low["name"],
        ) in NAME_PAIRS
        assert low["percent"] > high["percent"] and low["coins"] < high["coins"]
        lo, hi = expected_value(low), expected_value(high)
        assert abs(lo - hi) >= 0.3 * max(lo, hi) > 0
        better["high" if hi > lo else "low"] += 1
        first_is_low += task.fields["arms"][0]["risk"] == "low"
        best = max(task.fields["arms"], key=expected_value)["name"]
        rewards = family.make(task).step(f"<answer>{best}</answer>").rewards
        assert rewards["success"] == 1.0 and rewards["payout"] == 1.0
    assert 100 < better["high"] < 200  # "random": either arm is better about half the time
    assert 100 < first_is_low < 200  # the listing order does not give the risk away


@pytest.mark.parametrize("which", ["low_risk", "high_risk"])
def test_better_option_fixes_which_arm_wins(which: str) -> None:
    family = BanditFamily({"better": which})
    for seed in range(50):
        arms = family.generate(seed).fields["arms"]
        assert max(arms, key=expected_value)["risk"] == which.removesuffix("_risk")


def test_ids_are_mostly_distinct_and_split_is_disjoint() -> None:
    family = BanditFamily()
    assert len({family.generate(s).id for s in range(200)}) >= 190
    train, heldout = split_instances(family.generate, 200, 20)
    assert len(train) == 200 and len(heldout) == 20
    assert not {t.id for t in train} & {t.id for t in heldout}


@pytest.mark.parametrize(
    ("options", "name"),
    [({"min_gap": 1.5}, "min_gap"), ({"better": "gold"}, "better"), ({"arms": 3}, "arms")],
)
def test_bad_options_raise_config_error_naming_the_option(
    options: dict[str, object], name: str
) -> None:
    with pytest.raises(ConfigError, match=f"task.env.options.{name}"):
        BanditFamily(options)


def test_family_metadata() -> None:
    assert BanditFamily.name == "bandit"
    assert BanditFamily.success_metric == "success"
    assert BanditFamily.reward_weights == {
        "success": 1.0,
        "payout": 0.0,
        "invalid_action": -0.1,
        "working": 0.0,
    }
    assert BanditFamily.example_config == "examples/env_bandit.yaml"


def test_working_option_asks_for_products_and_the_solver_writes_them() -> None:
    family = BanditFamily({"working": True})
    task = make_task(ARMS, working=True)
    assert task.id == "bandit:gold=5@90,silver=20@10:working"
    assert task.fields["working"] is True
    user = task.messages[1]["content"]
    assert "First multiply each arm's coins by its percent" in user
    # the example's arms are never offered, so copying it names no arm
    assert "kestrel 4 x 50 = 200, wren 10 x 15 = 150, 200 > 150 <answer>kestrel</answer>" in user
    solved = family.scripted_action(task, list(task.messages))
    assert solved == "gold 5 x 90 = 450, silver 20 x 10 = 200, 450 > 200 <answer>gold</answer>"
    assert family.make(task).step(solved).rewards["success"] == 1.0
    # only the answer is scored: wrong working with the right arm still succeeds
    assert family.make(task).step("gold 1 x 1 = 7 <answer>gold</answer>").rewards["success"] == 1.0
    flipped = make_task(list(reversed(ARMS)), working=True)
    assert family.scripted_action(flipped, []).endswith("450 > 200 <answer>gold</answer>")
    # generated tasks carry the option; the split key (the decision) ignores it
    plain, worked = BanditFamily().generate(7), family.generate(7)
    assert worked.id == plain.id + ":working" and "working" not in plain.fields
    assert family.split_key(worked) == BanditFamily().split_key(plain)
    for seed in range(50):
        t = family.generate(seed)
        assert family.make(t).step(family.scripted_action(t, [])).rewards["success"] == 1.0


@pytest.mark.parametrize(
    ("text", "working"),
    [
        ("gold 5 x 90 = 450, silver 20 x 10 = 200, 450 > 200 <answer>gold</answer>", 1.0),
        # both products right, the comparison the wrong way round for the arm named: 2 of 3
        ("gold 5 x 90 = 450, silver 20 x 10 = 200, 200 > 450 <answer>gold</answer>", 2 / 3),
        # one product wrong, so the comparison quotes a number that is not the arm's product
        ("gold 5 x 90 = 405, silver 20 x 10 = 200, 405 > 200 <answer>gold</answer>", 1 / 3),
        # right working, wrong arm named: its comparison "200 > 450" cannot be true
        ("gold 5 x 90 = 450, silver 20 x 10 = 200, 200 > 450 <answer>silver</answer>", 2 / 3),
        # products quoted under the wrong arm's coins count for neither arm
        ("gold 20 x 10 = 200, silver 5 x 90 = 450, 450 > 200 <answer>gold</answer>", 1 / 3),
        ("<answer>gold</answer>", 0.0),  # no working at all
        ("gold 5 x 90 = 450, silver 20 x 10 = 200, 450 > 200 <answer>kestrel</answer>", 0.0),
    ],
)
def test_working_reward_scores_the_products_and_the_comparison(text: str, working: float) -> None:
    """`working` is the share of three checks (each product, the comparison for the named arm),
    worked by hand for ARMS (gold 5 x 90 = 450 pays more than silver 20 x 10 = 200); it is logged
    with weight 0 unless the config sets one, and a task without the option has no such part."""
    family = BanditFamily({"working": True})
    rewards = family.make(make_task(ARMS, working=True)).step(text).rewards
    assert rewards["working"] == pytest.approx(working)
    assert BanditFamily.reward_weights["working"] == 0.0
    plain = BanditFamily().make(make_task(ARMS)).step(text).rewards
    assert "working" not in plain and plain["success"] == rewards["success"]
