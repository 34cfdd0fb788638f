"""Hand-worked unit tests for the pure tensor algorithms: advantages, PPO-clip, KL, aggregation.

Every expected number is worked out by hand in the comment next to its assert.
"""

from __future__ import annotations

import pytest
import torch

from rlvr.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    ALGORITHMS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    aggregate,
    group_reward_std,
    grpo_advantages,
    ppo_clip_loss,
)


def close(actual: torch.Tensor, expected: list[float] | float, tol: float = 1e-5) -> None:
    torch.testing.assert_close(
        actual, torch.tensor(expected, dtype=actual.dtype), rtol=0.0, atol=tol
    )


# --- GRPO
TWO_GROUPS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 8.0])
ALL_VALID = torch.ones(8, dtype=torch.bool)


def test_grpo_two_groups_scaled() -> None:
    adv = grpo_advantages(TWO_GROUPS, ALL_VALID, group_size=4, eps=0.0)
    # group [1, 0, 0, 1]: mean 0.5, std (Bessel) = sqrt(4 * 0.25 / 3) = 0.57735;
    #   A = +-0.5 / 0.57735 = +-0.86603
    # group [2, 4, 6, 8]: mean 5, deviations -3, -1, 1, 3, std = sqrt((9+1+1+9) / 3) = 2.58199;
    #   A = -3/2.58199, -1/2.58199, ... = -1.16190, -0.38730, 0.38730, 1.16190
    close(adv, [0.86603, -0.86603, -0.86603, 0.86603, -1.16190, -0.38730, 0.38730, 1.16190])


def test_grpo_default_eps_is_added_to_std() -> None:
    adv = grpo_advantages(TWO_GROUPS[:4], ALL_VALID[:4], group_size=4)
    # std 0.57735 + eps 1e-4 = 0.57745; A = 0.5 / 0.57745 = 0.86588
    close(adv, [0.86588, -0.86588, -0.86588, 0.86588])


def test_grpo_two_groups_unscaled() -> None:
    adv = grpo_advantages(TWO_GROUPS, ALL_VALID, group_size=4, scale_rewards=False)
    # Dr.GRPO: only the group mean is subtracted. [1,0,0,1] - 0.5; [2,4,6,8] - 5
    close(adv, [0.5, -0.5, -0.5, 0.5, -3.0, -1.0, 1.0, 3.0])


def test_grpo_zero_variance_group_is_exactly_zero() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    adv = grpo_advantages(rewards, torch.ones(12), group_size=4)
    # [1,1,1,1] and [0,0,0,0]: r - mean = 0 exactly, 0 / (0 + eps) = 0
    assert torch.equal(adv[:8], torch.zeros(8))
    # [1,0,1,1]: mean 0.75, std = sqrt((3 * 0.0625 + 0.5625) / 3) = sqrt(0.25) = 0.5;
    #   A = 0.25 / 0.5001 = 0.49990, -0.75 / 0.5001 = -1.49970
    close(adv[8:], [0.49990, -1.49970, 0.49990, 0.49990])
    # and so are the unscaled ones
    assert torch.equal(
        grpo_advantages(rewards, torch.ones(12), 4, scale_rewards=False)[:8], adv[:8]
    )


def test_grpo_zero_variance_group_with_non_dyadic_reward_is_exactly_zero() -> None:
    # rubric totals such as 0.7 (weighted sums) are not exact in float32: 8 * 0.7 / 8 != 0.7
    rewards = torch.full((8,), 0.7)
    adv = grpo_advantages(rewards, torch.ones(8), group_size=8)
    # all members equal: r - mean should be 0, so A = 0 / (0 + eps) = 0
    assert torch.equal(adv, torch.zeros(8))


