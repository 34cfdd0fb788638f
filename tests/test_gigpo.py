"""Hand-worked tests for GiGPO's step-level credit with anchor states (rlvr.algorithms.credit:
`turn_state_keys`, `anchor_groups`, `gigpo_step_advantages`; `objective.credit: gigpo` in
rlvr.train.selection.assign_credit; the env's `state_key` hook in rlvr.rollout.engine).

Every expected number is worked out by hand in the comment next to it.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

import pytest

from rlvr.algorithms.credit import (
    anchor_group_metrics,
    anchor_groups,
    gigpo_step_advantages,
    turn_state_keys,
)
from rlvr.config import RunConfig, load_config
from rlvr.envs.base import Env, EnvReset, EnvStep
from rlvr.errors import ConfigError
from rlvr.models import tiny_tokenizer
from rlvr.records import Span, Task, Trajectory
from rlvr.rollout.engine import RolloutLimits, Scoring, rollout_groups
from rlvr.rollout.generator import Completion, SamplingParams
from rlvr.train.selection import assign_credit


def approx(values: Sequence[float], tol: float = 1e-9) -> object:
    return pytest.approx(list(values), abs=tol)


# The group of 4 episodes used throughout (P = the shared prompt; A, B, C, D = observed states):
#   ep0: keys [P, A, C]  turn rewards [0, 0, 1]
#   ep1: keys [P, A]     turn rewards [0, 1]
#   ep2: keys [P, B]     turn rewards [0, 0]
#   ep3: keys [P, B, D]  turn rewards [0, 0.5, 0]
# gamma 0.5, R_k = r_k + 0.5 R_{k+1}:
#   ep0 R = [0.25, 0.5, 1]   ep1 R = [0.5, 1]   ep2 R = [0, 0]   ep3 R = [0.25, 0.5, 0]
# Anchor groups: P = {ep0 0.25, ep1 0.5, ep2 0, ep3 0.25}; A = {ep0 0.5, ep1 1};
#   B = {ep2 0, ep3 0.5}; C = {ep0 1} and D = {ep3 0} are singletons.
KEYS: list[list[Hashable]] = [["P", "A", "C"], ["P", "A"], ["P", "B"], ["P", "B", "D"]]
REWARDS = [[0.0, 0.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.5, 0.0]]


# ------------------------------------------------------------------------------ (a) by hand
def test_step_advantages_two_shared_states_by_hand_centred() -> None:
    # P: mean (0.25 + 0.5 + 0 + 0.25) / 4 = 0.25 -> [0, 0.25, -0.25, 0]
    # A: mean 0.75 -> ep0 -0.25, ep1 +0.25;  B: mean 0.25 -> ep2 -0.25, ep3 +0.25
    # C, D singletons -> 0
    out = gigpo_step_advantages(KEYS, REWARDS, [True] * 4, 4, gamma=0.5, scale=False)
    assert out[0] == approx([0.0, -0.25, 0.0])
    assert out[1] == approx([0.25, 0.25])
    assert out[2] == approx([-0.25, -0.25])
    assert out[3] == approx([0.0, 0.25, 0.0])


def test_step_advantages_two_shared_states_by_hand_scaled() -> None:
    # P: Bessel var = (0 + 0.0625 + 0.0625 + 0) / 3 = 1/24, std 0.204124; 0.25 / std = 1.224745
    # A, B: Bessel var = (0.0625 + 0.0625) / 1 = 0.125, std 0.353553; 0.25 / std = 0.707107
    out = gigpo_step_advantages(KEYS, REWARDS, [True] * 4, 4, gamma=0.5, scale=True, eps=0.0)
    p, ab = 0.25 / math.sqrt(1 / 24), 0.25 / math.sqrt(0.125)
    assert p == pytest.approx(1.224745, abs=1e-6) and ab == pytest.approx(0.707107, abs=1e-6)
    assert out[0] == approx([0.0, -ab, 0.0])
    assert out[1] == approx([p, ab])
    assert out[2] == approx([-p, -ab])
    assert out[3] == approx([0.0, ab, 0.0])
    # default eps 1e-4 in the denominator: ep1 turn 0 = 0.25 / (0.204124 + 1e-4) = 1.224145
    default = gigpo_step_advantages(KEYS, REWARDS, [True] * 4, 4, gamma=0.5)
    assert default[1][0] == pytest.approx(0.25 / (math.sqrt(1 / 24) + 1e-4), abs=1e-12)
    assert default[1][0] == pytest.approx(1.224145, abs=1e-6)


def test_a_state_revisited_at_another_turn_joins_its_anchor_group() -> None:
    # ep3's last turn acts from A too (keys [P, B, A]): A = {ep0 0.5, ep1 1, ep3 0},
    # mean 0.5 -> ep0 0, ep1 +0.5, ep3 -0.5 (D no longer exists)
    keys: list[list[Hashable]] = [["P", "A", "C"], ["P", "A"], ["P", "B"], ["P", "B", "A"]]
    out = gigpo_step_advantages(keys, REWARDS, [True] * 4, 4, gamma=0.5, scale=False)
    assert out[0] == approx([0.0, 0.0, 0.0])
    assert out[1] == approx([0.25, 0.5])
    assert out[3] == approx([0.0, 0.25, -0.5])
    assert anchor_groups(keys, [True] * 4, 4) == [
        [(0, 0), (1, 0), (2, 0), (3, 0)],
        [(0, 1), (1, 1), (3, 2)],
        [(0, 2)],
        [(2, 1), (3, 1)],
    ]


def test_groups_are_independent() -> None:
    # Group 1 (ep 0, 1): keys [P], [P]; R = 1, 0 -> +-0.5. Group 2 (ep 2, 3) reuses the key "P"
    # with R = 3, 3: a different task, so no shared anchor (else the mean 1.75 would move both).
    out = gigpo_step_advantages(
        [["P"]] * 4, [[1.0], [0.0], [3.0], [3.0]], [True] * 4, 2, 1.0, False
    )
    assert out == [approx([0.5]), approx([-0.5]), [0.0], [0.0]]
    with pytest.raises(ValueError, match="groups of 2"):
        gigpo_step_advantages([["P"]] * 3, [[1.0]] * 3, [True] * 3, 2)
    with pytest.raises(ValueError, match="2 state keys for 1 turns"):
        gigpo_step_advantages([["P", "A"]], [[1.0]], [True], 1)


# ------------------------------------------------------------------------------ (b), (c)
def test_singleton_anchor_groups_give_zero() -> None:
    # Every later state differs: only the first turns share a state. gamma 1:
    # R = [[1, 1], [0, 0]]: P = {1, 0} -> +-0.5; A and B singletons -> exactly 0
    out = gigpo_step_advantages(
        [["P", "A"], ["P", "B"]], [[0.0, 1.0], [0.0, 0.0]], [True, True], 2, 1.0, False
    )
    assert out == [[0.5, 0.0], [-0.5, 0.0]]
    # group_size 1: every anchor group is a singleton
    assert gigpo_step_advantages([["P", "A"]], [[0.0, 1.0]], [True], 1) == [[0.0, 0.0]]


def test_equal_returns_within_an_anchor_group_give_exactly_zero() -> None:
    # gamma 1: ep0 R = [0.1 + 0.6, 0.6] = [0.7, 0.6]; ep1 R = [0.7 + 0, 0] = [0.7, 0.0]
    # P = {0.7, 0.7}: max - min == 0 -> exactly 0 (scaled or not); A = {0.6, 0.0} -> +-0.3 centred
    keys: list[list[Hashable]] = [["P", "A"], ["P", "A"]]
    rewards = [[0.1, 0.6], [0.7, 0.0]]
    centred = gigpo_step_advantages(keys, rewards, [True, True], 2, 1.0, scale=False)
    assert centred[0][0] == 0.0 and centred[1][0] == 0.0
    assert [centred[0][1], centred[1][1]] == approx([0.3, -0.3])
    scaled = gigpo_step_advantages(keys, rewards, [True, True], 2, 1.0, scale=True)
    assert scaled[0][0] == 0.0 and scaled[1][0] == 0.0
    # three equal returns of 0.7 reached three ways: still exactly 0
    three = gigpo_step_advantages([["P"]] * 3, [[0.7], [0.7], [0.7]], [True] * 3, 3)
    assert three == [[0.0], [0.0], [0.0]]


# ------------------------------------------------------------------------------ (d) invalid
def test_invalid_trajectories_are_left_out_of_anchor_groups() -> None:
    # ep1 invalid: P = {ep0 0.25, ep2 0, ep3 0.25}, mean 1/6 -> [1/12, -1/6, 1/12];
    # A = {ep0 0.5} now a singleton -> 0; B unchanged {0, 0.5} -> -+0.25; ep1 all 0
    valid = [True, False, True, True]
    out = gigpo_step_advantages(KEYS, REWARDS, valid, 4, gamma=0.5, scale=False)
    assert out[0] == approx([1 / 12, 0.0, 0.0])
    assert out[1] == [0.0, 0.0]
    assert out[2] == approx([-1 / 6, -0.25])
    assert out[3] == approx([1 / 12, 0.25, 0.0])
    # an invalid member with a huge return shifts nothing
    rewards = [REWARDS[0], [100.0, 100.0], REWARDS[2], REWARDS[3]]
    assert gigpo_step_advantages(KEYS, rewards, valid, 4, gamma=0.5, scale=False) == out


def test_anchor_group_metrics_count_the_states_after_the_first_turn() -> None:
    # Later groups: A (2, spread 0.5), B (2, spread 0.5), C (1), D (1): size mean 6/4 = 1.5,
    # informative 2/4 = 0.5. The first-turn group P is not counted.
    m = anchor_group_metrics(KEYS, REWARDS, [True] * 4, 4, gamma=0.5)
    assert m == {
        "credit/anchor_group_size_mean": 1.5,
        "credit/anchor_groups_informative_frac": 0.5,
    }
    # ep1 invalid: A (1), B (2, informative), C (1), D (1): 5/4 and 1/4
    m = anchor_group_metrics(KEYS, REWARDS, [True, False, True, True], 4, gamma=0.5)
    assert m["credit/anchor_group_size_mean"] == 1.25
    assert m["credit/anchor_groups_informative_frac"] == 0.25
    # single-turn episodes: no later states
    assert anchor_group_metrics([["P"]] * 2, [[1.0], [0.0]], [True] * 2, 2) == {
        "credit/anchor_group_size_mean": 0.0,
        "credit/anchor_groups_informative_frac": 0.0,
    }


# ------------------------------------------------------------------------------ state keys
OBSERVATIONS = {"A": "You stand on A.", "B": "You stand on B.", "C": "On C.", "D": "On D."}


def episode(keys: Sequence[Hashable], turn_rewards: Sequence[float], prompt: int = 3) -> Trajectory:
    """`prompt` prompt tokens (ids 1..), then per turn 2 sampled tokens, and between turns 2
    observation tokens; messages alternate assistant turns and the observation of keys[k]."""
    ids, mask, turns, messages = list(range(1, prompt + 1)), [0] * prompt, [], []
    for k in range(len(keys)):
        if k:
            ids += [90, 91]  # observation + template glue
            mask += [0, 0]
            messages.append({"role": "user", "content": OBSERVATIONS[str(keys[k])]})
        turns.append(Span(len(ids), len(ids) + 2))
        ids += [50 + k, 60 + k]
        mask += [1, 1]
        messages.append({"role": "assistant", "content": f"move {k}"})
    return Trajectory(
        task_id="t",
        token_ids=tuple(ids),
        policy_mask=tuple(mask),
        logprobs=tuple(-1.0 * m for m in mask),
        prompt_length=prompt,
        completion_text="",
        finish_reason="stop",
        turns=tuple(turns),
        reward=sum(turn_rewards),
        turn_rewards=tuple(turn_rewards),
        messages=tuple(messages),
    )


def test_turn_state_keys_are_the_prompt_then_each_observation() -> None:
    a = episode(["P", "A", "C"], [0.0, 0.0, 1.0])
    b = episode(["P", "A"], [0.0, 1.0])
    ka, kb = turn_state_keys(a), turn_state_keys(b)
    assert ka[0] == ("prompt", (1, 2, 3)) == kb[0]
    assert ka[1] == ("observation", ((("content", "You stand on A."), ("role", "user")),))
    assert ka[1] == kb[1] and ka[2] != ka[1]
    # a different prompt (an env whose reset varies per episode) is a different first state
    assert turn_state_keys(episode(["P"], [0.0], prompt=4))[0] != ka[0]
    # the env's state_key, where given, replaces the text: "A" and "B" texts, one env state 7
    c = Trajectory(**{**b.__dict__, "info": {"state_keys": (7,)}})
    d = episode(["P", "B"], [0.0, 0.0])
    d = Trajectory(**{**d.__dict__, "info": {"state_keys": (7,)}})
    assert turn_state_keys(c)[1] == turn_state_keys(d)[1] == ("env", 7)
    # messages that do not line up with the turns: a key equal to nothing, so a singleton
    bare = Trajectory(**{**b.__dict__, "messages": ()})
    other = Trajectory(**{**b.__dict__, "messages": ()})
    assert turn_state_keys(bare)[1] != turn_state_keys(other)[1]
    assert turn_state_keys(bare)[0] == kb[0]


# ------------------------------------------------------------------------------ (e) assign_credit
def gigpo_config(*extra: str) -> RunConfig:
    return load_config(
        None,
        [
            "sampling.group_size=4",
            "objective.credit=gigpo",
            "objective.scale_rewards=false",
            "objective.gamma=0.5",
            "objective.turn_weight=0.5",
            *extra,
        ],
    )


def test_assign_credit_gigpo_puts_each_turns_advantage_on_its_tokens() -> None:
    trajs = [episode(k, r) for k, r in zip(KEYS, REWARDS, strict=True)]
    # Episode rewards [1, 1, 0, 0.5], mean 0.625, no std scaling: A = [0.375, 0.375, -0.625, -0.125]
    # Step (gamma 0.5, centred, from the first test): ep0 [0, -0.25, 0], ep1 [0.25, 0.25],
    #   ep2 [-0.25, -0.25], ep3 [0, 0.25, 0]; omega 0.5:
    #   ep0 [0.375, 0.375 - 0.125 = 0.25, 0.375]   ep1 [0.375 + 0.125 = 0.5, 0.5]
    #   ep2 [-0.625 - 0.125 = -0.75, -0.75]        ep3 [-0.125, -0.125 + 0.125 = 0, -0.125]
    # Completion layout: turn (2 tokens) | observation (2 tokens, 0) | turn | ...
    credit = assign_credit(trajs, gigpo_config(), "grpo")
    out = credit.token_advantages
    assert out[0] == approx([0.375, 0.375, 0, 0, 0.25, 0.25, 0, 0, 0.375, 0.375])
    assert out[1] == approx([0.5, 0.5, 0, 0, 0.5, 0.5])
    assert out[2] == approx([-0.75, -0.75, 0, 0, -0.75, -0.75])
    assert out[3] == approx([-0.125, -0.125, 0, 0, 0.0, 0.0, 0, 0, -0.125, -0.125])
    # observation positions are exactly 0
    assert all(out[0][i] == 0.0 for i in (2, 3, 6, 7))
    assert credit.metrics["credit/anchor_group_size_mean"] == 1.5
    assert credit.metrics["credit/anchor_groups_informative_frac"] == 0.5


def test_assign_credit_gigpo_scaled_and_with_an_invalid_member() -> None:
    trajs = [episode(k, r) for k, r in zip(KEYS, REWARDS, strict=True)]
    trajs[1] = Trajectory(**{**trajs[1].__dict__, "reward_errors": ("correct",), "reward": 0.0})
    # Valid rewards [1, 0, 0.5] (ep1 out): mean 0.5, Bessel std 0.5 -> A = [1, 0, -1, 0] (eps
    # 1e-4: 0.5 / 0.5001 = 0.9998). Step, scaled: P = {0.25, 0, 0.25}: mean 1/6, Bessel var
    # ((1/12)^2 * 2 + (1/6)^2) / 2 = (6/144) / 2 = 1/48, std 0.144338 -> ep0, ep3
    # (1/12) / std = 0.577350, ep2 -1.154701 (each / (std + 1e-4)); B = {0, 0.5}: +-0.707107
    # (0.25 / (0.353553 + 1e-4)); A and C singletons. omega 0.5. (1e-6: A is float32.)
    credit = assign_credit(trajs, gigpo_config("objective.scale_rewards=true"), "grpo")
    out = credit.token_advantages
    a = 0.5 / (0.5 + 1e-4)
    s_p = math.sqrt(1 / 48) + 1e-4
    s_b = math.sqrt(0.125) + 1e-4
    assert out[0][:2] == approx([a + 0.5 * (1 / 12) / s_p] * 2, 1e-6)
    assert out[0][4:6] == approx([a] * 2, 1e-6)  # A is a singleton now
    assert out[1] == [0.0] * 6
    assert out[2] == approx(
        [-a - 0.5 * (1 / 6) / s_p] * 2 + [0, 0] + [-a - 0.5 * 0.25 / s_b] * 2, 1e-6
    )
    assert out[3][4:6] == approx([0.5 * 0.25 / s_b] * 2, 1e-6)
    assert out[2][0] == pytest.approx(-0.99980 - 0.5 * 1.15390, abs=1e-4)


def test_gigpo_sees_the_overlong_shaping_on_the_last_turn() -> None:
    # Two one-turn episodes (no observations), reward 1 each; max_new_tokens 8, buffer 0.25 ->
    # lengths 4 (free) and 7 (-(7 - 6) / 2 = -0.5). Shaped rewards [1, 0.5]: episode A = +-0.25;
    # the one anchor group (the prompt) has returns [1, 0.5] -> step +-0.25; omega 0.5:
    # 0.25 + 0.125 = 0.375 and -0.375.
    trajs = [episode(["P"], [1.0]), episode(["P"], [1.0])]
    trajs[0] = Trajectory(
        **{
            **trajs[0].__dict__,
            "token_ids": (1, 2, 3, 5, 6, 7, 8),
            "policy_mask": (0, 0, 0, 1, 1, 1, 1),
            "logprobs": (0.0,) * 3 + (-1.0,) * 4,
            "turns": (Span(3, 7),),
        }
    )
    trajs[1] = Trajectory(
        **{
            **trajs[1].__dict__,
            "token_ids": (1, 2, 3) + (5,) * 7,
            "policy_mask": (0, 0, 0) + (1,) * 7,
            "logprobs": (0.0,) * 3 + (-1.0,) * 7,
            "turns": (Span(3, 10),),
        }
    )
    c = load_config(
        None,
        [
            "sampling.group_size=2",
            "objective.credit=gigpo",
            "objective.scale_rewards=false",
            "objective.turn_weight=0.5",
            "sampling.max_new_tokens=8",
            "objective.overlong_buffer_fraction=0.25",
        ],
    )
    out = assign_credit(trajs, c, "grpo").token_advantages
    assert out[0] == approx([0.375] * 4)
    assert out[1] == approx([-0.375] * 7)


# ------------------------------------------------------------------------------ (f) config
def test_gigpo_config_refusals() -> None:
    for algorithm in ("grpo", "dr_grpo", "dapo", "gspo", "cispo"):
        assert load_config(None, [f"algorithm={algorithm}", "objective.credit=gigpo"])
    for algorithm in ("rloo", "reinforce_pp_baseline", "reinforce_pp"):
        with pytest.raises(ConfigError, match=f"group-relative episode advantage; {algorithm}'s"):
            load_config(None, [f"algorithm={algorithm}", "objective.credit=gigpo"])
    with pytest.raises(ConfigError, match="not used by ppo"):
        load_config(None, ["algorithm=ppo", "objective.credit=gigpo"])
    with pytest.raises(ConfigError):
        load_config(None, ["objective.credit=anchors"])
    # the loop's own guard, should a config bypass the validator
    trajs = [episode(["P"], [1.0]), episode(["P"], [0.0])]
    c = load_config(None, ["sampling.group_size=2", "objective.credit=gigpo"])
    with pytest.raises(ValueError, match="'gigpo' needs a group-relative estimator, not 'rloo'"):
        assign_credit(trajs, c, "rloo")


# ------------------------------------------------------------------------------ engine: state_key
TOK = tiny_tokenizer()
EOS = TOK.convert_tokens_to_ids("<|im_end|>")
MOVES = {"R": 1, "right": 1, "L": -1, "S": 0}


class Walk(Env):
    """A line walk from 0: 'R'/'right' +1, 'L' -1, 'S' stays; reward 1 on reaching 2. The
    observation echoes the move as said, so two ways of saying 'right' read differently; with
    `keyed` the env also names the state (the position) in info["state_key"]."""

    max_turns = 2
    keyed = True

    def __init__(self, task: Task) -> None:
        self.task, self.pos = task, 0

    def reset(self) -> EnvReset:
        return EnvReset([dict(m) for m in self.task.messages])

    def step(self, assistant_text: str) -> EnvStep:
        said = assistant_text.strip()
        self.pos += MOVES[said]
        if self.pos == 2:
            return EnvStep(rewards={"success": 1.0}, done=True)
        info: dict[str, Any] = {"moves": 1}
        if self.keyed:
            info["state_key"] = self.pos
        text = f"You said {said}. Position {self.pos}."
        return EnvStep([{"role": "user", "content": text}], {"success": 0.0}, info=info)


class UnkeyedWalk(Walk):
    keyed = False


class StartKeyedWalk(Walk):
    """Walk whose reset names its opening state too (EnvReset.state_key = position 0)."""

    def reset(self) -> EnvReset:
        return EnvReset([dict(m) for m in self.task.messages], state_key=self.pos)


class WalkGenerator:
    """First turn: sample j says FIRST[j]. Later turns: an answer chosen by the observation."""

    FIRST = ("R", "right", "L", "S")
    LATER: ClassVar[dict[str, str]] = {
        "said R.": "R",
        "said right.": "S",
        "said L.": "R",
        "said S.": "R",
    }

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        out = []
        for prompt in prompts:
            text = str(TOK.decode(list(prompt)))
            if "Position" not in text:
                said = [self.FIRST[j] for j in range(sampling.n)]
            else:
                last = text.rsplit("You said", 1)[1]
                said = [next(v for k, v in self.LATER.items() if k in "You said" + last)]
            row = []
            for s in said:
                ids = [*TOK(s, add_special_tokens=False)["input_ids"], EOS]
                row.append(Completion(tuple(ids), (-0.5,) * len(ids), "stop"))
            out.append(row)
        return out


def walk(env: type[Walk]) -> list[Trajectory]:
    task = Task(id="walk", messages=({"role": "user", "content": "Walk to 2."},))
    (group,) = rollout_groups(
        [task],
        env,
        WalkGenerator(),
        TOK,
        SamplingParams(n=4, max_new_tokens=8),
        Scoring(),
        RolloutLimits(),
    )
    return list(group.trajectories)


def test_engine_records_the_env_state_key_and_gigpo_groups_by_it() -> None:
    trajs = walk(Walk)
    # j0: R (pos 1), R (pos 2, reward 1, done)   j1: right (pos 1), S (pos 1, turn cap)
    # j2: L (pos -1), R (pos 0)                   j3: S (pos 0), R (pos 1)
    assert [t.reward for t in trajs] == [1.0, 0.0, 0.0, 0.0]
    assert [t.info["state_keys"] for t in trajs] == [(1, None), (1, 1), (-1, 0), (0, 1)]
    assert [t.info["moves"] for t in trajs] == [1.0, 2.0, 2.0, 2.0]  # the key is not a counter
    # gamma 1, no std scaling, omega 0.5. Episode A: rewards [1, 0, 0, 0], mean 0.25 ->
    #   [0.75, -0.25, -0.25, -0.25]. First turns (prompt): returns [1, 0, 0, 0] -> the same.
    # Second turns: j0 and j1 act from position 1 (env key; texts "said R" / "said right"
    #   differ): returns 1 and 0 -> +-0.5; j2 (pos -1) and j3 (pos 0) singletons -> 0.
    # turn 0: 0.75 + 0.375 = 1.125, others -0.25 - 0.125 = -0.375
    # turn 1: j0 0.75 + 0.25 = 1.0, j1 -0.25 - 0.25 = -0.5, j2 and j3 -0.25
    c = gigpo_config("objective.gamma=1.0")
    credit = assign_credit(trajs, c, "grpo")
    expected = [(1.125, 1.0), (-0.375, -0.5), (-0.375, -0.25), (-0.375, -0.25)]
    for t, adv, (first, second) in zip(trajs, credit.token_advantages, expected, strict=True):
        want = [0.0] * (len(t.token_ids) - t.prompt_length)
        for span, value in zip(t.turns, (first, second), strict=True):
            for p in range(span.start, span.end):
                want[p - t.prompt_length] = value
        assert adv == approx(want)
        # exactly the observation positions (completion tokens the policy did not sample) are 0
        n_observed = len(t.token_ids) - t.prompt_length - t.num_policy_tokens
        assert n_observed > 0 and sum(1 for a in adv if a == 0.0) == n_observed
    # later groups: {j0, j1} at 1 (informative), {j2} at -1, {j3} at 0 -> size 4/3, informative 1/3
    assert credit.metrics["credit/anchor_group_size_mean"] == pytest.approx(4 / 3)
    assert credit.metrics["credit/anchor_groups_informative_frac"] == pytest.approx(1 / 3)


def test_without_a_state_key_the_observation_text_is_the_state() -> None:
    trajs = walk(UnkeyedWalk)
    assert all("state_keys" not in t.info for t in trajs)
    # Same episodes; "You said R. Position 1." != "You said right. Position 1.": every second
    # turn is a singleton, so turn 1 gets the episode advantage alone: [0.75, -0.25, -0.25, -0.25]
    credit = assign_credit(trajs, gigpo_config("objective.gamma=1.0"), "grpo")
    seconds = [
        adv[t.turns[1].start - t.prompt_length]
        for t, adv in zip(trajs, credit.token_advantages, strict=True)
    ]
    assert seconds == approx([0.75, -0.25, -0.25, -0.25])
    firsts = [adv[0] for adv in credit.token_advantages]
    assert firsts == approx([1.125, -0.375, -0.375, -0.375])
    assert credit.metrics["credit/anchor_group_size_mean"] == 1.0
    assert credit.metrics["credit/anchor_groups_informative_frac"] == 0.0


def test_a_return_to_the_start_joins_the_first_turns_anchor_group() -> None:
    """The opening state keyed like every later one (EnvReset.state_key): j3 says S and acts again
    from position 0, the start, so its second turn joins the four first turns' anchor group (with
    the prompt as turn 0's key it never could: ("prompt", ids) != ("env", 0), issue 62)."""
    trajs = walk(StartKeyedWalk)
    assert [t.info["initial_state_key"] for t in trajs] == [0, 0, 0, 0]
    assert turn_state_keys(trajs[3]) == [("env", 0), ("env", 0)]
    # Episode advantages as above: [0.75, -0.25, -0.25, -0.25]. Anchor group at 0: the four first
    # turns (returns 1, 0, 0, 0) and j3's second (0): mean 0.2 -> 0.8, -0.2 x 4. At 1: j0 and j1's
    # second turns, returns 1 and 0 -> +-0.5; j2's second (at -1) alone -> 0. omega 0.5:
    # j0 (0.75 + 0.4, 0.75 + 0.25), j1 (-0.25 - 0.1, -0.25 - 0.25), j2 (-0.35, -0.25),
    # j3 (-0.35, -0.25 - 0.1)
    credit = assign_credit(trajs, gigpo_config("objective.gamma=1.0"), "grpo")
    expected = [(1.15, 1.0), (-0.35, -0.5), (-0.35, -0.25), (-0.35, -0.35)]
    for t, adv, values in zip(trajs, credit.token_advantages, expected, strict=True):
        for span, value in zip(t.turns, values, strict=True):
            assert adv[span.start - t.prompt_length : span.end - t.prompt_length] == approx(
                [value] * (span.end - span.start)
            )
