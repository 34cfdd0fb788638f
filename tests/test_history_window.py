"""`rollout.history: window`: each turn sampled from the opening + the last K turns, trained as its
own sample (rlvr.rollout.engine, Trajectory.turn_samples, rlvr.train.selection).

The scripted half uses the character-level tiny tokenizer and an echo generator whose answer to a
prompt is fixed by the last observation in it, so full and windowed histories play the very same
conversation and every window can be written out by hand. The tiny-model half samples for real and
checks token-exactness per sample: the ids the sampler was sent, a re-rendering of the window's
messages, and the trainer's log-probs against the sampling ones.
"""

from __future__ import annotations

import math
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from rlvr.config import RunConfig, load_config
from rlvr.envs.base import Env, EnvReset, EnvStep
from rlvr.models import eos_token_ids, load_policy, tiny_tokenizer
from rlvr.records import Group, Task, Trajectory, flatten
from rlvr.rollout.engine import RolloutLimits, Scoring, rollout_groups
from rlvr.rollout.generator import Completion, SamplingParams
from rlvr.rollout.hf import HFGenerator
from rlvr.train.batch import collate, token_logprobs
from rlvr.train.selection import assign_credit, collect_groups, training_group

TOK = tiny_tokenizer()
EOS = TOK.convert_tokens_to_ids("<|im_end|>")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
OPENING = ({"role": "system", "content": "sys"}, {"role": "user", "content": "start"})


def ids(text: str, tok: Any = TOK) -> list[int]:
    return [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]


def render(messages: Sequence[dict[str, str]], tok: Any = TOK) -> list[int]:
    return ids(tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True))


class WalkEnv(Env):
    """Observation j is "obs{j}"; episode e of a group ends after `turns[e]` steps, earning
    `goal` = `win[e]` on its last one."""

    max_turns = 10

    def __init__(self, task: Task) -> None:
        self.task, self.t = task, 0

    def reset(self) -> EnvReset:
        return EnvReset([dict(m) for m in self.task.messages])

    def step(self, assistant_text: str) -> EnvStep:
        self.t += 1
        e = self.episode_index
        done = self.t >= self.task.fields["turns"][e]
        return EnvStep(
            messages=[{"role": "user", "content": f"obs{self.t}"}],
            rewards={"goal": float(done) * self.task.fields["win"][e]},
            done=done,
        )


def walk(turns: Sequence[int], win: Sequence[float] = (), task_id: str = "walk") -> Task:
    return Task(task_id, OPENING, {"turns": list(turns), "win": list(win or [0.0] * len(turns))})


class EchoGenerator:
    """Answers "a{j}" + EOS to a prompt whose last observation is obs{j} (a0 before any); token i
    of answer a{j} has log-prob -(j + 1) - i / 100. Records every prompt it is sent."""

    def __init__(self) -> None:
        self.prompts: list[tuple[int, ...]] = []

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        out = []
        for prompt in prompts:
            self.prompts.append(tuple(prompt))
            seen = re.findall(r"obs(\d+)", str(TOK.decode(list(prompt))))
            j = int(seen[-1]) if seen else 0
            token_ids = (*ids(f"a{j}"), EOS)
            logprobs = tuple(-(j + 1) - i / 100 for i in range(len(token_ids)))
            out.append([Completion(token_ids, logprobs, "stop")] * sampling.n)
        return out


def play(
    tasks: Sequence[Task], history: str, k: int = 2, n: int = 1
) -> tuple[list[Group], EchoGenerator]:
    gen = EchoGenerator()
    limits = RolloutLimits(max_total_tokens=2000, env_workers=1, history=history, history_turns=k)  # type: ignore[arg-type]
    groups = rollout_groups(
        list(tasks), WalkEnv, gen, TOK, SamplingParams(n=n, max_new_tokens=8), Scoring(), limits
    )
    return groups, gen


def window_messages(turn: int, k: int) -> list[dict[str, str]]:
    """The window of turn `turn` (0-based) written out: the opening, then turns max(0, turn-k)..turn-1
    of the echo conversation (answer a{j}, observation obs{j+1})."""
    kept = []
    for j in range(max(0, turn - k), turn):
        kept += [
            {"role": "assistant", "content": f"a{j}"},
            {"role": "user", "content": f"obs{j + 1}"},
        ]
    return [*OPENING, *kept]


