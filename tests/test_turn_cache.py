"""The cross-turn KV cache (rlvr.rollout.turn_cache, HFGenerator.turn_session) on the tiny model.

Every comparison runs the same seeded generator twice, with the cache and without it: the same
tokens (sampled and greedy: the cache changes no random draw) and behaviour log-probs within 1e-5.
All generators here are pinned to fp32 (`autocast_bf16=False`), so 1e-5 holds on every CPU.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from rlvr.envs.base import Env, EnvReset, EnvStep
from rlvr.models import eos_token_ids, load_policy
from rlvr.optim import adamw
from rlvr.records import Task
from rlvr.rollout.engine import RolloutLimits, run_episodes
from rlvr.rollout.generator import Completion, SamplingParams
from rlvr.rollout.hf import HFGenerator

TOL = 1e-5


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Any]:
    policy = load_policy(str(tiny_model_dir))
    policy.model.eval()
    return policy.model, policy.tokenizer


def make_gen(model: Any, tok: Any, cached: bool, **kwargs: Any) -> HFGenerator:
    return HFGenerator(
        model,
        tok,
        eos_token_ids(model, tok),
        seed=kwargs.pop("seed", 5),
        autocast_bf16=False,  # fp32: log-probs compare to 1e-5
        turn_cache=cached,
        **kwargs,
    )


@contextlib.contextmanager
def eos_bias(model: Any, eos: int, value: float) -> Iterator[None]:
    """Make EOS likely, so rows end at different steps (and leave the decode batch mid-way)."""

    def hook(module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        add = torch.zeros(output.shape[-1])
        add[eos] = value
        return output + add

    handle = model.lm_head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def fed_tokens(model: Any) -> Iterator[list[int]]:
    """Count the input positions fed to the model (prefill + decode)."""
    count = [0]

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        count[0] += int(kwargs["input_ids"].numel())

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield count
    finally:
        handle.remove()


def glue(tok: Any, turn: int, row: int) -> list[int]:
    """An observation of a different length per row and turn."""
    return tok.encode(f"<obs {turn}:{'x' * (row % 3 + turn)}>", add_special_tokens=False)


def play(
    generator: HFGenerator,
    tok: Any,
    openings: Sequence[Sequence[int]],
    turns: int,
    sampling: SamplingParams,
    extra: Sequence[int] | None = None,
) -> tuple[list[list[Completion]], list[dict[str, int]]]:
    """`turns` generate calls inside one session; each conversation continues with its sampled tokens
    + a glue. `extra` (a fresh prompt) joins the later calls: a batch of cached and uncached rows."""
    prompts = [list(p) for p in openings]
    out: list[list[Completion]] = []
    stats: list[dict[str, int]] = []
    with generator.turn_session() as store:
        for turn in range(turns):
            batch = prompts + ([list(extra)] if extra is not None and turn > 0 else [])
            results = generator.generate(batch, sampling)
            out.append([c for group in results for c in group])
            if store is not None:
                stats.append(dict(store.stats))
            n = sampling.n
            prompts = [
                [*batch[i // n], *results[i // n][i % n].token_ids, *glue(tok, turn, i)]
                for i in range(len(prompts) * (n if turn == 0 else 1))
            ]
            sampling = SamplingParams(
                n=1,
                temperature=sampling.temperature,
                max_new_tokens=sampling.max_new_tokens,
            )
    assert generator.turns is None  # the session dropped its store
    return out, stats


def assert_same(plain: list[list[Completion]], cached: list[list[Completion]]) -> None:
    for turn_plain, turn_cached in zip(plain, cached, strict=True):
        for a, b in zip(turn_plain, turn_cached, strict=True):
            assert a.token_ids == b.token_ids
            assert a.finish_reason == b.finish_reason
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < TOL


def openings(tok: Any) -> list[list[int]]:
    # Different lengths: rows carry different left padding and different cached lengths.
    return [
        tok.encode(text, add_special_tokens=False)
        for text in ("Q: 2+3=", "a somewhat longer opening prompt, with more: ", "hi")
    ]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_turns_sample_what_the_plain_prefill_samples(
    tiny: tuple[Any, Any], temperature: float
) -> None:
    model, tok = tiny
    (eos,) = eos_token_ids(model, tok)
    sampling = SamplingParams(n=2, temperature=temperature, max_new_tokens=7)
    with eos_bias(model, eos, 4.0 if temperature else 0.0):
        with fed_tokens(model) as plain_fed:
            plain, _ = play(make_gen(model, tok, False), tok, openings(tok), 4, sampling)
        with fed_tokens(model) as cached_fed:
            cached, stats = play(make_gen(model, tok, True), tok, openings(tok), 4, sampling)
    assert_same(plain, cached)
    # Turns 2-4 continued all 6 conversations from the store; only the glue (+ the last sampled
    # token) was prefilled, so the model saw far fewer positions.
    assert stats[-1]["hits"] == 18 and stats[-1]["misses"] == 3
    assert stats[-1]["reused_tokens"] > stats[-1]["prefilled_tokens"]
    assert cached_fed[0] < plain_fed[0] - stats[-1]["reused_tokens"] // 2
    if temperature:  # some rows ended on a sampled EOS before others (dropped from the batch)
        ends = [c.finish_reason for turn in cached for c in turn]
        assert "stop" in ends and "length" in ends


def test_a_fresh_prompt_batched_with_continued_ones(tiny: tuple[Any, Any]) -> None:
    """Cached rows and a plain (shared-prefix-free) row stacked into one decode batch."""
    model, tok = tiny
    extra = tok.encode("a brand new conversation joins later", add_special_tokens=False)
    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=6)
    plain, _ = play(make_gen(model, tok, False), tok, openings(tok), 3, sampling, extra)
    cached, stats = play(make_gen(model, tok, True), tok, openings(tok), 3, sampling, extra)
    assert_same(plain, cached)
    assert stats[1]["hits"] == 3 and stats[1]["misses"] == 3 + 1


def test_rows_past_the_memory_cap_fall_back_to_the_plain_prefill(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    plain, _ = play(make_gen(model, tok, False), tok, openings(tok), 3, sampling)
    probe = make_gen(model, tok, True)
    with probe.turn_session() as store:
        assert store is not None
        probe.generate(openings(tok)[:1], SamplingParams(n=1, max_new_tokens=6))
        one_row = next(iter(store.entries.values())).nbytes
    # Room for about two rows of six: the rest prefill in full next turn.
    small = make_gen(model, tok, True, turn_cache_mb=2.5 * one_row / 2**20)
    cached, stats = play(small, tok, openings(tok), 3, sampling)
    assert_same(plain, cached)
    assert stats[0]["not_kept"] >= 3
    assert 0 < stats[1]["hits"] < 6 and stats[1]["misses"] > 3


def test_a_weight_update_inside_a_session_drops_the_store(tiny: tuple[Any, Any]) -> None:
    """An optimizer step between turns: the next turn must not reuse keys/values of the old weights."""
    base, tok = tiny
    model = copy.deepcopy(base)
    sampling = SamplingParams(n=1, temperature=0.0, max_new_tokens=5)
    prompts = openings(tok)
    generator = make_gen(model, tok, True)
    optimizer = adamw(model.parameters(), lr=0.05, betas=(0.9, 0.99), weight_decay=0.0)
    with generator.turn_session() as store:
        assert store is not None
        first = generator.generate(prompts, sampling)
        assert len(store.entries) == 3
        model.train()
        loss = model(input_ids=torch.tensor([prompts[0]])).logits.float().pow(2).mean()
        loss.backward()
        optimizer.step()
        model.eval()
        nxt = [
            [*p, *g[0].token_ids, *glue(tok, 0, i)]
            for i, (p, g) in enumerate(zip(prompts, first, strict=True))
        ]
        after = generator.generate(nxt, sampling)
        assert store.stats["invalidated"] == 1 and store.stats["hits"] == 0
    fresh = make_gen(model, tok, False).generate(nxt, sampling)
    assert_same([[g[0] for g in fresh]], [[g[0] for g in after]])


class CountdownEnv(Env):
    """Episodes of different lengths: task k ends after k + 1 steps; a fixed observation between."""

    max_turns = 6

    def __init__(self, task: Task) -> None:
        self.task = task
        self.left = int(task.id)

    def reset(self) -> EnvReset:
        return EnvReset([dict(m) for m in self.task.messages])

    def step(self, assistant_text: str) -> EnvStep:
        self.left -= 1
        return EnvStep(
            messages=[{"role": "user", "content": f"go on ({self.left})"}],
            rewards={"len": float(len(assistant_text))},
            done=self.left < 0,
        )


def tasks() -> list[Task]:
    return [
        Task(id=str(k), messages=({"role": "user", "content": f"count {'down ' * k}from {k}"},))
        for k in (0, 2, 3)
    ]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_episodes_equal_with_and_without_the_cache(
    tiny: tuple[Any, Any], temperature: float
) -> None:
    model, tok = tiny
    sampling = SamplingParams(n=2, temperature=temperature, max_new_tokens=6)
    limits = RolloutLimits(max_total_tokens=400, env_workers=1)
    runs, fed = [], []
    for cached in (False, True):
        generator = make_gen(model, tok, cached)
        with fed_tokens(model) as count:
            runs.append(run_episodes(tasks(), CountdownEnv, generator, tok, sampling, limits))
        fed.append(count[0])
        assert generator.turns is None  # dropped when the rollout returned
    for group_plain, group_cached in zip(*runs, strict=True):
        for a, b in zip(group_plain, group_cached, strict=True):
            assert a.token_ids == b.token_ids and a.policy_mask == b.policy_mask
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < TOL
    assert sorted(len(ep.turns) for group in runs[1] for ep in group) == [1, 1, 3, 3, 4, 4]
    assert fed[1] < 0.6 * fed[0]


def test_single_turn_rollouts_open_no_session(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    generator = make_gen(model, tok, True)
    opened: list[bool] = []
    real = generator.turn_session

    def spy() -> Any:
        opened.append(True)
        return real()

    generator.turn_session = spy
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=4)
    limits = RolloutLimits(max_turns=1, max_total_tokens=50, env_workers=1)
    run_episodes(tasks(), CountdownEnv, generator, tok, sampling, limits)
    assert opened == []
    run_episodes(tasks(), CountdownEnv, generator, tok, sampling, RolloutLimits(env_workers=1))
    assert opened == [True]


@pytest.mark.parametrize("on", [True, False])
def test_the_config_knob_reaches_the_generator(tiny_model_dir: Path, on: bool) -> None:
    from rlvr.build import build_generator
    from rlvr.config import load_config

    assert load_config(None).generator.turn_cache is True  # on by default
    cfg = load_config(
        None,
        [
            "model.bf16='off'",
            f"generator.turn_cache={str(on).lower()}",
            "generator.turn_cache_mb=3",
        ],
    )
    generator = build_generator(load_policy(str(tiny_model_dir)), cfg)
    with generator.turn_session() as store:
        assert (store is not None) == on
        assert store is None or store.max_bytes == 3 * 2**20


def test_ray_workers_timing_wrapper_keeps_the_session(tiny: tuple[Any, Any]) -> None:
    """Ray rollout workers wrap their generator to time it; the wrapper must pass the engine's
    turn session through, or multi-turn rollouts on Ray would silently re-prefill every turn."""
    from rlvr.scale.ray_rollout import _TimedGenerator

    inner = make_gen(*tiny, cached=True)
    wrapped = _TimedGenerator(inner)
    assert inner.turns is None
    with wrapped.turn_session():
        assert inner.turns is not None  # the inner store is open for the rollout
    assert inner.turns is None
