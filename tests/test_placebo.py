"""The placebo control (`objective.placebo: shuffle_within_group`, rlvr.algorithms.placebo): rewards
shuffled within each group before credit. Hand-worked: the expected advantage of every trajectory
under the placebo is exactly 0, while each draw is a real step's advantages, permuted."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from rlvr.algorithms.placebo import partner_turn_rewards, placebo_partners
from rlvr.config import load_config
from rlvr.errors import ConfigError
from rlvr.records import Span, Trajectory
from rlvr.train.selection import assign_credit

REWARDS = [1.0, 0.0, 0.0, 0.5, 0.2, 0.2, 0.9, 0.2]  # two groups of 4


def traj(reward: float, usable: bool = True, n_tokens: int = 2) -> Trajectory:
    mask = (0,) + (1,) * n_tokens
    return Trajectory(
        task_id="t",
        token_ids=tuple(range(1, 2 + n_tokens)),
        policy_mask=mask,
        logprobs=tuple(-1.0 * m for m in mask),
        prompt_length=1,
        completion_text="",
        finish_reason="stop",
        reward=reward,
        rewards={"acc": reward},
        reward_errors=() if usable else ("acc",),
    )


class FixedShuffle:
    """An `rng` whose shuffle applies given permutations in turn (to enumerate all of them)."""

    def __init__(self, *permutations: Sequence[int]) -> None:
        self.permutations = list(permutations)

    def shuffle(self, items: list[int]) -> None:
        order = self.permutations.pop(0)
        items[:] = [items[i] for i in order]


def advantages_for(rewards: Sequence[float], extra: Sequence[str] = (), step: int = 0) -> list:
    cfg = load_config(None, ["sampling.group_size=4", *extra])
    out = assign_credit([traj(r) for r in rewards], cfg, "grpo", step=step)
    return [row[0] for row in out.token_advantages]


def test_expected_advantage_is_zero_over_every_permutation_by_hand() -> None:
    # Group 1 rewards [1, 0, 0, 0.5]: mean 0.375; Bessel std sqrt(((.625)^2 + 2(.375)^2 +
    # (.125)^2) / 3) = sqrt(0.6875 / 3) = 0.4787. Under a permutation pi, trajectory i gets
    # (r_pi(i) - 0.375) / (0.4787 + 1e-4); over all 24 permutations each i receives each r_j
    # exactly 6 times, so its mean advantage is (sum_j r_j - 4 * 0.375) / ... / 4 = 0 exactly.
    real = advantages_for(REWARDS[:4])
    assert real[0] == pytest.approx(0.625 / (0.6875**0.5 / 3**0.5 + 1e-4), abs=1e-5)
    totals = [0.0] * 4
    perms = list(itertools.permutations(range(4)))
    for perm in perms:
        partners = placebo_partners([True] * 4, 4, FixedShuffle(perm))  # type: ignore[arg-type]
        shuffled = [REWARDS[j] for j in partners]
        for i, a in enumerate(advantages_for(shuffled)):
            totals[i] += a / len(perms)
    assert totals == pytest.approx([0.0] * 4, abs=1e-6)


def test_each_placebo_step_is_a_permutation_of_the_real_advantages() -> None:
    real = advantages_for(REWARDS)
    placebo = advantages_for(REWARDS, ["objective.placebo=shuffle_within_group"], step=3)
    for group in (slice(0, 4), slice(4, 8)):  # same multiset per group: same update size
        assert sorted(placebo[group]) == pytest.approx(sorted(real[group]), abs=1e-6)
    # Reproducible from (seed, step); another step draws anew.
    again = advantages_for(REWARDS, ["objective.placebo=shuffle_within_group"], step=3)
    assert again == placebo
    draws = {
        tuple(advantages_for(REWARDS, ["objective.placebo=shuffle_within_group"], step=s))
        for s in range(20)
    }
    assert len(draws) > 5


def test_placebo_advantage_averages_to_zero_over_steps() -> None:
    # 600 steps: every trajectory's mean advantage is ~0 (sd of the mean ~ 1 / sqrt(600) = 0.04),
    # where the real run gives trajectory 0 its +1.3 every step.
    flag = ["objective.placebo=shuffle_within_group"]
    runs = [advantages_for(REWARDS, flag, step=s) for s in range(600)]
    means = [sum(r[i] for r in runs) / len(runs) for i in range(8)]
    assert advantages_for(REWARDS)[0] > 1.2
    assert max(abs(m) for m in means) < 0.2


def test_invalid_members_keep_themselves_and_get_nothing() -> None:
    rng = random.Random(0)
    for _ in range(50):
        partners = placebo_partners([True, False, True, True], 4, rng)
        assert partners[1] == 1
        assert sorted(partners[i] for i in (0, 2, 3)) == [0, 2, 3]
    cfg = load_config(None, ["sampling.group_size=4", "objective.placebo=shuffle_within_group"])
    rows = [traj(1.0), traj(0.0, usable=False), traj(0.0), traj(0.5)]
    out = assign_credit(rows, cfg, "grpo", step=1).token_advantages
    assert out[1] == [0.0, 0.0]
    with pytest.raises(ValueError, match="groups of 4"):
        placebo_partners([True] * 6, 4, rng)


def test_partner_turn_rewards_align_at_the_last_turn_and_keep_the_return() -> None:
    assert partner_turn_rewards([0.0, 0.1, 1.0], 3) == [0.0, 0.1, 1.0]
    assert partner_turn_rewards([0.5, 1.0], 3) == [0.0, 0.5, 1.0]  # fewer: earliest turn 0
    assert partner_turn_rewards([0.2, 0.3, 0.1, 1.0], 2) == pytest.approx([0.6, 1.0])  # folded
    assert partner_turn_rewards([1.0], 0) == []


def test_placebo_under_turn_credit_uses_the_partners_return() -> None:
    # Two 2-turn episodes, rewards (turn) [0, 1] and [0, 0]: the placebo either keeps them or
    # swaps them; each swap gives episode 0 the other's returns on its own tokens.
    def episode(turn_rewards: tuple[float, float]) -> Trajectory:
        mask = (0, 1, 0, 1)
        return Trajectory(
            task_id="t", token_ids=(1, 2, 3, 4), policy_mask=mask,
            logprobs=tuple(-1.0 * m for m in mask), prompt_length=1, completion_text="",
            finish_reason="stop", turns=(Span(1, 2), Span(3, 4)), turn_rewards=turn_rewards,
            reward=sum(turn_rewards),
        )  # fmt: skip

    cfg = load_config(
        None,
        ["sampling.group_size=2", "objective.credit=turn", "objective.scale_rewards=false",
         "objective.placebo=shuffle_within_group"],
    )  # fmt: skip
    # Real: R = [[1, 1], [0, 0]], mean 0.5 -> episode 0 +0.5 on both turns, episode 1 -0.5.
    seen = set()
    for step in range(20):
        out = assign_credit([episode((0.0, 1.0)), episode((0.0, 0.0))], cfg, "grpo", step=step)
        seen.add(out.token_advantages[0][0])
        assert out.token_advantages[0][0] == -out.token_advantages[1][0]
    assert seen == {0.5, -0.5}


def test_placebo_is_a_named_choice() -> None:
    with pytest.raises(ConfigError, match="placebo"):
        load_config(None, ["objective.placebo=shuffle"])