# ------------------------------------------------------------------------------- windows by hand
def test_k1_window_written_out() -> None:
    (group,), gen = play([walk([4])], "window", k=1)
    (episode,) = group.trajectories
    samples = episode.turn_samples()
    opening = (
        "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nstart<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Turn 3 (index 2) keeps turn 2 only: its answer a1 and the observation obs2 after it.
    assert TOK.decode(list(samples[2].token_ids)) == (
        opening + "a1<|im_end|>\n<|im_start|>user\nobs2<|im_end|>\n<|im_start|>assistant\n"
        "a2<|im_end|>"
    )
    # Turn 2 (index 1): the window is not full yet, the whole conversation so far.
    assert TOK.decode(list(samples[1].token_ids[: samples[1].turns[0].start])) == (
        opening + "a0<|im_end|>\n<|im_start|>user\nobs1<|im_end|>\n<|im_start|>assistant\n"
    )
    assert episode.windowed and len(gen.prompts) == 4


@pytest.mark.parametrize(("k", "turns"), [(1, 4), (2, 4), (2, 5), (3, 2)])
def test_each_sample_is_its_window_rendered_and_what_the_sampler_saw(k: int, turns: int) -> None:
    (group,), gen = play([walk([turns])], "window", k=k)
    (episode,) = group.trajectories
    samples = episode.turn_samples()
    assert len(samples) == len(episode.turns) == turns
    assert [s.token_ids[: s.turns[0].start] for s in samples] == gen.prompts
    for turn, sample in enumerate(samples):
        start = sample.turns[0].start  # the window: the opening (the row's prompt), kept turns
        # The prompt re-rendered from the window's messages by the chat template: the same ids.
        assert list(sample.token_ids[:start]) == render(window_messages(turn, k))
        assert sample.prompt_length == episode.prompt_length  # collate shares the opening
        answer = (*ids(f"a{turn}"), EOS)
        assert sample.token_ids[start:] == answer
        assert sample.policy_mask == (0,) * start + (1,) * len(answer)
        assert sample.logprobs[start:] == tuple(-(turn + 1) - i / 100 for i in range(len(answer)))
        assert sample.turn_of is not None and sample.turn_of.index == turn
        assert sample.turn_of.episode is episode
    # An episode no longer than the window: every turn saw the whole conversation.
    assert episode.windowed == (turns > k + 1)


def test_full_history_is_unchanged_and_window_plays_the_same_conversation() -> None:
    (full,), full_gen = play([walk([5])], "full")
    (window,), _ = play([walk([5])], "window", k=1)
    f, w = full.trajectories[0], window.trajectories[0]
    assert f.history_starts == () and not f.windowed
    assert training_group(full) is full  # full history trains the episode as one row, as before
    assert (f.token_ids, f.policy_mask, f.logprobs, f.turns) == (
        w.token_ids,
        w.policy_mask,
        w.logprobs,
        w.turns,
    )
    # Full history: turn k was sampled from the whole conversation before it.
    assert full_gen.prompts == [f.token_ids[: span.start] for span in f.turns]
    assert len(w.history_starts) == 5 and w.windowed
    with pytest.raises(ValueError, match="history window"):
        collate([w], [[0.0] * len(w.completion_ids)], pad_token_id=0)


# ------------------------------------------------------------------------------------- credit
def credit_cfg(credit: str, *extra: str) -> RunConfig:
    return load_config(
        None,
        [
            "sampling.group_size=2",
            f"objective.credit={credit}",
            "objective.scale_rewards=false",
            "objective.gamma=1.0",
            "objective.turn_weight=1.0",
            *extra,
        ],
    )


def on_turn(row: Trajectory, values: Sequence[float]) -> list[float]:
    """A row's per-completion-token values on its sampled tokens (the turn)."""
    start = row.turns[0].start - row.prompt_length
    return list(values[start : start + row.turns[0].end - row.turns[0].start])


def row_values(rows: Sequence[Trajectory], advantages: Sequence[Sequence[float]]) -> list[float]:
    """Each row's advantage: constant over its sampled tokens, 0 on its kept turns."""
    values = []
    for row, adv in zip(rows, advantages, strict=True):
        turn = on_turn(row, adv)
        assert len(set(turn)) == 1 and sum(abs(a) for a in adv) == pytest.approx(
            abs(turn[0]) * len(turn)
        ), adv
        values.append(turn[0])
    return values


# One group: episode 0 plays 3 turns and wins on its last (turn rewards 0, 0, 1); episode 1 plays
# 1 turn and loses. Rows: three of episode 0, then one of episode 1.
#   trajectory: A = r - mean over the two *episodes* = 1 - 0.5 = +0.5, 0 - 0.5 = -0.5 (over the four
#               rows it would be 1 - 0.75 = +0.25: a long episode must not count once per turn)
#   turn:       returns (gamma 1) 1, 1, 1 | 0; pooled mean 0.75 -> +0.25, +0.25, +0.25 | -0.75
#   bi-level:   trajectory + turn: 0.75, 0.75, 0.75 | -1.25
#   gigpo:      trajectory + step; turn 1 of both shares the prompt (returns 1 vs 0: +0.5 | -0.5),
#               turns 2 and 3 of episode 0 are alone in their states (0): 1.0, 0.5, 0.5 | -1.0
EXPECTED = {
    "trajectory": [0.5, 0.5, 0.5, -0.5],
    "turn": [0.25, 0.25, 0.25, -0.75],
    "bi-level": [0.75, 0.75, 0.75, -1.25],
    "gigpo": [1.0, 0.5, 0.5, -1.0],
}


@pytest.mark.parametrize("credit", list(EXPECTED))
def test_credit_on_turn_rows_worked_by_hand(credit: str) -> None:
    (group,), _ = play([walk([3, 1], win=[1.0, 0.0])], "window", k=1, n=2)
    assert [t.turn_rewards for t in group.trajectories] == [(0.0, 0.0, 1.0), (0.0,)]
    rows = list(training_group(group).trajectories)
    assert [
        (r.turn_of.episode is group.trajectories[e], r.turn_of.index)
        for r, e in zip(rows, [0, 0, 0, 1], strict=True)
    ] == [(True, 0), (True, 1), (True, 2), (True, 0)]  # type: ignore[union-attr]
    cfg = credit_cfg(credit)
    credit_rows = assign_credit(rows, cfg)
    assert row_values(rows, credit_rows.token_advantages) == pytest.approx(EXPECTED[credit])
    # The same numbers as full history gives the same episodes, turn by turn.
    (full,), _ = play([walk([3, 1], win=[1.0, 0.0])], "full", n=2)
    episodes = assign_credit(list(full.trajectories), cfg).token_advantages
    for row, adv in zip(rows, credit_rows.token_advantages, strict=True):
        assert row.turn_of is not None
        span, p = row.turn_of.episode.turns[row.turn_of.index], row.turn_of.episode.prompt_length
        assert on_turn(row, adv) == pytest.approx(
            episodes[row.turn_of.episode is not group.trajectories[0]][
                span.start - p : span.end - p
            ]
        )


def test_scaled_group_statistics_are_over_episodes() -> None:
    (group,), _ = play([walk([3, 1], win=[1.0, 0.0])], "window", k=1, n=2)
    rows = list(training_group(group).trajectories)
    advantages = row_values(
        rows,
        assign_credit(
            rows, credit_cfg("trajectory", "objective.scale_rewards=true")
        ).token_advantages,
    )
    # Rewards 1 and 0: mean 0.5, Bessel std sqrt(0.5) = 0.7071; A = +-0.5 / (0.7071 + 1e-4).
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert advantages == pytest.approx([a, a, a, -a], abs=1e-5)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_per_token_inputs_reach_the_episodes_turn_spans(algorithm: str) -> None:
    """KL in the reward (reference log-probs per row) and ppo's critic values (per row) are placed on
    the episode's turn spans: the rows get what full history gives the same episodes."""
    extra = ["objective.beta=0.1", "objective.kl_in_reward=true", f"algorithm={algorithm}"]
    cfg = credit_cfg("trajectory", *extra)
    (group,), _ = play([walk([3, 1], win=[1.0, 0.0])], "window", k=1, n=2)
    (full,), _ = play([walk([3, 1], win=[1.0, 0.0])], "full", n=2)
    rows = list(training_group(group).trajectories)

    def ref(t: Trajectory) -> list[float]:  # a reference 0.3 nats above the sampler on each token
        return [
            lp + 0.3 * m
            for lp, m in zip(
                t.logprobs[t.prompt_length :], t.policy_mask[t.prompt_length :], strict=True
            )
        ]

    def values(t: Trajectory) -> list[float]:
        return [0.1 * i for i in range(len(t.completion_ids))]

    def episode_values(t: Trajectory, row_of_turn: list[Trajectory]) -> list[float]:
        out = [0.0] * len(t.completion_ids)
        for span, row in zip(t.turns, row_of_turn, strict=True):
            out[span.start - t.prompt_length : span.end - t.prompt_length] = on_turn(
                row, values(row)
            )
        return out

    by_episode = [rows[:3], rows[3:]]
    got = assign_credit(
        rows, cfg, ref_logprobs=[ref(r) for r in rows], values=[values(r) for r in rows]
    )
    want = assign_credit(
        list(full.trajectories),
        cfg,
        ref_logprobs=[ref(t) for t in full.trajectories],
        values=[episode_values(t, by_episode[i]) for i, t in enumerate(full.trajectories)],
    )
    assert got.metrics["kl"] == pytest.approx(want.metrics["kl"])
    flat_got = [
        v for row, r in zip(rows, got.token_advantages, strict=True) for v in on_turn(row, r)
    ]
    flat_want = [
        v
        for t, r in zip(full.trajectories, want.token_advantages, strict=True)
        for v, m in zip(r, t.policy_mask[t.prompt_length :], strict=True)
        if m
    ]
    assert flat_got == pytest.approx(flat_want)
    if algorithm == "ppo":
        assert got.returns is not None and [len(r) for r in got.returns] == [
            len(r.completion_ids) for r in rows
        ]


def test_collect_groups_filters_episodes_and_hands_over_turn_rows() -> None:
    tasks = [walk([3, 1], win=[1.0, 0.0], task_id="a"), walk([2, 2], task_id="b")]
    (groups, _) = play(tasks, "window", k=1, n=2)
    cfg = credit_cfg("trajectory", "sampling.prompts_per_step=2", "filter.drop_zero_std=true")
    sampled, kept, metrics = collect_groups(cfg, lambda: groups)
    assert (
        sampled == groups and metrics["rollout/filter_kept_ratio"] == 0.5
    )  # "b" has equal rewards
    assert [r.turn_of.index for r in flatten(kept)] == [0, 1, 2, 0]  # type: ignore[union-attr]
    # A group sampled by an older run (full history) is left as it was.
    (full,), _ = play(tasks[:1], "full", n=2)
    assert collect_groups(cfg, lambda: [full])[1] == [full]


def test_an_episode_whose_reset_failed_stays_one_row() -> None:
    class Broken(WalkEnv):
        def reset(self) -> EnvReset:
            raise RuntimeError("no")

    gen = EchoGenerator()
    limits = RolloutLimits(env_workers=1, history="window", history_turns=1)
    (group,) = rollout_groups(
        [walk([1, 1])], Broken, gen, TOK, SamplingParams(n=2, max_new_tokens=8), Scoring(), limits
    )
    assert training_group(group) is group  # no turns, no history: nothing to split
    assert assign_credit(list(group.trajectories), credit_cfg("turn")).token_advantages == [[], []]


# ---------------------------------------------------------------------------- the tiny model
class Recording:
    def __init__(self, inner: Any) -> None:
        self.inner, self.prompts = inner, set[tuple[int, ...]]()

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Any:
        self.prompts.update(tuple(p) for p in prompts)
        return self.inner.generate(prompts, sampling)

    def __getattr__(self, name: str) -> Any:  # turn_session and the rest
        return getattr(self.inner, name)


@pytest.mark.parametrize("k", [1, 2])
def test_tiny_model_samples_are_token_exact(tiny_model_dir: Path, k: int) -> None:
    policy = load_policy(str(tiny_model_dir))
    model, tok = policy.model.eval(), policy.tokenizer
    sampler = HFGenerator(model, tok, eos_token_ids(model, tok), seed=7, autocast_bf16=False)
    gen = Recording(sampler)
    limits = RolloutLimits(max_total_tokens=600, env_workers=1, history="window", history_turns=k)
    groups = rollout_groups(
        [walk([5, 3]), walk([4, 1], task_id="w2")],
        WalkEnv,
        gen,
        tok,
        SamplingParams(n=2, temperature=1.0, max_new_tokens=6),
        Scoring(),
        limits,
    )
    rows = [row for g in groups for row in training_group(g).trajectories]
    assert len(rows) == 5 + 3 + 4 + 1
    for row in rows:
        prompt = row.token_ids[: row.turns[0].start]
        assert prompt in gen.prompts  # exactly the ids the sampler was sent
        assert row.turn_of is not None
        episode, turn = row.turn_of.episode, row.turn_of.index
        # Re-rendered from messages: the opening, then the kept turns as sampled (special tokens
        # kept, the template's closing standing in for a sampled EOS), the observations as sent.
        observations = [m for m in episode.messages if m["role"] == "user"]
        messages = [*OPENING]
        for j in range(max(0, turn - k), turn):
            sampled = list(episode.token_ids[episode.turns[j].start : episode.turns[j].end])
            if sampled and sampled[-1] in eos_token_ids(model, tok):
                sampled = sampled[:-1]
            messages += [
                {"role": "assistant", "content": str(tok.decode(sampled))},
                dict(observations[j]),
            ]
        # Compared as text: a sampled special token (<unk> here) decodes to text that would not
        # tokenize back to it, which is why the engine never re-tokenizes.
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.decode(list(prompt)) == rendered
    # The trainer's log-probs of every sample equal the sampler's (fp32 both, temperature 1).
    batch = collate(rows, [[0.0] * len(r.completion_ids) for r in rows], int(tok.pad_token_id))
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, 1.0)
    assert batch.prompt_ids_P_Lp.shape[0] == 1  # one opening (both tasks share it) for 13 rows
    on = batch.mask_B_C != 0
    assert int(on.sum()) == sum(r.num_policy_tokens for r in rows)
    assert (logp[on] - batch.behaviour_logprobs_B_C[on]).abs().max() < 1e-4


