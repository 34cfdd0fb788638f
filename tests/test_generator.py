"""HFGenerator and sample_from_logits on the tiny random model (rlvr.rollout.hf)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from rlvr.models import eos_token_ids, load_policy
from rlvr.rollout.generator import Completion, SamplingParams
from rlvr.rollout.hf import HFGenerator, sample_from_logits


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Any]:
    """The tiny random Llama (written once per session by conftest), loaded once per module."""
    policy = load_policy(str(tiny_model_dir))
    policy.model.eval()
    return policy.model, policy.tokenizer


def make_gen(tiny: tuple[Any, Any], seed: int = 0, **kwargs: Any) -> HFGenerator:
    model, tok = tiny
    kwargs.setdefault("autocast_bf16", False)  # fp32, so log-probs compare to 1e-4
    return HFGenerator(model, tok, eos_token_ids(model, tok), seed=seed, **kwargs)


def ids(tok: Any, text: str) -> list[int]:
    out = tok.encode(text, add_special_tokens=False)
    assert len(out) == len(text)  # character-level vocabulary
    return out


def eos_id(tiny: tuple[Any, Any]) -> int:
    (eos,) = eos_token_ids(*tiny)
    return eos


def full_forward_logprobs(
    model: Any, prompt: Sequence[int], completion: Sequence[int], temperature: float
) -> torch.Tensor:
    """Log-probs of `completion` from one plain forward over prompt + completion (no cache)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[*prompt, *completion]])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return torch.stack([logprobs[len(prompt) - 1 + j, tok] for j, tok in enumerate(completion)])


def argmax_decode(model: Any, prompt: Sequence[int], max_new: int, eos: int) -> list[int]:
    """Greedy decoding the slow way: a full forward per step, no cache, no padding."""
    seq, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            token = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            out.append(token)
            seq.append(token)
            if token == eos:
                break
    return out


