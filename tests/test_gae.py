"""Hand-worked tests for PPO's critic-side pieces (rlvr.algorithms.gae): token-level rewards, GAE,
whitening, the clipped value loss and REINFORCE++ returns.

Every expected number is worked out by hand in the comment next to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from rlvr.algorithms.gae import (
    gae_advantages,
    reinforce_pp_returns,
    token_level_rewards,
    turn_reward_positions,
    value_loss,
    whiten,
)
from rlvr.records import Span, Trajectory


def t(rows: Sequence[Sequence[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, expected, atol=tol, rtol=0.0)


# ------------------------------------------------------------------------------------------ GAE
def test_gae_by_hand() -> None:
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72); r = [0, 0.5, 0, 1], V = [0.2, 0.4, 0.1, 0.5]
    #   delta3 = 1 + 0.9 * 0 - 0.5             = 0.5        (terminal: V after the last token = 0)
    #   delta2 = 0 + 0.9 * 0.5 - 0.1           = 0.35
    #   delta1 = 0.5 + 0.9 * 0.1 - 0.4         = 0.19
    #   delta0 = 0 + 0.9 * 0.4 - 0.2           = 0.16
    #   A3 = 0.5
    #   A2 = 0.35 + 0.72 * 0.5    = 0.71
    #   A1 = 0.19 + 0.72 * 0.71   = 0.7012
    #   A0 = 0.16 + 0.72 * 0.7012 = 0.664864
    #   R = A + V = [0.864864, 1.1012, 0.81, 1.0]
    adv, ret = gae_advantages(
        t([[0.0, 0.5, 0.0, 1.0]]), t([[0.2, 0.4, 0.1, 0.5]]), t([[1, 1, 1, 1]]), 0.9, 0.8
    )
    close(adv, t([[0.664864, 0.7012, 0.71, 0.5]]))
    close(ret, t([[0.864864, 1.1012, 0.81, 1.0]]))


def monte_carlo(rewards: list[float], gamma: float) -> list[float]:
    out, running = [0.0] * len(rewards), 0.0
    for k in range(len(rewards) - 1, -1, -1):
        running = rewards[k] + gamma * running
        out[k] = running
    return out


def test_lambda_one_is_monte_carlo_minus_values_and_lambda_zero_is_td() -> None:
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(3, 6, generator=gen)
    values = torch.randn(3, 6, generator=gen)
    mask = torch.ones(3, 6)
    adv1, ret1 = gae_advantages(rewards, values, mask, 0.9, 1.0)
    mc = t([monte_carlo(row, 0.9) for row in rewards.tolist()])
    close(adv1, mc - values, 1e-5)
    close(ret1, mc, 1e-5)  # lam = 1: the critic's target is the Monte-Carlo return
    adv0, _ = gae_advantages(rewards, values, mask, 0.9, 0.0)
    next_values = torch.cat([values[:, 1:], torch.zeros(3, 1)], dim=1)
    close(adv0, rewards + 0.9 * next_values - values, 1e-6)


def test_masked_positions_are_skipped_exactly() -> None:
    # [p p o o p]: the observation tokens carry arbitrary values (the critic's output there) and no
    # reward; the row must give the numbers of [p p p] with the observations removed.
    r_full = t([[0.0, 0.3, 0.0, 0.0, 1.0]])
    v_full = t([[0.2, 0.4, 99.0, -7.0, 0.5]])
    m_full = t([[1, 1, 0, 0, 1]])
    adv, ret = gae_advantages(r_full, v_full, m_full, 0.9, 0.8)
    adv3, ret3 = gae_advantages(
        t([[0.0, 0.3, 1.0]]), t([[0.2, 0.4, 0.5]]), t([[1, 1, 1]]), 0.9, 0.8
    )
    keep = [0, 1, 4]
    close(adv[:, keep], adv3)
    close(ret[:, keep], ret3)
    close(adv[:, [2, 3]], torch.zeros(1, 2))
    close(ret[:, [2, 3]], torch.zeros(1, 2))
    # by hand: delta2 = 1 - 0.5 = 0.5; delta1 = 0.3 + 0.9 * 0.5 - 0.4 = 0.35 -> A1 = 0.35 + 0.72 * 0.5
    # = 0.71; delta0 = 0.9 * 0.4 - 0.2 = 0.16 -> A0 = 0.16 + 0.72 * 0.71 = 0.6712
    close(adv3, t([[0.6712, 0.71, 0.5]]))


def test_padding_rows_match_each_row_alone() -> None:
    gen = torch.Generator().manual_seed(1)
    lengths = [4, 1, 0, 6]  # row 2 is all padding
    rewards = torch.zeros(4, 6)
    values = torch.randn(4, 6, generator=gen)  # garbage on padding: must not matter
    mask = torch.zeros(4, 6)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
        if n:
            rewards[b, n - 1] = float(b + 1)
    adv, ret = gae_advantages(rewards, values, mask, 0.95, 0.9)
    for b, n in enumerate(lengths):
        alone_adv, alone_ret = gae_advantages(
            rewards[b : b + 1, :n], values[b : b + 1, :n], mask[b : b + 1, :n], 0.95, 0.9
        )
        close(adv[b : b + 1, :n], alone_adv)
        close(ret[b : b + 1, :n], alone_ret)
        assert not adv[b, n:].any() and not ret[b, n:].any()
    # one token: A = r - V, R = r
    close(adv[1, :1], rewards[1, :1] - values[1, :1])
    close(ret[1, :1], rewards[1, :1])


def test_rewards_on_masked_positions_raise() -> None:
    with pytest.raises(ValueError, match="masked position"):
        gae_advantages(t([[0.0, 1.0, 0.0]]), t([[0.0, 0.0, 0.0]]), t([[1, 0, 1]]), 0.9, 0.8)
    with pytest.raises(ValueError, match="masked position"):
        reinforce_pp_returns(t([[0.0, 0.0, 2.0]]), t([[1, 1, 0]]), 0.9)


def test_gae_has_no_gradient() -> None:
    values = t([[0.1, 0.2]]).requires_grad_()
    adv, ret = gae_advantages(t([[0.0, 1.0]]), values, t([[1, 1]]), 1.0, 1.0)
    assert not adv.requires_grad and not ret.requires_grad


# ------------------------------------------------------------------------------------ REINFORCE++
def test_reinforce_pp_returns_by_hand() -> None:
    # gamma 0.9, row [p o p p] with r = [0.5, 0, 0, 1]; over policy tokens r = [0.5, 0, 1]:
    #   G3 = 1; G2 = 0 + 0.9 * 1 = 0.9; G0 = 0.5 + 0.9 * 0.9 = 1.31; the observation gets 0
    # row 2 is [p p pad pad] with r = [2, 0]: G = [2, 0]
    rewards = t([[0.5, 0.0, 0.0, 1.0], [2.0, 0.0, 0.0, 0.0]])
    mask = t([[1, 0, 1, 1], [1, 1, 0, 0]])
    close(
        reinforce_pp_returns(rewards, mask, 0.9), t([[1.31, 0.0, 0.9, 1.0], [2.0, 0.0, 0.0, 0.0]])
    )
    # gamma 1: suffix sums
    close(reinforce_pp_returns(rewards, mask, 1.0), t([[1.5, 0.0, 1.0, 1.0], [2.0, 0.0, 0.0, 0.0]]))


# ------------------------------------------------------------------------------------------ whiten
def test_whiten_by_hand() -> None:
    # over [1, 2, 3] (the 100 is masked): mean 2, Bessel var (1 + 0 + 1) / 2 = 1 -> [-1, 0, 1]
    x = t([[1.0, 2.0], [3.0, 100.0]])
    mask = t([[1, 1], [1, 0]])
    close(whiten(x, mask), t([[-1.0, 0.0], [1.0, 0.0]]), 1e-6)
    # shift_mean False keeps the mean: [1, 2, 3] / 1 -> same values, masked stays 0
    close(whiten(x, mask, shift_mean=False), t([[1.0, 2.0], [3.0, 0.0]]), 1e-6)
    # scale: x = [0, 4] -> mean 2, var (4 + 4) / 1 = 8 -> [-2, 2] / sqrt(8) = [-0.7071, 0.7071]
    close(whiten(t([[0.0, 4.0]]), t([[1, 1]])), t([[-(0.5**0.5), 0.5**0.5]]), 1e-6)
    # a single token: centred to 0, not a division by zero
    close(whiten(t([[5.0, 1.0]]), t([[1, 0]])), t([[0.0, 0.0]]))


# -------------------------------------------------------------------------------------- value loss
def test_value_loss_clipping_by_hand() -> None:
    # clip 0.2, V_old = 0.5 everywhere:
    #   tok0: V 1.0, R 2.0: (V-R)^2 = 1; V_clip = 0.5 + 0.2 = 0.7, (0.7-2)^2 = 1.69 -> 0.845, clipped
    #   tok1: V 0.0, R 1.0: (V-R)^2 = 1; V_clip = 0.5 - 0.2 = 0.3, (0.3-1)^2 = 0.49 -> 0.5, not clipped
    #   tok2: V 0.5, R -1: (1.5)^2 = 2.25 both ways -> 1.125, not clipped (equal is not worse)
    #   tok3: masked -> 0
    values = t([[1.0, 0.0, 0.5, 3.0]]).requires_grad_()
    old = t([[0.5, 0.5, 0.5, 0.5]])
    returns = t([[2.0, 1.0, -1.0, 0.0]])
    mask = t([[1, 1, 1, 0]])
    loss, clipped = value_loss(values, old, returns, mask, 0.2)
    close(loss, t([[0.845, 0.5, 1.125, 0.0]]))
    close(clipped, t([[1.0, 0.0, 0.0, 0.0]]))
    # gradient of the sum: clipped tok0 gets 0 (the clipped branch is flat); else V - R = [-1, 1.5]
    loss.sum().backward()
    assert values.grad is not None
    close(values.grad, t([[0.0, -1.0, 1.5, 0.0]]))
    # no clipping: 0.5 * (V - R)^2 = [0.5, 0.5, 1.125, 0]
    loss_nc, clipped_nc = value_loss(values.detach(), old, returns, mask, None)
    close(loss_nc, t([[0.5, 0.5, 1.125, 0.0]]))
    assert not clipped_nc.any()


# ---------------------------------------------------------------------------- token-level rewards
def test_token_level_rewards_placement_with_turns_and_kl() -> None:
    # row 0: turn 1 at [0, 2), observation [2, 4), turn 2 at [4, 6), padding 6
    # row 1: single turn of 3 tokens; row 2: all padding
    mask = t([[1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0], [0] * 7])
    outcome = t([1.0, -1.0, 0.0])
    kl = torch.full((3, 7), 0.2)
    # KL in the reward: -0.5 * 0.2 = -0.1 on every policy token
    # row 0: turn rewards 0.25 at position 1, 0.5 at 5; outcome 1 at 5 -> 1 + 0.5 - 0.1 = 1.4
    # row 1: outcome -1 at position 2 -> -1.1
    rewards = token_level_rewards(mask, outcome, [[(1, 0.25), (5, 0.5)], [], []], kl, 0.5)
    close(
        rewards,
        t(
            [
                [-0.1, 0.15, 0.0, 0.0, -0.1, 1.4, 0.0],
                [-0.1, -0.1, -1.1, 0.0, 0.0, 0.0, 0.0],
                [0.0] * 7,
            ]
        ),
    )
    # outcome only
    close(
        token_level_rewards(mask, outcome),
        t([[0, 0, 0, 0, 0, 1.0, 0], [0, 0, -1.0, 0, 0, 0, 0], [0.0] * 7]),
    )
    # GAE accepts them (nothing sits on a masked position)
    gae_advantages(rewards, torch.zeros(3, 7), mask, 1.0, 1.0)


def test_token_level_rewards_reject_lost_rewards() -> None:
    mask = t([[1, 1, 0, 1], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match="not a policy token"):  # position 2 is an observation
        token_level_rewards(mask, t([0.0, 0.0]), [[(2, 1.0)], []])
    with pytest.raises(ValueError, match="not a policy token"):
        token_level_rewards(mask, t([0.0, 0.0]), [[(9, 1.0)], []])
    with pytest.raises(ValueError, match="without policy tokens"):
        token_level_rewards(mask, t([0.0, 1.0]))


def test_turn_reward_positions_from_a_trajectory() -> None:
    # prompt 3 tokens; completion: turn [3, 5), observation [5, 7), turn [7, 9), glue 9
    # -> completion positions of the turns' last tokens: 4 - 3 = 1 and 8 - 3 = 5
    traj = Trajectory(
        task_id="x",
        token_ids=tuple(range(10)),
        policy_mask=(0, 0, 0, 1, 1, 0, 0, 1, 1, 0),
        logprobs=(0.0,) * 10,
        prompt_length=3,
        completion_text="",
        finish_reason="stop",
        turns=(Span(3, 5), Span(7, 9)),
        turn_rewards=(0.25, 0.5),
        reward=0.75,
    )
    assert turn_reward_positions(traj) == [(1, 0.25), (5, 0.5)]
    mask = t([list(traj.policy_mask[3:])])
    rewards = token_level_rewards(mask, t([0.0]), [turn_reward_positions(traj)])
    close(rewards, t([[0, 0.25, 0, 0, 0, 0.5, 0]]))
