"""`decode: fast` inside turn sessions: the fast path's static cache with the cross-turn KV cache on.

A multi-turn batch (the same conversations, continued with their sampled tokens and an observation
glue of a different length per row and turn) runs three ways, seeded alike: the fast path with the
turn cache, HF's path with the turn cache, and the fast path without it. Greedy and sampled tokens
are identical (the paths draw the same uniforms), finish reasons too, behaviour log-probs within
1e-5 (all fp32, `autocast_bf16=False`). The bf16 copy is held to the bound test_fast_decode uses:
its log-probs within bf16 rounding of HF's fp32 forward on the same tokens, teacher-forced.
Helpers and models come from test_fast_decode (tiny random Llama / Qwen2 / Qwen3 / Mistral) and
test_turn_cache (the engine's countdown env).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from rlvr.models import eos_token_ids
from rlvr.optim import adamw
from rlvr.precision import BF16_LOGPROB_GAP
from rlvr.rollout.engine import RolloutLimits, run_episodes
from rlvr.rollout.fast_decode import DecodeWeights, StaticDecode
from rlvr.rollout.generator import Completion, SamplingParams
from rlvr.rollout.hf import HFDecode, HFGenerator
from rlvr.rollout.turn_cache import extract_rows
from test_fast_decode import (
    KINDS,
    PROMPTS,
    STOPS,
    TOL,
    assert_same,
    hf_logprobs,
    make_gen,
    tiny_model,
)
from test_turn_cache import CountdownEnv, tasks

GLUE = [60, 61, 62, 63, 64, 65, 66]
EXTRA = [70, 71, 72, 73, 74, 75, 76, 77, 78, 79]  # a fresh conversation joining later turns


class Played:
    """Per turn: the completions (flat, in batch order), the prompts, the store's counters, and
    whether the fast path's weights ran."""

    def __init__(self) -> None:
        self.out: list[list[Completion]] = []
        self.prompts: list[list[list[int]]] = []
        self.stats: list[dict[str, int]] = []
        self.fast: list[bool] = []


