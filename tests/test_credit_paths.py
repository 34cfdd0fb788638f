"""assign_credit's algorithm paths, by hand: KL in the reward, DAPO shaping,
token-level REINFORCE++ and PPO's GAE. Every expected number is worked out in the comment beside it."""

from __future__ import annotations

import math

import pytest

from rlvr.config import RunConfig, load_config
from rlvr.records import Span, Trajectory
from rlvr.train.selection import assign_credit


def traj(
    reward: float,
    mask: tuple[int, ...],
    *,
    turns: tuple[Span, ...] = (),
    turn_rewards: tuple[float, ...] = (),
    logprobs: tuple[float, ...] | None = None,
    finish: str = "stop",
    prompt: int = 2,
) -> Trajectory:
    n = prompt + len(mask)
    lp = logprobs if logprobs is not None else tuple(-1.0 if m else 0.0 for m in mask)
    return Trajectory(
        task_id="t",
        token_ids=tuple(range(n)),
        policy_mask=(0,) * prompt + mask,
        logprobs=(0.0,) * prompt + lp,
        prompt_length=prompt,
        completion_text="",
        finish_reason=finish,  # type: ignore[arg-type]
        turns=turns or (Span(prompt, n),),
        reward=reward,
        turn_rewards=turn_rewards or (reward,),
    )


def cfg(*overrides: str) -> RunConfig:
    return load_config(None, ["sampling.group_size=2", *overrides])


def test_kl_in_the_reward_lowers_the_outcome_before_the_group_baseline() -> None:
    # Two samples, reward 1 each; behaviour logp -1 on 2 tokens; reference logp [-1, -1] for the
    # first (k1 = 0) and [-2, -3] for the second (k1 = 1 + 2 = 3). beta 0.1: rewards 1 and 0.7;
    # Dr.GRPO (no std): mean 0.85, A = +0.15 / -0.15.
    trajs = [traj(1.0, (1, 1)), traj(1.0, (1, 1))]
    c = cfg(
        "algorithm=dr_grpo",
        "objective.beta=0.1",
        "objective.kl_in_reward=true",
        "objective.kl_estimator=k1",
    )
    credit = assign_credit(trajs, c, "grpo", ref_logprobs=[[-1.0, -1.0], [-2.0, -3.0]])
    assert credit.token_advantages[0] == pytest.approx([0.15, 0.15])
    assert credit.token_advantages[1] == pytest.approx([-0.15, -0.15])
    assert credit.metrics["kl"] == pytest.approx(3 / 4)  # (0 + 0 + 1 + 2) / 4 tokens


def test_soft_overlong_shaping_enters_the_advantage() -> None:
    # max_new_tokens 8, buffer 0.25 -> 2 tokens: lengths 4 (free) and 7 (-(7 - 6) / 2 = -0.5).
    trajs = [traj(1.0, (1,) * 4), traj(1.0, (1,) * 7)]
    c = cfg(
        "algorithm=dr_grpo", "sampling.max_new_tokens=8", "objective.overlong_buffer_fraction=0.25"
    )
    credit = assign_credit(trajs, c, "grpo")
    # rewards 1 and 0.5, mean 0.75: A = +0.25 / -0.25
    assert credit.token_advantages[0] == pytest.approx([0.25] * 4)
    assert credit.token_advantages[1] == pytest.approx([-0.25] * 7)
    assert credit.metrics["overlong/penalty_mean"] == pytest.approx(-0.25)
    assert credit.metrics["overlong/penalised_frac"] == 0.5


def test_token_level_reinforce_pp_is_whitened_reward_to_go() -> None:
    # beta 0.5, k1; row 0: 2 tokens, reward 1, ref = behaviour (KL 0) -> token rewards [0, 1],
    # reward-to-go [1, 1]. Row 1: 2 tokens, reward 0, KL [1, 1] -> rewards [-0.5, -0.5], to-go [-1, -0.5].
    # Whiten the four values [1, 1, -1, -0.5]: mean 0.125, deviations [.875, .875, -1.125, -.625],
    # squares sum .765625*2 + 1.265625 + .390625 = 3.1875, Bessel var 1.0625, std 1.030776.
    trajs = [traj(1.0, (1, 1)), traj(0.0, (1, 1))]
    c = cfg("algorithm=reinforce_pp", "objective.beta=0.5")
    credit = assign_credit(trajs, c, "reinforce_pp", ref_logprobs=[[-1.0, -1.0], [-2.0, -2.0]])
    std = math.sqrt(1.0625)
    assert credit.token_advantages[0] == pytest.approx([0.875 / std, 0.875 / std], rel=1e-5)
    assert credit.token_advantages[1] == pytest.approx([-1.125 / std, -0.625 / std], rel=1e-5)


def test_ppo_gae_uses_the_critic_values_and_skips_observations() -> None:
    # One trajectory [p o p], reward 1 on the last policy token; gamma 1, lambda 0.5, values [0.5, 0.8]
    # (the observation's value is ignored). Policy tokens only: delta_1 = 1 + 0 - 0.8 = 0.2, A_1 = 0.2;
    # delta_0 = 0 + 0.8 - 0.5 = 0.3, A_0 = 0.3 + 0.5 * 0.2 = 0.4. Returns: A + V = [0.9, 1.0].
    # Second row: reward 0, 1 token, V 0.2: A = -0.2, R = 0.
    trajs = [
        traj(1.0, (1, 0, 1), turns=(Span(2, 3), Span(4, 5)), turn_rewards=(0.0, 1.0)),
        traj(0.0, (1,)),
    ]
    c = cfg("algorithm=ppo", "objective.gae_lambda=0.5", "objective.whiten_advantages=false")
    credit = assign_credit(trajs, c, "ppo", values=[[0.5, 99.0, 0.8], [0.2]])
    assert credit.token_advantages[0] == pytest.approx([0.4, 0.0, 0.2])
    assert credit.token_advantages[1] == pytest.approx([-0.2])
    assert credit.returns is not None and credit.old_values is not None
    assert credit.returns[0] == pytest.approx([0.9, 0.0, 1.0])
    assert credit.returns[1] == pytest.approx([0.0])
    assert credit.old_values[0] == pytest.approx([0.5, 0.0, 0.8])

    # Whitened (the default): advantages [0.4, 0.2, -0.2] -> mean 2/15, zero-mean, unit Bessel std.
    credit = assign_credit(
        trajs,
        cfg("algorithm=ppo", "objective.gae_lambda=0.5"),
        "ppo",
        values=[[0.5, 99.0, 0.8], [0.2]],
    )
    flat = [
        credit.token_advantages[0][0],
        credit.token_advantages[0][2],
        credit.token_advantages[1][0],
    ]
    mean = sum(flat) / 3
    assert mean == pytest.approx(0.0, abs=1e-6)
    assert math.sqrt(sum((a - mean) ** 2 for a in flat) / 2) == pytest.approx(1.0, rel=1e-4)
    assert credit.token_advantages[0][1] == 0.0


def test_a_trajectory_that_failed_to_score_gets_no_credit_in_token_level_paths() -> None:
    bad = traj(1.0, (1, 1))
    bad = Trajectory(**{**bad.__dict__, "reward_errors": ("correct",)})
    credit = assign_credit(
        [bad, traj(0.0, (1, 1))], cfg("algorithm=ppo"), "ppo", values=[[0.0, 0.0], [0.1, 0.1]]
    )
    assert credit.token_advantages[0] == [0.0, 0.0]
