"""Hand-worked tests for multi-turn credit (rlvr.algorithms.credit), group filtering
(rlvr.algorithms.filtering) and the loop's dynamic sampling (rlvr.train.selection.collect_groups).

Every expected number is worked out by hand in the comment next to it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from rlvr.algorithms.credit import discounted_returns, token_advantages, turn_advantages
from rlvr.algorithms.filtering import select_groups
from rlvr.config import RunConfig, load_config
from rlvr.records import Group, Span, Task, Trajectory
from rlvr.train.selection import assign_credit, collect_groups


def approx(values: Sequence[float], tol: float = 1e-9) -> object:
    return pytest.approx(list(values), abs=tol)


# ------------------------------------------------------------------------------ discounted returns
def test_discounted_returns_by_hand() -> None:
    # gamma 0.5 over r = [1, 0, 2]: R2 = 2, R1 = 0 + 0.5 * 2 = 1, R0 = 1 + 0.5 * 1 = 1.5
    assert discounted_returns([1.0, 0.0, 2.0], 0.5) == [1.5, 1.0, 2.0]
    # gamma 1: suffix sums [3, 2, 2]
    assert discounted_returns([1.0, 0.0, 2.0], 1.0) == [3.0, 2.0, 2.0]
    # gamma 0: each turn's own reward
    assert discounted_returns([1.0, 0.0, 2.0], 0.0) == [1.0, 0.0, 2.0]
    # gamma 0.9 over [0, 0, 1]: [0.81, 0.9, 1]
    assert discounted_returns([0.0, 0.0, 1.0], 0.9) == approx([0.81, 0.9, 1.0])
    assert discounted_returns([], 0.9) == []


# ------------------------------------------------------------------------------ turn advantages
def test_turn_advantages_pool_every_turn_of_the_group() -> None:
    # One group of 3 with 2, 1 and 3 turns; gamma 0.5:
    #   t0: r = [0, 1]    -> R = [0.5, 1]
    #   t1: r = [1]       -> R = [1]
    #   t2: r = [0, 0, 1] -> R = [0.25, 0.5, 1]
    # pool = [0.5, 1, 1, 0.25, 0.5, 1]: sum 4.25, mean 17/24
    # deviations (in 24ths): t0 [-5, 7], t1 [7], t2 [-11, -5, 7]
    # sum of squares = (25 + 49 + 49 + 121 + 25 + 49) / 576 = 318/576; Bessel var = 318/576/5 = 53/480
    rewards = [[0.0, 1.0], [1.0], [0.0, 0.0, 1.0]]
    centred = turn_advantages(rewards, [True] * 3, 3, gamma=0.5, scale=False)
    assert centred[0] == approx([-5 / 24, 7 / 24])
    assert centred[1] == approx([7 / 24])
    assert centred[2] == approx([-11 / 24, -5 / 24, 7 / 24])

    std = math.sqrt(53 / 480)  # 0.33229
    scaled = turn_advantages(rewards, [True] * 3, 3, gamma=0.5, scale=True, eps=0.0)
    assert scaled[0] == approx([-5 / 24 / std, 7 / 24 / std])
    assert scaled[1] == approx([7 / 24 / std])
    assert scaled[2] == approx([-11 / 24 / std, -5 / 24 / std, 7 / 24 / std])
    assert scaled[2][0] == pytest.approx(-1.379317, abs=1e-6)  # -0.4583333 / 0.3322900


def test_turn_advantages_default_gamma_and_eps() -> None:
    # gamma 1: R = [[1, 1], [0], [1, 1, 1]]; pool [1, 1, 0, 1, 1, 1], mean 5/6,
    # Bessel var = (5 * (1/6)^2 + (5/6)^2) / 5 = (5/36 + 25/36) / 5 = 1/6, std = 0.408248
    out = turn_advantages([[0.0, 1.0], [0.0], [0.0, 0.0, 1.0]], [True] * 3, 3)
    denom = math.sqrt(1 / 6) + 1e-4
    assert out == [
        approx([1 / 6 / denom] * 2),
        approx([-5 / 6 / denom]),
        approx([1 / 6 / denom] * 3),
    ]
    assert out[1][0] == pytest.approx(-2.040742, abs=1e-6)  # -0.833333 / 0.408348


def test_invalid_trajectories_get_zero_and_do_not_shift_the_pool() -> None:
    # t1 is invalid with a huge return; pool = t0 and t2 only: R = [0.5, 1] + [0.25, 0.5, 1],
    # sum 3.25, mean 0.65 -> centred t0 [-0.15, 0.35], t2 [-0.4, -0.15, 0.35]
    rewards = [[0.0, 1.0], [100.0], [0.0, 0.0, 1.0]]
    out = turn_advantages(rewards, [True, False, True], 3, gamma=0.5, scale=False)
    assert out[0] == approx([-0.15, 0.35])
    assert out[1] == [0.0]
    assert out[2] == approx([-0.4, -0.15, 0.35])
    # Same as the group without it.
    without = turn_advantages([rewards[0], rewards[2]], [True, True], 2, gamma=0.5, scale=False)
    assert without == [out[0], out[2]]


def test_equal_returns_and_single_returns_give_zero() -> None:
    # gamma 1: R = [[1], [1, 1]], all equal -> 0 everywhere
    assert turn_advantages([[1.0], [0.0, 1.0]], [True, True], 2) == [[0.0], [0.0, 0.0]]
    # only one valid return in the pool: nothing to compare with
    assert turn_advantages([[1.0], [0.0]], [True, False], 2) == [[0.0], [0.0]]
    # nothing valid
    assert turn_advantages([[1.0], [0.0]], [False, False], 2) == [[0.0], [0.0]]


def test_turn_advantages_groups_are_independent() -> None:
    # group 1: R = [1], [0]: mean 0.5, Bessel std sqrt(0.5); group 2: R = [2], [2] -> 0
    out = turn_advantages([[1.0], [0.0], [2.0], [2.0]], [True] * 4, 2, eps=0.0)
    s = math.sqrt(0.5)
    assert out == [approx([0.5 / s]), approx([-0.5 / s]), [0.0], [0.0]]
    with pytest.raises(ValueError, match="groups of 2"):
        turn_advantages([[1.0], [0.0], [2.0]], [True] * 3, 2)


# ------------------------------------------------------------------------------ token advantages
def two_turn_trajectory() -> Trajectory:
    """prompt 3 tokens | turn 0: 2 tokens | observation: 3 tokens | turn 1: 2 tokens."""
    mask = (0, 0, 0, 1, 1, 0, 0, 0, 1, 1)
    return Trajectory(
        task_id="t",
        token_ids=tuple(range(10, 20)),
        policy_mask=mask,
        logprobs=tuple(-0.5 * m for m in mask),
        prompt_length=3,
        completion_text="",
        finish_reason="stop",
        turns=(Span(3, 5), Span(8, 10)),
        turn_rewards=(0.0, 1.0),
    )


def test_token_advantages_map_turn_spans_to_tokens() -> None:
    traj = two_turn_trajectory()
    # bi-level: 0.2 + 2 * 0.5 = 1.2 on turn 0; 0.2 + 2 * (-1.0) = -1.8 on turn 1
    out = token_advantages(traj, 0.2, [0.5, -1.0], turn_weight=2.0)
    assert out == approx([1.2, 1.2, 0.0, 0.0, 0.0, -1.8, -1.8])
    # pure turn credit
    assert token_advantages(traj, 0.0, [0.5, -1.0]) == [0.5, 0.5, 0.0, 0.0, 0.0, -1.0, -1.0]
    with pytest.raises(ValueError):
        token_advantages(traj, 0.0, [0.5])  # one advantage per turn


def test_token_advantages_trajectory_credit_covers_the_sampled_tokens() -> None:
    out = token_advantages(two_turn_trajectory(), 0.7, None)
    assert len(out) == 7
    assert [out[i] for i in (0, 1, 5, 6)] == [0.7] * 4


def test_token_advantages_trajectory_credit_is_zero_on_observations() -> None:
    out = token_advantages(two_turn_trajectory(), 0.7, None)
    assert out == [0.7, 0.7, 0.0, 0.0, 0.0, 0.7, 0.7]


def test_assign_credit_bi_level_by_hand() -> None:
    cfg = load_config(
        None,
        [
            "sampling.group_size=2",
            "objective.credit=bi-level",
            "objective.scale_rewards=false",
            "objective.turn_weight=0.5",
        ],
    )
    a = two_turn_trajectory()  # 2 turns, turn rewards [0, 1], reward 1
    a = Trajectory(**{**a.__dict__, "reward": 1.0})
    mask = (0, 0, 0, 1, 1)
    b = Trajectory(  # 1 turn, turn reward [0], reward 0
        task_id="t",
        token_ids=(10, 11, 12, 13, 14),
        policy_mask=mask,
        logprobs=tuple(-0.5 * m for m in mask),
        prompt_length=3,
        completion_text="",
        finish_reason="stop",
        turns=(Span(3, 5),),
        turn_rewards=(0.0,),
    )
    # outcome (scale off): rewards [1, 0] -> A = [0.5, -0.5]
    # turn (gamma 1): R = [[1, 1], [0]], mean 2/3 -> [[1/3, 1/3], [-2/3]]
    # bi-level, weight 0.5: a: 0.5 + 1/6 = 2/3 on both turns; b: -0.5 - 1/3 = -5/6
    out = assign_credit([a, b], cfg, "grpo").token_advantages
    assert out[0] == approx([2 / 3, 2 / 3, 0.0, 0.0, 0.0, 2 / 3, 2 / 3], 1e-6)
    assert out[1] == approx([-5 / 6, -5 / 6], 1e-6)


# ------------------------------------------------------------------------------ select_groups
def test_select_none() -> None:
    assert select_groups([0.5, 0.0, 0.2]) == [0, 1, 2]
    assert select_groups([0.5, 0.0, 0.2], drop_zero_std=True) == [0, 2]
    assert select_groups([0.0, 0.0], drop_zero_std=True) == []


def test_select_std_top_k() -> None:
    stds = [0.1, 0.4, 0.0, 0.4, 0.2]
    # ceil(0.5 * 5) = 3 highest: 0.4 (#1), 0.4 (#3), 0.2 (#4), returned in original order
    assert select_groups(stds, "std-top-k", top_k_fraction=0.5) == [1, 3, 4]
    # ceil(0.8 * 5) = 4: adds 0.1 (#0)
    assert select_groups(stds, "std-top-k", top_k_fraction=0.8) == [0, 1, 3, 4]
    # at least one group
    assert select_groups(stds, "std-top-k", top_k_fraction=0.01) == [1]
    # ties keep the earlier group: ceil(0.34 * 3) = 2
    assert select_groups([0.3, 0.3, 0.3], "std-top-k", top_k_fraction=0.34) == [0, 1]
    # all of them, then drop_zero_std removes #2
    assert select_groups(stds, "std-top-k", top_k_fraction=1.0, drop_zero_std=True) == [0, 1, 3, 4]


def test_select_std_top_p_cumulative_rule() -> None:
    stds = [0.1, 0.4, 0.0, 0.3, 0.2]  # total 1.0; ranked #1 0.4, #3 0.3, #4 0.2, #0 0.1, #2 0.0
    # top_p 0.3: 0.4 >= 0.3 after one group
    assert select_groups(stds, "std-top-p", top_p=0.3) == [1]
    # top_p 0.6: 0.4 < 0.6, 0.4 + 0.3 = 0.7 >= 0.6
    assert select_groups(stds, "std-top-p", top_p=0.6) == [1, 3]
    # top_p 0.7: 0.7 reaches it exactly (within tol)
    assert select_groups(stds, "std-top-p", top_p=0.7) == [1, 3]
    # top_p 0.75: 0.7 < 0.75, + 0.2 = 0.9
    assert select_groups(stds, "std-top-p", top_p=0.75) == [1, 3, 4]
    # top_p 1.0: mass 1.0 is reached before the zero-std group
    assert select_groups(stds, "std-top-p", top_p=1.0) == [0, 1, 3, 4]
    # all zero: keep all (no mass to rank), unless zero-std groups are dropped
    assert select_groups([0.0, 0.0, 0.0], "std-top-p", top_p=0.5) == [0, 1, 2]
    assert select_groups([0.0, 0.0, 0.0], "std-top-p", top_p=0.5, drop_zero_std=True) == []


def test_select_unknown_mode() -> None:
    with pytest.raises(ValueError, match="unknown group filter"):
        select_groups([0.1], "std-top-q")


# ------------------------------------------------------------------------------ collect_groups
def traj(reward: float, usable: bool = True) -> Trajectory:
    return Trajectory(
        task_id="t",
        token_ids=(1, 2, 3),
        policy_mask=(0, 1, 1),
        logprobs=(0.0, -1.0, -1.0),
        prompt_length=1,
        completion_text="",
        finish_reason="stop",
        reward=reward,
        reward_errors=() if usable else ("acc",),
    )


def group(name: str, *members: Trajectory) -> Group:
    return Group(task=Task(id=name, messages=()), trajectories=members)


def informative(name: str, a: float = 1.0, b: float = 0.0) -> Group:
    return group(name, traj(a), traj(b))


def flat(name: str, r: float = 1.0) -> Group:
    return group(name, traj(r), traj(r))


class Rounds:
    """A fake sample_round: returns the scripted rounds in order; one call too many fails."""

    def __init__(self, *rounds: list[Group]) -> None:
        self.rounds = list(rounds)
        self.calls = 0

    def __call__(self) -> list[Group]:
        assert self.calls < len(self.rounds), "sampled more rounds than needed"
        self.calls += 1
        return self.rounds[self.calls - 1]


def config(*extra: str) -> RunConfig:
    return load_config(
        None,
        [
            "filter.dynamic_sampling=true",
            "filter.drop_zero_std=true",
            "sampling.prompts_per_step=2",
            "sampling.group_size=2",
            *extra,
        ],
    )


SQRT_HALF = math.sqrt(0.5)  # Bessel std of rewards (1, 0)


def test_dynamic_sampling_continues_until_enough_groups_are_kept() -> None:
    rounds = Rounds(
        [informative("a"), flat("b")],  # keeps a
        [flat("c", 0.0), flat("d")],  # keeps none
        [informative("e", 0.0, 1.0), informative("f", 0.5, 0.0)],  # keeps e, f; capped at 2
    )
    sampled, kept, metrics = collect_groups(config("filter.max_sampling_rounds=5"), rounds)
    assert rounds.calls == 3
    assert [g.task.id for g in sampled] == ["a", "b", "c", "d", "e", "f"]
    assert [g.task.id for g in kept] == ["a", "e"]
    assert metrics["rollout/sampling_rounds"] == 3.0
    assert metrics["rollout/filter_kept_ratio"] == pytest.approx(2 / 6)
    # stds [0.7071, 0, 0, 0, 0.7071, 0.3536 (rewards 0.5, 0)]: mean = (2 * 0.7071 + 0.3536) / 6
    expected_std = (2 * SQRT_HALF + math.sqrt(0.125)) / 6
    assert metrics["rollout/in_group_std"] == pytest.approx(expected_std, abs=1e-6)


def test_dynamic_sampling_stops_after_one_round_when_it_suffices() -> None:
    rounds = Rounds([informative("a"), informative("b")])
    _sampled, kept, metrics = collect_groups(config(), rounds)
    assert rounds.calls == 1
    assert [g.task.id for g in kept] == ["a", "b"]
    assert metrics["rollout/sampling_rounds"] == 1.0
    assert metrics["rollout/filter_kept_ratio"] == 1.0
    assert metrics["rollout/in_group_std"] == pytest.approx(SQRT_HALF, abs=1e-6)


def test_dynamic_sampling_stops_at_max_sampling_rounds() -> None:
    rounds = Rounds(*[[flat(f"{i}a"), flat(f"{i}b", 0.0)] for i in range(3)])
    sampled, kept, metrics = collect_groups(config("filter.max_sampling_rounds=3"), rounds)
    assert rounds.calls == 3
    assert len(sampled) == 6
    assert kept == []
    assert metrics["rollout/sampling_rounds"] == 3.0
    assert metrics["rollout/filter_kept_ratio"] == 0.0
    assert metrics["rollout/in_group_std"] == 0.0


def test_dynamic_sampling_keeps_what_it_found_at_the_cap() -> None:
    rounds = Rounds([flat("a"), informative("b")], [flat("c"), flat("d")])
    _, kept, metrics = collect_groups(config("filter.max_sampling_rounds=2"), rounds)
    assert rounds.calls == 2
    assert [g.task.id for g in kept] == ["b"]
    assert metrics["rollout/filter_kept_ratio"] == pytest.approx(1 / 4)
    assert metrics["rollout/sampling_rounds"] == 2.0


def test_invalid_members_do_not_make_a_group_informative() -> None:
    # group "x": rewards (1.0 invalid, 0.0): one valid reward, std 0 -> dropped
    rounds = Rounds(
        [group("x", traj(1.0, usable=False), traj(0.0)), informative("a")],
        [informative("b"), flat("c")],
    )
    _, kept, metrics = collect_groups(config(), rounds)
    assert [g.task.id for g in kept] == ["a", "b"]
    assert metrics["rollout/sampling_rounds"] == 2.0
    assert metrics["rollout/filter_kept_ratio"] == pytest.approx(2 / 4)


def test_without_dynamic_sampling_one_round_is_filtered() -> None:
    rounds = Rounds([informative("a"), flat("b")])
    cfg = config("filter.dynamic_sampling=false")
    sampled, kept, metrics = collect_groups(cfg, rounds)
    assert rounds.calls == 1
    assert [g.task.id for g in sampled] == ["a", "b"]
    assert [g.task.id for g in kept] == ["a"]
    assert metrics["rollout/sampling_rounds"] == 1.0
    assert metrics["rollout/filter_kept_ratio"] == 0.5
    # no filter at all: everything kept
    rounds = Rounds([informative("a"), flat("b")])
    cfg = config("filter.dynamic_sampling=false", "filter.drop_zero_std=false")
    _, kept, metrics = collect_groups(cfg, rounds)
    assert [g.task.id for g in kept] == ["a", "b"]
    assert metrics["rollout/filter_kept_ratio"] == 1.0


def test_dynamic_sampling_with_std_top_k() -> None:
    # top_k_fraction 0.5 of 2 groups -> the higher-std group of each round; rewards (1, 0) beat
    # (0.5, 0) (std 0.707 > 0.354), so round 1 keeps "a", round 2 keeps "d".
    rounds = Rounds(
        [informative("a"), informative("b", 0.5, 0.0)],
        [informative("c", 0.5, 0.0), informative("d", 0.0, 1.0)],
    )
    cfg = config("filter.group_filter=std-top-k", "filter.top_k_fraction=0.5")
    _, kept, metrics = collect_groups(cfg, rounds)
    assert [g.task.id for g in kept] == ["a", "d"]
    assert metrics["rollout/filter_kept_ratio"] == 0.5
