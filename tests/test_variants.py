"""Hand-worked numbers for the policy-gradient variants: advantages, losses, shaping, credit paths."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr.algorithms import (
    ADVANTAGE_ESTIMATORS,
    ALGORITHMS,
    POLICY_LOSSES,
    aggregate,
    cispo_loss,
    full_reverse_kl,
    gspo_loss,
    ppo_clip_loss,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    truncated_importance_weights,
)
from rlvr.algorithms.shaping import soft_overlong_penalty
from rlvr.config import load_config
from rlvr.errors import ConfigError

T = torch.tensor


# ---------------------------------------------------------------------------------------------- advantages
def test_rloo_baseline_is_the_mean_of_the_others() -> None:
    # Group [1, 0, 0, 1]: a 1 sees others (0 + 0 + 1) / 3 = 1/3 -> A = 2/3; a 0 sees 2/3 -> A = -2/3.
    adv = rloo_advantages(T([1.0, 0.0, 0.0, 1.0]), T([True] * 4), 4)
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_rloo_leaves_invalid_members_out_of_the_baseline() -> None:
    # Member 3 failed to score: the others are [1, 0, 1]; a 1 sees (0 + 1) / 2 -> 0.5; the 0 sees 1 -> -1.
    adv = rloo_advantages(T([1.0, 0.0, 5.0, 1.0]), T([True, True, False, True]), 4)
    assert adv.tolist() == pytest.approx([0.5, -1.0, 0.0, 0.5])
    # A group with one valid member has nothing to compare with.
    assert rloo_advantages(T([1.0, 0.0]), T([True, False]), 2).tolist() == [0.0, 0.0]


def test_reinforce_pp_whitens_over_the_whole_batch() -> None:
    # Batch [1,0,0,1, 1,1,1,1]: mean 0.75; squared deviations 6 * 0.0625 + 2 * 0.5625 = 1.5;
    # unbiased var 1.5 / 7; std 0.46291. A(1) = 0.25 / 0.46291 = 0.54006, A(0) = -1.62019.
    adv = reinforce_pp_advantages(T([1.0, 0, 0, 1, 1, 1, 1, 1]), T([True] * 8), 4)
    std = math.sqrt(1.5 / 7)
    assert adv[0].item() == pytest.approx(0.25 / std, rel=1e-5)
    assert adv[1].item() == pytest.approx(-0.75 / std, rel=1e-5)
    # The all-right group is not zero: REINFORCE++ has no per-prompt baseline.
    assert adv[4].item() == pytest.approx(0.25 / std, rel=1e-5)


def test_reinforce_pp_baseline_centres_per_group_then_scales_by_the_batch_std() -> None:
    # Centred: [.5, -.5, -.5, .5] and [0, 0, 0, 0]; their std over 8 values: sqrt(1 / 7) = 0.37796.
    adv = reinforce_pp_baseline_advantages(T([1.0, 0, 0, 1, 1, 1, 1, 1]), T([True] * 8), 4)
    a = 0.5 / math.sqrt(1 / 7)
    assert adv[:4].tolist() == pytest.approx([a, -a, -a, a], rel=1e-5)
    assert adv[4:].tolist() == [0.0] * 4  # exactly: such rows can be skipped in the update


def test_every_outcome_estimator_accepts_the_loop_call() -> None:
    rewards, valid = T([1.0, 0.0, 0.5, 0.5]), T([True] * 4)
    for name, fn in ADVANTAGE_ESTIMATORS.items():
        out = fn(rewards, valid, 2, scale_rewards=True)
        assert out.shape == (4,), name
        assert torch.isfinite(out).all(), name


# ---------------------------------------------------------------------------------------------- losses
def test_gspo_ratio_and_clip_are_per_sequence() -> None:
    # Tokens logp [-1, -2], old [-1.5, -2.5]: mean log-ratio 0.5, s = e^0.5 = 1.6487 for both tokens.
    logp = T([[-1.0, -2.0]], requires_grad=True)
    old, adv, mask = T([[-1.5, -2.5]]), T([[1.0, 1.0]]), T([[1.0, 1.0]])
    out = gspo_loss(logp, old, adv, mask, epsilon=0.2, epsilon_high=0.2)
    # s > 1.2 with A > 0: clipped at 1.2 for the whole sequence, no gradient.
    assert out.loss_B_T[0].tolist() == pytest.approx([-1.2, -1.2])
    assert out.clipped_high_B_T.tolist() == [[1.0, 1.0]]
    aggregate(out.loss_B_T, mask, "seq-mean-token-mean").backward()
    assert logp.grad is not None and logp.grad.abs().sum() == 0

    # Unclipped (wide range): per token -s*A, and with seq-mean-token-mean the gradient on each token
    # is -s * A / |y|, GSPO's d s_i / d logp_t = s_i / |y|.
    logp = T([[-1.0, -2.0]], requires_grad=True)
    out = gspo_loss(logp, old, adv, mask, epsilon=0.9, epsilon_high=10.0)
    s = math.exp(0.5)
    assert out.loss_B_T[0].tolist() == pytest.approx([-s, -s], rel=1e-6)
    aggregate(out.loss_B_T, mask, "seq-mean-token-mean").backward()
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([-s / 2, -s / 2], rel=1e-6)


def test_gspo_ignores_masked_tokens_in_the_sequence_ratio() -> None:
    logp, adv = T([[-1.0, -2.0, -9.0]]), T([[1.0, 1.0, 0.0]])
    old = T([[-1.5, -2.5, -1.0]])  # the masked third token's big log-ratio must not count
    out = gspo_loss(logp, old, adv, T([[1.0, 1.0, 0.0]]), epsilon=0.9, epsilon_high=10.0)
    assert out.loss_B_T[0, 0].item() == pytest.approx(-math.exp(0.5), rel=1e-6)


def test_cispo_keeps_the_gradient_of_clipped_tokens_with_a_truncated_weight() -> None:
    # ratio e^0.5 = 1.6487 > 1.28: weight 1.28, loss -1.28 * A * logp; the gradient is -1.28 * A
    # (PPO-clip would give 0 here).
    logp = T([[-1.0]], requires_grad=True)
    out = cispo_loss(logp, T([[-1.5]]), T([[2.0]]), None, epsilon=1.0, epsilon_high=0.28)
    assert out.loss_B_T.item() == pytest.approx(-1.28 * 2.0 * -1.0)
    assert out.clipped_high_B_T.item() == 1.0
    out.loss_B_T.sum().backward()
    assert logp.grad is not None and logp.grad.item() == pytest.approx(-1.28 * 2.0)

    ppo_logp = T([[-1.0]], requires_grad=True)
    ppo_clip_loss(
        ppo_logp, T([[-1.5]]), T([[2.0]]), epsilon=0.2, epsilon_high=0.28
    ).loss_B_T.sum().backward()
    assert ppo_logp.grad is not None and ppo_logp.grad.item() == 0.0


def test_on_policy_every_loss_is_the_reinforce_gradient() -> None:
    # ratio == 1 (old = current, detached): grad of each token = -A (token-mean over 3 tokens: -A/3).
    for name, fn in POLICY_LOSSES.items():
        logp = T([[-0.5, -1.0, -2.0]], requires_grad=True)
        adv, mask = T([[1.0, -2.0, 0.5]]), T([[1.0, 1.0, 1.0]])
        out = fn(logp, logp.detach(), adv, mask, epsilon=0.2, epsilon_high=0.28)
        aggregate(out.loss_B_T, mask, "token-mean").backward()
        assert logp.grad is not None
        assert logp.grad[0].tolist() == pytest.approx([-1 / 3, 2 / 3, -0.5 / 3], rel=1e-6), name


def test_truncated_importance_weights_cap_the_ratio() -> None:
    w = truncated_importance_weights(T([[0.0, -1.0, 0.0]]), T([[0.0, 0.0, -2.0]]), cap=2.0)
    assert w[0].tolist() == pytest.approx([1.0, math.exp(-1.0), 2.0])
    assert not w.requires_grad


def test_full_reverse_kl_by_hand() -> None:
    # p_s = [.5, .5], p_t = [.25, .75]: .5 ln(.5/.25) + .5 ln(.5/.75) = .5 * .693147 - .5 * .405465
    student = torch.log(T([[[0.5, 0.5]]]))
    teacher = torch.log(T([[[0.25, 0.75]]]))
    assert full_reverse_kl(student, teacher).item() == pytest.approx(0.143841, abs=1e-6)
    assert full_reverse_kl(teacher, teacher).item() == pytest.approx(0.0, abs=1e-7)


def test_soft_overlong_penalty_by_hand() -> None:
    # L_max 10, buffer 4: free up to 6, then -(L - 6) / 4, -1 at and past 10.
    out = soft_overlong_penalty(T([5, 6, 8, 10, 12]), 10.0, 4.0, penalty=1.0)
    assert out.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    assert soft_overlong_penalty(T([9]), 10.0, 4.0, penalty=0.5).item() == pytest.approx(-0.375)


# ---------------------------------------------------------------------------------------------- config
def test_every_algorithm_is_one_object_the_config_finds_by_name() -> None:
    for name, algorithm in ALGORITHMS.items():
        assert algorithm.loss in POLICY_LOSSES.values(), name
        assert algorithm.advantage is not None or algorithm.token_credit == "gae", name
        cfg = load_config(None, [f"algorithm={name}", "distill.teacher=tiny-random"])
        for section, values in algorithm.defaults.items():  # its paper's settings, applied
            for key, value in values.items():
                assert getattr(getattr(cfg, section), key) == value, (name, section, key)


def test_algorithm_defaults_apply_and_user_values_win() -> None:
    cfg = load_config(None, ["algorithm=dapo"])
    assert cfg.objective.epsilon_high == 0.28
    assert cfg.objective.overlong_buffer_fraction == 0.2
    assert cfg.filter.dynamic_sampling and cfg.filter.drop_zero_std
    cfg = load_config(
        None, ["algorithm=dapo", "objective.epsilon_high=0.3", "filter.dynamic_sampling=false"]
    )
    assert cfg.objective.epsilon_high == 0.3 and not cfg.filter.dynamic_sampling
    cfg = load_config(None, ["algorithm=dr_grpo"])
    assert cfg.objective.scale_rewards == "none"
    assert cfg.objective.loss_aggregation == "seq-mean-token-sum-norm"
    cfg = load_config(None, ["algorithm=gspo"])
    assert (cfg.objective.epsilon, cfg.objective.epsilon_high) == (3e-4, 4e-4)


def test_unknown_algorithm_lists_the_valid_names() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm=grpoo"])
    message = str(err.value)
    assert "algorithm 'grpoo' is not a known algorithm (one of: grpo, dr_grpo," in message
    for name in ALGORITHMS:
        assert name in message
    assert "'file.py:Name'" in message
    assert "\n" not in message


def test_algorithm_specific_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"distill\.teacher"):
        load_config(None, ["algorithm=distill"])
    with pytest.raises(ConfigError, match="credit is not used by ppo"):
        load_config(None, ["algorithm=ppo", "objective.credit=turn"])