@contextlib.contextmanager
def lm_head_hook(model: Any, hook: Any) -> Iterator[None]:
    handle = model.lm_head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def bias_hook(bias: dict[int, float]) -> Any:
    """Add a constant to some logits at every position (as an lm_head bias would)."""

    def hook(module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        add = torch.zeros(output.shape[-1])
        for token, value in bias.items():
            add[token] = value
        return output + add

    return hook


def script_hook(script: Sequence[int]) -> Any:
    """Make the generator emit `script` token by token: the k-th lm_head call (the prefill, then one
    call per decoding step) puts +50 on script[k]."""
    calls = [0]

    def hook(module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        add = torch.zeros(output.shape[-1])
        add[script[min(calls[0], len(script) - 1)]] = 50.0
        calls[0] += 1
        return output + add

    return hook


PROMPTS = ("Q: 2+3=", "a somewhat longer prompt, with more characters: ")


# --------------------------------------------------------------------------------------- log-probs
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_full_forward(tiny: tuple[Any, Any], temperature: float) -> None:
    model, tok = tiny
    prompts = [ids(tok, p) for p in PROMPTS]
    out = make_gen(tiny, seed=1).generate(
        prompts, SamplingParams(n=3, temperature=temperature, max_new_tokens=12)
    )
    for prompt, group in zip(prompts, out, strict=True):
        for c in group:
            assert len(c.logprobs) == len(c.token_ids) > 0
            expected = full_forward_logprobs(model, prompt, c.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, rtol=0.0, atol=1e-4)


def test_behaviour_logprobs_under_bf16_autocast_are_close(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    prompt = ids(tok, PROMPTS[1])
    out = make_gen(tiny, autocast_bf16=True).generate(
        [prompt], SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
    )
    for c in out[0]:
        expected = full_forward_logprobs(model, prompt, c.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, rtol=0.0, atol=0.05)


# --------------------------------------------------------------------------------------- greedy
def test_greedy_is_deterministic_and_equals_argmax_decoding(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    eos = eos_id(tiny)
    prompts = [ids(tok, p) for p in PROMPTS]
    sampling = SamplingParams(n=2, temperature=0.0, max_new_tokens=10)
    first = make_gen(tiny, seed=0).generate(prompts, sampling)
    second = make_gen(tiny, seed=99).generate(prompts, sampling)  # the seed plays no part
    assert first == second
    for prompt, group in zip(prompts, first, strict=True):
        expected = argmax_decode(model, prompt, 10, eos)
        for c in group:
            assert list(c.token_ids) == expected
            # greedy log-probs: the untempered softmax at the chosen tokens
            torch.testing.assert_close(
                torch.tensor(c.logprobs),
                full_forward_logprobs(model, prompt, c.token_ids, 1.0),
                rtol=0.0,
                atol=1e-4,
            )


def test_tiny_top_p_behaves_like_greedy(tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    prompts = [ids(tok, p) for p in PROMPTS]
    greedy = make_gen(tiny).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10))
    nucleus = make_gen(tiny, seed=3).generate(
        prompts, SamplingParams(n=3, temperature=1.0, top_p=1e-6, max_new_tokens=10)
    )
    for g_group, n_group in zip(greedy, nucleus, strict=True):
        for c in n_group:
            assert c.token_ids == g_group[0].token_ids
            # at temperature 1 the tempered and the untempered softmax coincide
            torch.testing.assert_close(
                torch.tensor(c.logprobs), torch.tensor(g_group[0].logprobs), rtol=0.0, atol=1e-6
            )


def test_left_padding_does_not_change_results(tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    short, long = ids(tok, "hi"), ids(tok, "a much, much longer prompt than the other one")
    sampling = SamplingParams(temperature=0.0, max_new_tokens=12)
    gen = make_gen(tiny)
    (alone,) = gen.generate([short], sampling)
    batched = gen.generate([long, short], sampling)
    assert batched[1][0].token_ids == alone[0].token_ids
    torch.testing.assert_close(
        torch.tensor(batched[1][0].logprobs), torch.tensor(alone[0].logprobs), rtol=0.0, atol=1e-5
    )
    (long_alone,) = gen.generate([long], sampling)
    assert batched[0][0].token_ids == long_alone[0].token_ids


def test_chunking_by_max_batch_rows_does_not_change_greedy(tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    prompts = [ids(tok, p) for p in ("one", "two two", "three three three")]
    sampling = SamplingParams(n=2, temperature=0.0, max_new_tokens=6)
    whole = make_gen(tiny).generate(prompts, sampling)
    chunked = make_gen(tiny, max_batch_rows=2).generate(prompts, sampling)  # one prompt a chunk
    assert [[c.token_ids for c in g] for g in chunked] == [[c.token_ids for c in g] for g in whole]


# --------------------------------------------------------------------------------------- sampling
def test_same_seed_same_samples_and_state_round_trip(tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    prompts = [ids(tok, p) for p in PROMPTS]
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=8)
    a = make_gen(tiny, seed=5).generate(prompts, sampling)
    b = make_gen(tiny, seed=5).generate(prompts, sampling)
    c = make_gen(tiny, seed=6).generate(prompts, sampling)
    assert a == b
    assert a != c

    gen = make_gen(tiny, seed=5)
    state = gen.get_state().clone()
    first = gen.generate(prompts, sampling)
    second = gen.generate(prompts, sampling)
    assert first == a
    assert second != first  # the sampler's state moved on
    gen.set_state(state)
    assert gen.generate(prompts, sampling) == first
    # a fresh generator handed the state continues exactly where the first one is
    other = make_gen(tiny, seed=123)
    other.set_state(gen.get_state())
    assert other.generate(prompts, sampling) == second


def test_n_samples_per_prompt(tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    prompts = [ids(tok, p) for p in ("x", "yy", "a longer one")]
    out = make_gen(tiny, seed=2).generate(
        prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=6)
    )
    assert len(out) == 3
    for group in out:
        assert len(group) == 4
        assert all(isinstance(c, Completion) and 1 <= len(c.token_ids) <= 6 for c in group)
        assert len({c.token_ids for c in group}) > 1  # independent samples


def test_empty_inputs(tiny: tuple[Any, Any]) -> None:
    gen = make_gen(tiny)
    assert gen.generate([], SamplingParams()) == []
    with pytest.raises(ValueError, match="empty prompt"):
        gen.generate([[5, 6], []], SamplingParams(max_new_tokens=2))


def test_generate_restores_training_mode(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    model.train()
    try:
        make_gen(tiny).generate([ids(tok, "abc")], SamplingParams(max_new_tokens=2))
        assert model.training
    finally:
        model.eval()


# --------------------------------------------------------------------------------------- finishing
def test_finish_length_when_max_new_tokens_is_hit(tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    eos = eos_id(tiny)
    out = make_gen(tiny).generate(
        [ids(tok, p) for p in PROMPTS], SamplingParams(n=2, temperature=0.0, max_new_tokens=5)
    )
    for group in out:
        for c in group:
            assert eos not in c.token_ids
            assert len(c.token_ids) == 5 and c.finish_reason == "length"


def test_scripted_eos_stops_with_eos_as_last_token(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    eos = eos_id(tiny)
    a, b = ids(tok, "ab")
    prompts = [ids(tok, p) for p in PROMPTS]
    with lm_head_hook(model, script_hook([a, b, eos, a])):
        out = make_gen(tiny).generate(prompts, SamplingParams(n=2, max_new_tokens=10))
    assert all(c.token_ids == (a, b, eos) and c.finish_reason == "stop" for g in out for c in g)
    # EOS sampled at the very last step still counts as "stop"
    with lm_head_hook(model, script_hook([a, b, eos])):
        (group,) = make_gen(tiny).generate(prompts[:1], SamplingParams(max_new_tokens=3))
    assert group[0].token_ids == (a, b, eos) and group[0].finish_reason == "stop"
    with lm_head_hook(model, script_hook([a, b, eos])):
        (group,) = make_gen(tiny).generate(prompts[:1], SamplingParams(max_new_tokens=2))
    assert group[0].token_ids == (a, b) and group[0].finish_reason == "length"


def test_sampled_eos_ends_completion(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    eos = eos_id(tiny)
    prompts = [ids(tok, p) for p in PROMPTS]
    # +3 on EOS: p(EOS) ~ e^3 / (e^3 + ~100) ~ 0.15 per step, so some rows stop, some run out.
    with lm_head_hook(model, bias_hook({eos: 3.0})):
        out = make_gen(tiny, seed=4).generate(
            prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=12)
        )
        finished = [(p, c) for p, g in zip(prompts, out, strict=True) for c in g]
        reasons = {c.finish_reason for _, c in finished}
        assert reasons == {"stop", "length"}
        for prompt, c in finished:
            assert eos not in c.token_ids[:-1]
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == eos
            else:
                assert len(c.token_ids) == 12 and c.token_ids[-1] != eos
            # the rows that stayed in the batch after others left still match a plain forward
            torch.testing.assert_close(
                torch.tensor(c.logprobs),
                full_forward_logprobs(model, prompt, c.token_ids, 1.0),
                rtol=0.0,
                atol=1e-4,
            )


# ----------------------------------------------------------------------------------- stop strings
def test_scripted_stop_string(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    script = ids(tok, "abxxcdef")
    prompt = ids(tok, PROMPTS[0])

    def run(stop: tuple[str, ...], max_new: int = 8) -> Completion:
        with lm_head_hook(model, script_hook(script)):
            (group,) = make_gen(tiny).generate(
                [prompt], SamplingParams(max_new_tokens=max_new, stop=stop)
            )
        return group[0]

    c = run(("xx",))
    assert tok.decode(c.token_ids) == "abxx" and c.finish_reason == "stop"
    c = run(("zz", "bx"))  # any of several; the earliest match ends it
    assert tok.decode(c.token_ids) == "abx" and c.finish_reason == "stop"
    c = run(("xxcd",))  # a stop string spanning several tokens
    assert tok.decode(c.token_ids) == "abxxcd" and c.finish_reason == "stop"
    c = run(("zz",))
    assert tok.decode(c.token_ids) == "abxxcdef" and c.finish_reason == "length"
    c = run(("ef",))  # matched on the last allowed token: "stop"
    assert tok.decode(c.token_ids) == "abxxcdef" and c.finish_reason == "stop"


def test_stop_string_split_by_special_tokens(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    x, a, b = ids(tok, "xab")
    im_start, unk = tok.convert_tokens_to_ids(["<|im_start|>", "<unk>"])
    script = [x, im_start, unk, x, a, b, a, b]
    with lm_head_hook(model, script_hook(script)):
        (group,) = make_gen(tiny).generate(
            [ids(tok, "hi")], SamplingParams(max_new_tokens=8, stop=("xx",))
        )
    # the completion text (decoded with skip_special_tokens, as the rollout does) reads "xx"
    # after the 4th token, so generation should end there
    assert tok.decode(group[0].token_ids[:4], skip_special_tokens=True) == "xx"
    assert group[0].token_ids == (x, im_start, unk, x)
    assert group[0].finish_reason == "stop"


def test_sampled_stop_string_property(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    (x,) = ids(tok, "x")
    eos = eos_id(tiny)
    prompts = [ids(tok, p) for p in PROMPTS]
    # +4 on "x": p(x) ~ e^4 / (e^4 + ~100) ~ 0.35, so "xx" shows up in some rows and not others.
    with lm_head_hook(model, bias_hook({x: 4.0})):
        out = make_gen(tiny, seed=8).generate(
            prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=12, stop=("xx",))
        )
    completions = [c for g in out for c in g]
    assert {c.finish_reason for c in completions} == {"stop", "length"}
    assert any("xx" in tok.decode(c.token_ids) for c in completions)
    for c in completions:
        text = tok.decode(c.token_ids, skip_special_tokens=True)
        before_last = tok.decode(c.token_ids[:-1], skip_special_tokens=True)
        assert "xx" not in before_last  # it stopped as soon as the text contained the stop string
        if c.finish_reason == "stop":
            assert "xx" in text or c.token_ids[-1] == eos  # by the stop string or by EOS
        else:
            assert len(c.token_ids) == 12 and "xx" not in text


# ------------------------------------------------------------------------------ sample_from_logits
def test_sample_from_logits_greedy_by_hand() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, -1.0, 5.0]])
    tokens, logprobs = sample_from_logits(
        logits, SamplingParams(temperature=0.0), torch.Generator().manual_seed(0)
    )
    assert tokens.tolist() == [1, 2]
    # row 0: 3 - logsumexp(1, 3, 2) = -log(1 + e^-2 + e^-1) = -log(1.503215) = -0.407606
    # row 1: 5 - logsumexp(0, -1, 5) = -log(1 + e^-5 + e^-6) = -log(1.009217) = -0.009175
    torch.testing.assert_close(logprobs, torch.tensor([-0.407606, -0.009175]), rtol=0, atol=1e-5)


def test_sample_from_logits_tempered_logprobs_and_frequencies() -> None:
    rows = 4000
    logits = torch.tensor([math.log(0.5), math.log(0.3), math.log(0.2)]).repeat(rows, 1)
    rng = torch.Generator().manual_seed(0)
    tokens, logprobs = sample_from_logits(logits, SamplingParams(temperature=1.0), rng)
    freq = torch.bincount(tokens, minlength=3).float() / rows
    # frequencies ~ [0.5, 0.3, 0.2]; binomial std at 4000 draws <= 0.008
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.2]), rtol=0, atol=0.03)
    # log-prob of each drawn token is log p: log 0.5 = -0.693147, log 0.3 = -1.203973, ...
    torch.testing.assert_close(logprobs, torch.log(torch.tensor([0.5, 0.3, 0.2]))[tokens])

    # temperature 0.5 squares the odds: [0.25, 0.09, 0.04] / 0.38 = [0.657895, 0.236842, 0.105263]
    tokens_t, logprobs_t = sample_from_logits(logits, SamplingParams(temperature=0.5), rng)
    expected_t = torch.tensor([0.657895, 0.236842, 0.105263])
    torch.testing.assert_close(logprobs_t, expected_t.log()[tokens_t], rtol=0, atol=1e-5)
    freq_t = torch.bincount(tokens_t, minlength=3).float() / rows
    torch.testing.assert_close(freq_t, expected_t, rtol=0, atol=0.03)


def test_sample_from_logits_top_p() -> None:
    rows = 4000
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().repeat(rows, 1)
    rng = torch.Generator().manual_seed(1)
    # top_p 0.6: mass before token 0 is 0, before token 1 is 0.5 < 0.6 (kept), before token 2 is
    #   0.8 >= 0.6 (dropped); renormalised [0.5, 0.3] / 0.8 = [0.625, 0.375, 0]
    tokens, logprobs = sample_from_logits(logits, SamplingParams(top_p=0.6), rng)
    freq = torch.bincount(tokens, minlength=3).float() / rows
    assert freq[2] == 0.0
    torch.testing.assert_close(freq, torch.tensor([0.625, 0.375, 0.0]), rtol=0, atol=0.03)
    # the log-probs reported are those before truncation: log 0.5, log 0.3
    torch.testing.assert_close(logprobs, probs.log()[tokens])
    # top_p 0.45: the first token alone reaches it
    tokens, _ = sample_from_logits(logits, SamplingParams(top_p=0.45), rng)
    assert (tokens == 0).all()
    # top_p 0.85: mass before token 2 is 0.8 < 0.85, all three kept
    tokens, _ = sample_from_logits(logits, SamplingParams(top_p=0.85), rng)
    assert set(tokens.tolist()) == {0, 1, 2}


def test_sample_from_logits_masked_tokens_and_determinism() -> None:
    logits = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf")]]).repeat(500, 1)
    a, lp_a = sample_from_logits(logits, SamplingParams(), torch.Generator().manual_seed(7))
    b, lp_b = sample_from_logits(logits, SamplingParams(), torch.Generator().manual_seed(7))
    assert torch.equal(a, b) and torch.equal(lp_a, lp_b)
    assert set(a.tolist()) == {0, 2}  # -inf logits are never drawn
    # two equal logits: log 0.5 = -0.693147
    torch.testing.assert_close(lp_a, torch.full((500,), math.log(0.5)))
    # bf16 logits are upcast: same draw
    c, _ = sample_from_logits(logits.bfloat16(), SamplingParams(), torch.Generator().manual_seed(7))
    assert torch.equal(a, c)


@pytest.mark.parametrize(
    "kwargs",
    [{"n": 0}, {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_new_tokens": 0}],
)
def test_sampling_params_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_shared_prefix_groups_split_consecutive_runs() -> None:
    from rlvr.rollout.hf import shared_prefix_groups

    prompts = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 9], [7, 7], [7, 7, 8]]
    # The first three share [1, 2]; [7, 7] and [7, 7, 8] share [7, 7] but [7, 7] needs one own token.
    assert shared_prefix_groups(prompts, 2) == [(2, [0, 1, 2]), (1, [3, 4])]
    assert shared_prefix_groups(prompts, 3) == [(3, [0, 1]), (2, [2]), (1, [3]), (2, [4])]


def test_shared_prefix_prefill_samples_what_the_plain_prefill_samples(tiny_model_dir: Path) -> None:
    """Later turns of one task share a long prefix; prefilling it once must not change sampling."""
    policy = load_policy(str(tiny_model_dir))
    tok = policy.tokenizer
    base = tok("the same long opening conversation of one task, " * 2)["input_ids"]
    prompts = [
        base + tok("first tail")["input_ids"],
        base + tok("a longer second tail")["input_ids"],
        base[:-4] + tok("x")["input_ids"],
        tok("unrelated")["input_ids"],
    ]
    results = []
    for min_shared in (10**9, 8):  # never share vs share
        generator = HFGenerator(
            policy.model,
            tok,
            eos_token_ids(policy.model, tok),
            seed=3,
            autocast_bf16=False,
            min_shared_prefix=min_shared,
        )
        out = generator.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=10))
        results.append([c for group in out for c in group])
    for plain, shared in zip(*results, strict=True):
        assert plain.token_ids == shared.token_ids
        assert max(abs(a - b) for a, b in zip(plain.logprobs, shared.logprobs, strict=True)) < 1e-4


def test_inverse_cdf_sampling_never_draws_a_zero_probability_token() -> None:
    from rlvr.rollout.hf import inverse_cdf_sample

    rows = 4000
    # Zero mass at the start, in the middle and at the end; a 49k-id row with a tiny tail.
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0]).repeat(rows, 1)
    rng = torch.Generator().manual_seed(3)
    tokens = inverse_cdf_sample(probs, rng)
    freq = torch.bincount(tokens, minlength=5).float() / rows
    assert freq[0] == freq[2] == freq[4] == 0.0
    torch.testing.assert_close(freq, torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0]), rtol=0, atol=0.03)
    wide = torch.full((rows, 49152), 1e-6)
    wide[:, 100] = 1.0
    wide_tokens = inverse_cdf_sample(wide, rng)
    # the tail holds 49151e-6 = 0.049 of 1.049: token 100 is drawn 1 / 1.049 = 95.3% of the time
    assert 0.94 < float((wide_tokens == 100).float().mean()) < 0.965