def test_grpo_invalid_member_is_excluded_and_gets_zero() -> None:
    rewards = torch.tensor([1.0, 0.0, 5.0, 1.0])
    valid = torch.tensor([1, 1, 0, 1])
    adv = grpo_advantages(rewards, valid, group_size=4, eps=0.0)
    # valid [1, 0, 1]: mean 2/3; deviations 1/3, -2/3, 1/3; sum sq = 1/9 + 4/9 + 1/9 = 2/3;
    #   std = sqrt((2/3) / (3 - 1)) = sqrt(1/3) = 0.57735
    #   A = (1/3) / 0.57735 = 0.57735, (-2/3) / 0.57735 = -1.15470; the invalid member gets 0
    close(adv, [0.57735, -1.15470, 0.0, 0.57735])
    assert adv[2].item() == 0.0
    # The invalid reward (5.0) moved nothing: the same as the group [1, 0, 1] alone (G = 3).
    alone = grpo_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.ones(3), group_size=3, eps=0.0)
    close(adv[[0, 1, 3]], alone.tolist())
    unscaled = grpo_advantages(rewards, valid, group_size=4, scale_rewards=False)
    # 1 - 2/3 = 0.33333, 0 - 2/3 = -0.66667
    close(unscaled, [0.33333, -0.66667, 0.0, 0.33333])


def test_grpo_single_valid_member_and_all_invalid_group() -> None:
    rewards = torch.tensor([3.0, 9.0, 9.0, 9.0, 9.0])
    valid = torch.tensor([1, 0, 0, 0, 0])
    adv = grpo_advantages(rewards[:4], valid[:4], group_size=2)
    # group [3, (9)]: one valid member, mean 3, std 0 -> A = 0 / eps = 0; group [(9), (9)]: all 0
    assert torch.equal(adv, torch.zeros(4))
    assert not torch.isnan(adv).any()


def test_grpo_wrong_size_raises() -> None:
    # 5 rewards do not split into groups of 4
    with pytest.raises(ValueError, match="groups of 4"):
        grpo_advantages(torch.zeros(5), torch.ones(5), group_size=4)


def test_group_reward_std() -> None:
    std = group_reward_std(TWO_GROUPS, ALL_VALID, group_size=4)
    # as in test_grpo_two_groups_scaled: sqrt(1/3) = 0.57735 and sqrt(20/3) = 2.58199
    close(std, [0.57735, 2.58199])


# --- PPO
def test_ppo_ratio_inside_clip_range() -> None:
    logp = torch.tensor([[-1.0, -2.0]])
    old = torch.tensor([[-1.1, -1.9]])
    adv = torch.tensor([[2.0, -1.0]])
    out = ppo_clip_loss(logp, old, adv, epsilon=0.2)
    # ratio = exp(0.1) = 1.10517 and exp(-0.1) = 0.90484, both inside [0.8, 1.2]:
    #   loss = -ratio * A = -2.21034 and +0.90484
    close(out.loss_B_T, [[-2.21034, 0.90484]])
    assert out.clipped_low_B_T.sum() == 0 and out.clipped_high_B_T.sum() == 0


def test_ppo_on_policy_ratio_one() -> None:
    logp = torch.tensor([[-0.3, -4.0, -1.0]])
    adv = torch.tensor([[1.5, -2.0, 0.0]])
    out = ppo_clip_loss(logp, logp.clone(), adv)
    # ratio exactly 1: loss = -A
    close(out.loss_B_T, [[-1.5, 2.0, 0.0]], tol=0.0)