def play(
    generator: HFGenerator,
    turns: int,
    sampling: SamplingParams,
    extra: Sequence[int] | None = EXTRA,
    between: Callable[[int], None] | None = None,
    openings: Sequence[Sequence[int]] = PROMPTS,
) -> Played:
    """`turns` generate calls in one session: each conversation continues with its sampled tokens
    and a glue of 3-6 tokens; `extra` joins the later calls (cached and uncached rows in one
    batch); `between(turn)` runs before each later call (a weight update, a hook)."""
    played = Played()
    prompts = [list(p) for p in openings]
    with generator.turn_session() as store:
        for turn in range(turns):
            if between is not None and turn > 0:
                between(turn)
            batch = prompts + ([list(extra)] if extra is not None and turn > 0 else [])
            results = generator.generate(batch, sampling)
            played.out.append([c for group in results for c in group])
            played.prompts.append([batch[i] for i, group in enumerate(results) for _ in group])
            played.stats.append(dict(store.stats) if store is not None else {})
            played.fast.append(generator._fast is not None)
            n = sampling.n
            prompts = [
                [*batch[i // n], *results[i // n][i % n].token_ids, *GLUE[: 3 + (i + turn) % 4]]
                for i in range(len(prompts) * n)
            ]
            sampling = dataclasses.replace(sampling, n=1)
    assert generator.turns is None  # the session dropped its store
    return played


def assert_turns_same(a: Played, b: Played, tol: float = TOL) -> None:
    assert len(a.out) == len(b.out)
    for turn_a, turn_b in zip(a.out, b.out, strict=True):
        assert_same([turn_a], [turn_b], tol)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", KINDS)
def test_fast_turns_equal_hf_turns_and_the_plain_prefill(kind: str, temperature: float) -> None:
    """Four turns, n=2 on the first, rows leaving at stop strings, a fresh prompt in later calls,
    shared prefixes in the plain prefill (min_shared_prefix 4)."""
    model = tiny_model(kind)
    sampling = SamplingParams(n=2, temperature=temperature, max_new_tokens=8, stop=STOPS)
    kw: dict[str, Any] = {"min_shared_prefix": 4}
    fast = play(make_gen(model, "fast", turn_cache=True, **kw), 4, sampling)
    hf = play(make_gen(model, "hf", turn_cache=True, **kw), 4, sampling)
    plain = play(make_gen(model, "fast", turn_cache=False, **kw), 4, sampling)
    assert all(fast.fast) and all(plain.fast)  # the fast path ran every turn, cached or not
    assert_turns_same(fast, hf)
    assert_turns_same(fast, plain)
    # Turns 2-4 continued all 8 conversations from the store; the fresh prompt missed each time.
    assert fast.stats[-1]["hits"] == 3 * 8 and fast.stats[-1]["misses"] == 4 + 3
    assert fast.stats == hf.stats
    assert fast.stats[-1]["reused_tokens"] > fast.stats[-1]["prefilled_tokens"]
    if temperature:
        ends = [c.finish_reason for turn in fast.out for c in turn]
        assert "stop" in ends and "length" in ends  # rows left the decode batch mid-way


def test_entries_from_either_path_fit_the_other() -> None:
    """One prefill of left-padded rows on each path: the rows copied out agree (per layer
    (kv_heads, length, head_dim), padding dropped), and the fast path continued from HF's entries
    computes the logits it computes from its own."""
    model = tiny_model("qwen3")
    generator = make_gen(model, "hf")
    weights = DecodeWeights.build(model)
    prompts = PROMPTS[:3]
    static = StaticDecode(weights, reserve=2)
    hf = HFDecode(generator)
    with torch.no_grad():
        _, mask, _ = generator._prefill_plain(prompts, static)
        generator._prefill_plain(prompts, hf)
    rows = range(len(prompts))
    ours, theirs = static.extract(mask, rows), extract_rows(hf.cache, mask, rows)
    for a, b, prompt in zip(ours, theirs, prompts, strict=True):
        assert a.length == b.length == len(prompt)
        assert a.keys[0].shape == b.keys[0].shape == (weights.kv_heads, len(prompt), 32)
        for x, y in zip([*a.keys, *a.values], [*b.keys, *b.values], strict=True):
            torch.testing.assert_close(x, y, rtol=0.0, atol=TOL)
    tails = [[90, 91], [92], [93, 94, 95]]
    logits = []
    for entries in (ours, theirs):
        decoder, past_mask, past_length = StaticDecode.from_entries(weights, entries, 2, 3)
        with torch.no_grad():
            logits.append(generator._prefill_plain(tails, decoder, past_mask, past_length)[0])
    torch.testing.assert_close(logits[0], logits[1], rtol=0.0, atol=TOL)


def test_engine_episodes_fast_with_the_cache(lora_policy: Any) -> None:
    """The engine's multi-turn rollout (episodes of 1-4 turns, LoRA merged into the copy): the same
    episodes as HF's path with the cache and as the fast path without it."""
    model, tok = lora_policy.model, lora_policy.tokenizer
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    limits = RolloutLimits(max_total_tokens=400, env_workers=1)
    runs, stores = [], []
    for decode, cached in (("fast", True), ("hf", True), ("fast", False)):
        generator = HFGenerator(
            model,
            tok,
            eos_token_ids(model, tok),
            seed=3,
            autocast_bf16=False,
            turn_cache=cached,
            decode=decode,  # type: ignore[arg-type]
        )
        seen: list[Any] = []
        generator.turn_session = recording(generator.turn_session, seen)  # type: ignore[method-assign]
        runs.append(run_episodes(tasks(), CountdownEnv, generator, tok, sampling, limits))
        stores.append(seen[0].stats if seen and seen[0] is not None else None)
        assert (generator._fast is not None) == (decode == "fast")
    for other in runs[1:]:
        for group_a, group_b in zip(runs[0], other, strict=True):
            for a, b in zip(group_a, group_b, strict=True):
                assert a.token_ids == b.token_ids and a.policy_mask == b.policy_mask
                gap = max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True))
                assert gap < TOL
    assert sorted(len(ep.turns) for group in runs[0] for ep in group) == [1, 1, 3, 3, 4, 4]
    assert stores[0] is not None and stores[0] == stores[1] and stores[0]["hits"] > 0
    assert stores[2] is None


def recording(real: Callable[[], Any], seen: list[Any]) -> Callable[[], Any]:
    """`turn_session` that also records the store it opens."""

    @contextlib.contextmanager
    def session() -> Iterator[Any]:
        with real() as store:
            seen.append(store)
            yield store

    return session


def test_the_bf16_copy_in_turns_stays_within_bf16_rounding() -> None:
    """The bf16 copy with the cache: the fast path ran in bf16 every turn, reused the store, and
    every sampled token's log-prob is within bf16 rounding of HF's fp32 forward over the whole
    conversation (the bound test_fast_decode's bf16 test uses)."""
    model = tiny_model("llama")
    generator = make_gen(model, "fast", turn_cache=True, decode_dtype=torch.bfloat16)
    played = play(generator, 3, SamplingParams(n=2, temperature=0.0, max_new_tokens=8))
    assert all(played.fast) and generator._fast is not None
    assert generator._fast.dtype == torch.bfloat16
    assert played.stats[-1]["hits"] == 2 * 8
    gaps = torch.cat(
        [
            (torch.tensor(c.logprobs) - hf_logprobs(model, prompt, c)).abs()
            for prompts, out in zip(played.prompts, played.out, strict=True)
            for prompt, c in zip(prompts, out, strict=True)
        ]
    )
    assert 0 < float(gaps.mean()) < BF16_LOGPROB_GAP
    assert float(gaps.max()) < 2 * BF16_LOGPROB_GAP