def test_a_short_window_run_trains(tiny_model_dir: Path, tmp_path: Path) -> None:
    from rlvr.observe.tracking import read_metrics
    from rlvr.train.loop import train

    for name in ("tiny_multiturn.yaml", "tiny_envs.py"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
    cfg = load_config(
        tmp_path / "tiny_multiturn.yaml",
        [
            f"model.name={tiny_model_dir}",
            f"output_dir={tmp_path / 'run'}",
            "rollout.history=window",
            "rollout.history_turns=1",
            "train.steps=3",
            "model.bf16=off",
            "eval.at_start=false",
            "eval.at_end=false",
            "tracking.progress=false",
        ],
    )
    summary = train(cfg, config_dir=tmp_path)
    rows = [m for m in read_metrics(summary.run_dir) if "loss" in m]
    assert len(rows) == 3
    for m in rows:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
        # One row per turn: 4 prompts x 8 episodes x ~3 turns, not 32 episodes.
        assert m["update/rows_trained"] == pytest.approx(32 * m["turns/mean"])
    before = load_policy(str(tiny_model_dir)).model.state_dict()
    after = load_policy(str(summary.run_dir / "checkpoints" / "step-000003" / "model")).model
    changed = [n for n, p in after.state_dict().items() if not torch.equal(p, before[n])]
    assert changed


def test_env_check_shows_the_windowed_prompts() -> None:
    from rlvr.authoring.check import check_env

    lines: list[str] = []
    problems = check_env(
        "frozenlake",
        tokenizer=TOK,
        episodes=1,
        history="window",
        history_turns=1,
        write=lines.append,
    )
    out = "\n".join(lines)
    assert problems == 0, out
    assert "history: window of 1 turn(s)" in out
    assert "--- turn 2 prompt: the opening + turn 1 (the window is not full yet)" in out
    # Turn 3 kept turn 2 only: its answer, then the observation after it.
    turn3 = out.split("--- turn 3 prompt", 1)[1].split("--- turn 3:", 1)[0]
    assert "turn 1 dropped, then turn 2 as sampled" in turn3
    assert turn3.count("<answer>") == 3  # turn 2's answer, the observation's format hint (2)