def test_ppo_clipping_both_sides_and_counters() -> None:
    # log-ratio per column: +0.5, -0.5, +0.5, -0.5
    logp = torch.tensor([[0.0, -1.0, 0.0, -1.0]])
    old = torch.tensor([[-0.5, -0.5, -0.5, -0.5]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    out = ppo_clip_loss(logp, old, adv, epsilon=0.2)
    # col 0: ratio exp(0.5) = 1.64872 > 1.2, A = 1 > 0: min(1.64872, 1.2) = 1.2 -> loss -1.2, high
    # col 1: ratio exp(-0.5) = 0.60653 < 0.8, A = -1: min(-0.60653, -0.8) = -0.8 -> loss 0.8, low
    # col 2: ratio 1.64872 but A = -1: min(-1.64872, -1.2) = -1.64872 -> loss 1.64872, not clipped
    # col 3: ratio 0.60653 but A = +1: min(0.60653, 0.8) = 0.60653 -> loss -0.60653, not clipped
    close(out.loss_B_T, [[-1.2, 0.8, 1.64872, -0.60653]])
    close(out.clipped_high_B_T, [[1.0, 0.0, 0.0, 0.0]], tol=0.0)
    close(out.clipped_low_B_T, [[0.0, 1.0, 0.0, 0.0]], tol=0.0)


def test_ppo_asymmetric_epsilon_high() -> None:
    # log-ratio 0.2 (ratio 1.22140), 0.25 (ratio 1.28403), A = 1; then log-ratio -0.25, A = -1
    logp = torch.tensor([[0.2, 0.25, -0.25]])
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    sym = ppo_clip_loss(logp, old, adv, epsilon=0.2)
    # symmetric: 1.22140 > 1.2 -> -1.2 (high); 1.28403 > 1.2 -> -1.2 (high);
    #   ratio exp(-0.25) = 0.77880 < 0.8, A < 0: min(-0.77880, -0.8) = -0.8 -> 0.8 (low)
    close(sym.loss_B_T, [[-1.2, -1.2, 0.8]])
    close(sym.clipped_high_B_T, [[1.0, 1.0, 0.0]], tol=0.0)
    dapo = ppo_clip_loss(logp, old, adv, epsilon=0.2, epsilon_high=0.28)
    # clip range [0.8, 1.28]: 1.22140 is inside -> -1.22140; 1.28403 > 1.28 -> -1.28 (high);
    #   the lower bound is unchanged: 0.8 (low)
    close(dapo.loss_B_T, [[-1.22140, -1.28, 0.8]])
    close(dapo.clipped_high_B_T, [[0.0, 1.0, 0.0]], tol=0.0)
    close(dapo.clipped_low_B_T, [[0.0, 0.0, 1.0]], tol=0.0)


def test_ppo_gradient_zero_where_clipped_minus_a_ratio_elsewhere() -> None:
    old = torch.tensor([[-0.5, -0.5, -0.5, -0.5, -0.5]])
    logp = torch.tensor([[0.0, -1.0, 0.0, -1.0, -0.4]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 3.0]])
    out = ppo_clip_loss(logp, old, adv, epsilon=0.2)
    out.loss_B_T.sum().backward()
    assert logp.grad is not None
    # cols 0, 1 are clipped (see test_ppo_clipping_both_sides_and_counters): gradient exactly 0.
    # d(-ratio * A)/d logp = -A * ratio elsewhere:
    #   col 2: -(-1) * 1.64872 = 1.64872; col 3: -(1) * 0.60653 = -0.60653;
    #   col 4: ratio exp(0.1) = 1.10517, -(3) * 1.10517 = -3.31551
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() == 0.0
    close(logp.grad, [[0.0, 0.0, 1.64872, -0.60653, -3.31551]])


# --- KL
def test_kl_estimators_hand_values() -> None:
    logp = torch.tensor([-1.0, -1.5])
    ref = torch.tensor([-1.5, -1.0])
    # col 0: log_r = ref - logp = -0.5; col 1: log_r = +0.5
    # k1 = -log_r = 0.5, -0.5
    close(KL_ESTIMATORS["k1"](logp, ref), [0.5, -0.5])
    # k2 = log_r^2 / 2 = 0.125, 0.125
    close(KL_ESTIMATORS["k2"](logp, ref), [0.125, 0.125])
    # k3 = exp(log_r) - 1 - log_r: exp(-0.5) - 1 + 0.5 = 0.60653 - 0.5 = 0.10653;
    #   exp(0.5) - 1 - 0.5 = 1.64872 - 1.5 = 0.14872
    close(KL_ESTIMATORS["k3"](logp, ref), [0.10653, 0.14872])


def test_kl_estimators_signs_and_zero_when_equal() -> None:
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(64, generator=gen) * 5
    ref = -torch.rand(64, generator=gen) * 5
    assert (KL_ESTIMATORS["k2"](logp, ref) >= 0).all()
    assert (KL_ESTIMATORS["k3"](logp, ref) >= 0).all()
    assert (KL_ESTIMATORS["k1"](logp, ref) < 0).any()  # k1 may go negative per token
    for name in ("k1", "k2", "k3"):
        # log_r = 0: k1 = 0, k2 = 0, k3 = exp(0) - 1 - 0 = 0
        assert torch.equal(KL_ESTIMATORS[name](logp, logp), torch.zeros(64)), name


# --- aggregate
LOSS_2x3 = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK_2x3 = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_aggregate_modes_by_hand() -> None:
    # token-mean: (1 + 2 + 4) / 3 tokens = 2.33333
    close(aggregate(LOSS_2x3, MASK_2x3, "token-mean"), 7 / 3)
    # seq-mean-token-mean: row 0 (1 + 2) / 2 = 1.5, row 1 4 / 1 = 4; (1.5 + 4) / 2 = 2.75
    close(aggregate(LOSS_2x3, MASK_2x3, "seq-mean-token-mean"), 2.75)
    # seq-mean-token-sum-norm: 7 / (2 sequences * T = 3) = 1.16667
    close(aggregate(LOSS_2x3, MASK_2x3, "seq-mean-token-sum-norm"), 7 / 6)
    # ... with norm_length 4: 7 / (2 * 4) = 0.875
    close(aggregate(LOSS_2x3, MASK_2x3, "seq-mean-token-sum-norm", norm_length=4.0), 0.875)
    # the masked entries (3, 5, 6) never count; an integer mask works the same
    close(aggregate(LOSS_2x3, MASK_2x3.long(), "token-mean"), 7 / 3)


def test_aggregate_with_explicit_totals() -> None:
    # token-mean with total_tokens 10: 7 / 10 = 0.7
    close(aggregate(LOSS_2x3, MASK_2x3, "token-mean", total_tokens=10.0), 0.7)
    # seq-mean-token-mean with 4 sequences in all: (1.5 + 4) / 4 = 1.375
    close(aggregate(LOSS_2x3, MASK_2x3, "seq-mean-token-mean", total_sequences=4.0), 1.375)
    # seq-mean-token-sum-norm: 7 / (4 * 3) = 0.58333
    close(aggregate(LOSS_2x3, MASK_2x3, "seq-mean-token-sum-norm", total_sequences=4.0), 7 / 12)


def test_aggregate_empty_mask_is_zero_not_nan() -> None:
    zero_mask = torch.zeros(2, 3)
    for mode in AGGREGATIONS:
        # sum 0 / clamp(count, 1) = 0
        assert aggregate(LOSS_2x3, zero_mask, mode).item() == 0.0, mode


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregate_micro_batches_sum_to_full_batch(mode: str) -> None:
    gen = torch.Generator().manual_seed(1)
    loss = torch.randn(4, 5, generator=gen)
    mask = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [0, 1, 1, 1, 0]], dtype=torch.float32
    )
    full = aggregate(loss, mask, mode)
    totals = {"total_tokens": float(mask.sum()), "total_sequences": 4.0}
    split = aggregate(loss[:2], mask[:2], mode, **totals) + aggregate(
        loss[2:], mask[2:], mode, **totals
    )
    torch.testing.assert_close(split, full)
    # Micro-batches padded to their own (different) widths, as collate does: the same sum, given
    # the constant normaliser explicitly (the loop passes norm_length = max_new_tokens).
    norm = {"norm_length": 5.0} if mode == "seq-mean-token-sum-norm" else {}
    ragged = aggregate(loss[:2], mask[:2], mode, **totals, **norm) + aggregate(
        loss[2:, :4], mask[2:, :4], mode, **totals, **norm
    )
    torch.testing.assert_close(ragged, full)


def test_aggregate_unknown_mode_raises() -> None:
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(LOSS_2x3, MASK_2x3, "sum")


# --- registry
def test_algorithm_registry_points_at_registered_functions() -> None:
    algorithm = ALGORITHMS["grpo"]
    assert algorithm.loss is ppo_clip_loss
    assert algorithm.description
    assert ADVANTAGE_ESTIMATORS["grpo"] is grpo_advantages
    for name, other in ALGORITHMS.items():
        assert other.name == name
        # ppo has no outcome advantage: per-token advantages from the critic
        assert (other.advantage is None) == (other.token_credit == "gae")
        assert other.loss in POLICY_LOSSES.values()
    assert set(KL_ESTIMATORS) >= {"k1", "k2", "k3"}