def test_a_weight_update_between_turns_drops_the_store() -> None:
    """Fused AdamW between turns (no version bump): that turn rebuilds the copy, reuses nothing,
    and samples what the plain path samples from the same random state; the next turn caches
    again. An update between sessions: the next session samples from the new weights."""
    model = tiny_model("qwen2")
    optimizer = adamw(list(model.parameters()), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0)

    def step() -> None:
        model(input_ids=torch.tensor([PROMPTS[0]])).logits.sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=6)
    generator = make_gen(model, "fast", turn_cache=True)
    states: list[torch.Tensor] = []

    def update(turn: int) -> None:
        if turn == 1:
            step()
            states.append(generator.get_state())

    played = play(generator, 3, sampling, between=update)
    assert played.stats[1]["invalidated"] == 1 and played.stats[1]["hits"] == 0
    assert played.stats[2]["hits"] == 4  # cached again under the new weights
    for decode in ("fast", "hf"):
        replay = make_gen(model, decode)
        replay.set_state(states[0])
        assert_same(
            [played.out[1]],
            [[g[0] for g in replay.generate(played.prompts[1], sampling)]],
        )

    step()  # between sessions
    start = generator.get_state()
    again = play(generator, 2, sampling)
    assert again.stats[1]["hits"] == 4 and again.stats[1]["invalidated"] == 0
    plain = make_gen(model, "hf")
    plain.set_state(start)
    assert_turns_same(again, play(plain, 2, sampling))


def test_switching_adapters_or_paths_mid_session_drops_the_store(lora_policy: Any) -> None:
    """What computed the entries is part of the store's key: adapters disabled between turns (the
    copy is rebuilt from the base weights), and a forward hook that sends the call to HF's forward,
    each drop the store; every turn equals HF's path without the cache under the same switch."""
    model = lora_policy.model
    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=6)

    def with_adapters_off_from_turn_1(generator: HFGenerator) -> Played:
        with contextlib.ExitStack() as stack:
            return play(
                generator,
                3,
                sampling,
                between=lambda turn: (
                    stack.enter_context(model.disable_adapter()) if turn == 1 else None
                ),
            )

    fast = with_adapters_off_from_turn_1(make_gen(model, "fast", turn_cache=True))
    assert fast.fast == [True, True, True]
    assert fast.stats[1]["invalidated"] == 1 and fast.stats[1]["hits"] == 0
    assert fast.stats[2]["hits"] == 4
    assert_turns_same(fast, with_adapters_off_from_turn_1(make_gen(model, "hf")))

    lm_head = model.get_base_model().lm_head
    with contextlib.ExitStack() as stack:
        generator = make_gen(model, "fast", turn_cache=True)
        with pytest.warns(UserWarning, match="falls back to HF"):
            hooked = play(
                generator,
                3,
                sampling,
                between=lambda turn: (
                    stack.callback(lm_head.register_forward_hook(lambda m, a, o: o).remove)
                    if turn == 1
                    else None
                ),
            )
    assert hooked.fast == [True, False, False]
    assert hooked.stats[1]["invalidated"] == 1 and hooked.stats[1]["hits"] == 0
    assert hooked.stats[2]["hits"] == 4
    assert_turns_same(hooked, play(make_gen(model, "hf"), 3, sampling))


def test_rows_past_the_memory_cap_take_the_plain_prefill() -> None:
    model = tiny_model("llama")
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    probe = make_gen(model, "fast", turn_cache=True)
    with probe.turn_session() as store:
        assert store is not None
        probe.generate(PROMPTS[:1], SamplingParams(n=1, max_new_tokens=6))
        one_row = next(iter(store.entries.values())).nbytes
    mb = 3.5 * one_row / 2**20  # room for about three rows of eight
    small = play(make_gen(model, "fast", turn_cache=True, turn_cache_mb=mb), 3, sampling)
    assert small.stats[0]["not_kept"] >= 4
    assert 0 < small.stats[1]["hits"] < 8 and small.stats[1]["misses"] > 1
    assert_turns_same(small, play(make_gen(model, "fast", turn_cache=False), 3, sampling))
    assert_turns_same(
        small, play(make_gen(model, "hf", turn_cache=True, turn_cache_mb=mb), 3, sampling)
    )


def test_unsupported_models_keep_hfs_path_with_the_cache() -> None:
    """A model the fast path declines: HF's forward with HF's turn cache, one warning, the same
    samples and store counters as decode "hf"."""
    model = tiny_model("mistral")
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, stop=STOPS)
    generator = make_gen(model, "fast", turn_cache=True)
    with pytest.warns(UserWarning, match="falls back to HF"):
        fast = play(generator, 3, sampling)
    assert not any(fast.fast) and "MistralForCausalLM" in (generator.fast_decode_declined or "")
    hf = play(make_gen(model, "hf", turn_cache=True), 3, sampling)
    assert_turns_same(fast, hf)
    assert fast.stats == hf.stats and fast.stats[-1]["hits"] == 2 * 8


def test_hf_decode_keeps_its_store_key() -> None:
    """decode "hf" (the default) keys its store by the weights alone, as before the fast path
    could run in turn sessions."""
    from rlvr.rollout.turn_cache import weights_fingerprint

    model = tiny_model("llama")
    generator = make_gen(model, "hf", turn_cache=True)
    with generator.turn_session() as store:
        assert store is not None
        generator.generate(PROMPTS, SamplingParams(n=1, max_new_tokens=3))
        assert store.fingerprint == weights_fingerprint(model)
