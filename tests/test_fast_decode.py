"""rlvr's own decode path (rlvr.rollout.fast_decode, HFGenerator(decode="fast")) against HF's forward.

Every comparison samples with two generators seeded alike, one per path, on the same tiny random
model: the same tokens (greedy and sampled: the paths draw the same uniforms, and their log-probs
agree far below any gap between two tokens' shares), the same finish reasons, and behaviour
log-probs within 1e-5 (all fp32: `autocast_bf16=False` pins HF's path, the fast path's copy is
float32 unless a test asks for bfloat16). Models: the project's tiny Llama (tied embedding, GQA),
a Llama with attention and MLP biases and an untied head, Qwen2 (q/k/v bias), Qwen3 (q/k norms,
head_dim not hidden / heads, one KV head); biases and norm weights are randomised, since HF
initialises them to 0 and 1, which would hide a missing one.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from rlvr.models import eos_token_ids, load_policy, tiny_tokenizer
from rlvr.precision import BF16_LOGPROB_GAP
from rlvr.rollout.fast_decode import DecodeWeights, StaticDecode, decline_reason
from rlvr.rollout.generator import Completion, SamplingParams
from rlvr.rollout.hf import HFGenerator, fill_holes_order

TOL = 1e-5
# Prompts of different lengths (left padding), one repeated, one sharing the first's prefix.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12],
    [13, 14, 15],
    [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30],
    [5, 6, 7, 8, 9, 10, 40, 41, 42],
]
# The tiny tokenizer is character-level: a stop set of five letters ends some rows early.
STOPS = ("a", "e", "i", "o", "u")


def randomise_biases_and_norms(model: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))


def tiny_model(kind: str, **overrides: Any) -> Any:
    """A tiny random model of `kind` with the tiny tokenizer's ids, in eval mode."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    tok = tiny_tokenizer()
    common: dict[str, Any] = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "pad_token_id": tok.pad_token_id,
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.bos_token_id,
    }
    builders: dict[str, tuple[Any, Any, dict[str, Any]]] = {
        "llama": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True}),
        "llama_bias": (
            LlamaConfig,
            LlamaForCausalLM,
            {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 4},
        ),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": False}),
        "qwen3": (
            Qwen3Config,
            Qwen3ForCausalLM,
            {"head_dim": 32, "num_key_value_heads": 1, "tie_word_embeddings": True},
        ),
        "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    }
    config_cls, model_cls, extra = builders[kind]
    torch.manual_seed(7)
    model = model_cls(config_cls(**{**common, **extra, **overrides}))
    randomise_biases_and_norms(model, seed=8)
    return model.eval()


def make_gen(model: Any, decode: str, **kwargs: Any) -> HFGenerator:
    tok = tiny_tokenizer()
    return HFGenerator(
        model,
        tok,
        eos_token_ids(model, tok),
        seed=kwargs.pop("seed", 3),
        autocast_bf16=False,
        decode=decode,  # type: ignore[arg-type]
        **kwargs,
    )


def assert_same(a: list[list[Completion]], b: list[list[Completion]], tol: float = TOL) -> None:
    assert len(a) == len(b)
    for group_a, group_b in zip(a, b, strict=True):
        for x, y in zip(group_a, group_b, strict=True):
            assert x.token_ids == y.token_ids
            assert x.finish_reason == y.finish_reason
            torch.testing.assert_close(
                torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0.0, atol=tol
            )


def both_paths(
    model: Any, prompts: list[list[int]], sampling: SamplingParams, **kwargs: Any
) -> tuple[list[list[Completion]], list[list[Completion]], HFGenerator]:
    fast = make_gen(model, "fast", **kwargs)
    out_fast = fast.generate(prompts, sampling)
    assert fast.fast_decode_declined is None and fast._fast is not None  # the fast path ran
    out_hf = make_gen(model, "hf", **kwargs).generate(prompts, sampling)
    return out_fast, out_hf, fast


KINDS = ["llama", "llama_bias", "qwen2", "qwen3"]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_hf(kind: str) -> None:
    model = tiny_model(kind)
    sampling = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    out_fast, out_hf, _ = both_paths(model, PROMPTS, sampling)
    assert_same(out_fast, out_hf)


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_rows_with_stops_equal_hf(kind: str) -> None:
    """n samples per prompt (one prefill repeated), rows leaving the batch at stop strings."""
    model = tiny_model(kind)
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=16, stop=STOPS)
    out_fast, out_hf, _ = both_paths(model, PROMPTS, sampling)
    assert_same(out_fast, out_hf)
    reasons = [c.finish_reason for group in out_fast for c in group]
    assert "stop" in reasons and "length" in reasons  # some rows left early, some ran out
    lengths = {len(c.token_ids) for group in out_fast for c in group}
    assert len(lengths) > 2


def test_shared_prefix_and_chunks_equal_hf() -> None:
    """Prompts sharing a prefix prefill it once (then a row gather and the suffixes); a small
    max_batch_rows splits the call into chunks, each with its own static cache."""
    model = tiny_model("llama")
    prompts = [[*range(10, 24), 30 + i] + [40] * i for i in range(4)] + PROMPTS
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, stop=STOPS)
    out_fast, out_hf, _ = both_paths(
        model, prompts, sampling, min_shared_prefix=6, max_batch_rows=6
    )
    assert_same(out_fast, out_hf)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 500.0},
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        },
        {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0},
    ],
    ids=lambda r: r["rope_type"],
)
def test_forward_equals_hf_for_static_rope_types(rope: dict[str, Any]) -> None:
    """One prefill then one decode step over left-padded rows, logits against HF's forward with the
    same mask and positions (positions up to ~200, past llama3's low-frequency bend at 64)."""
    model = tiny_model("llama", rope_parameters=rope, max_position_embeddings=256)
    assert decline_reason(model) is None
    gen = torch.Generator().manual_seed(0)
    lengths = [200, 150, 30]
    width = max(lengths)
    ids = torch.randint(4, 120, (3, width), generator=gen)
    mask = (torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None]).long()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    static = StaticDecode(DecodeWeights.build(model), reserve=1)
    with torch.no_grad():
        fast = static.forward(ids, mask, positions)
        want = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
        torch.testing.assert_close(fast, want, rtol=0.0, atol=TOL)
        step = torch.randint(4, 120, (3, 1), generator=gen)
        mask2 = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
        pos2 = positions[:, -1:] + 1
        fast2 = static.forward(step, mask2, pos2)
        full = torch.cat([ids, step], dim=1)
        pos_full = torch.cat([positions, pos2], dim=1)
        want2 = model(input_ids=full, attention_mask=mask2, position_ids=pos_full).logits[:, -1]
    torch.testing.assert_close(fast2, want2, rtol=0.0, atol=TOL)


def hf_logprobs(model: Any, prompt: list[int], completion: Completion) -> torch.Tensor:
    """Teacher-forced fp32 log-probs of `completion`'s tokens under HF's full forward (greedy:
    the untempered softmax)."""
    ids = torch.tensor([[*prompt, *completion.token_ids]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    targets = torch.tensor(completion.token_ids)
    return torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_bf16_copy_agrees_with_fp32_within_bf16_rounding(kind: str) -> None:
    """The bf16 weight copy: half the bytes per step, every matrix bf16, and its sampled tokens'
    log-probs within bf16 rounding of HF's fp32 forward on the same tokens (teacher-forced, so a
    near-tie that bf16 breaks the other way cannot fail the test). Measured on these models: mean
    ~1e-3, max ~3e-3, as for HF's own forward under bf16 autocast; precision.py's BF16_LOGPROB_GAP
    (u = 2^-8) bounds the mean, twice it the worst token."""
    model = tiny_model(kind)
    bf16 = make_gen(model, "fast", decode_dtype=torch.bfloat16)
    sampling = SamplingParams(n=2, temperature=0.0, max_new_tokens=12)
    out = bf16.generate(PROMPTS, sampling)
    weights = bf16._fast
    assert weights is not None and weights.dtype == torch.bfloat16
    assert all(
        len(lw.qkv) == len(lw.gate_up) == 1 and lw.qkv[0].dtype == lw.down.dtype == torch.bfloat16
        for lw in weights.layers
    )
    fp32_bytes = DecodeWeights.build(model, torch.float32).bytes_per_step
    assert weights.bytes_per_step * 2 == fp32_bytes
    gaps = torch.cat(
        [
            (torch.tensor(c.logprobs) - hf_logprobs(model, prompt, c)).abs()
            for prompt, group in zip(PROMPTS, out, strict=True)
            for c in group
        ]
    )
    assert 0 < float(gaps.mean()) < BF16_LOGPROB_GAP  # bf16 rounding: not zero, not more
    assert float(gaps.max()) < 2 * BF16_LOGPROB_GAP


def test_the_copy_follows_the_policy_after_an_update() -> None:
    """The fast path's weights are a copy: after an optimizer step (fused AdamW, which does not bump
    the parameters' version counters) the next call samples from the new weights, with or without
    `refresh_weights()`; and a generator whose policy did not move keeps its copy."""
    from rlvr.optim import adamw

    model = tiny_model("qwen2")
    fast = make_gen(model, "fast")
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
    before = fast.generate(PROMPTS, sampling)
    copy_before = fast._fast
    fast.generate(PROMPTS, sampling)
    assert fast._fast is copy_before  # unchanged weights: not rebuilt

    optimizer = adamw(list(model.parameters()), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0)
    ids = torch.tensor([PROMPTS[0]])
    model(input_ids=ids).logits.sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    for refresh in (False, True):
        fast.set_state(torch.Generator().manual_seed(3).get_state())
        if refresh:
            fast.refresh_weights()
        after = fast.generate(PROMPTS, sampling)
        assert fast._fast is not copy_before
        assert_same(after, make_gen(model, "hf").generate(PROMPTS, sampling))
    assert [c.logprobs for g in after for c in g] != [c.logprobs for g in before for c in g]


@pytest.fixture()
def lora_model(lora_policy: Any) -> Any:
    """conftest's LoRA policy's model (nonzero B: the adapters change the outputs)."""
    return lora_policy.model


def test_lora_is_merged_into_the_copy(lora_model: Any) -> None:
    """Adapters on: the fast path equals HF's (which runs the adapters merged_lora-style); adapters
    off (the KL reference): the copy is rebuilt from the base weights alone. The policy's own
    weights are never written."""
    before = {n: p.detach().clone() for n, p in lora_model.named_parameters()}
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, stop=STOPS)
    fast = make_gen(lora_model, "fast")
    adapted = fast.generate(PROMPTS, sampling)
    assert_same(adapted, make_gen(lora_model, "hf").generate(PROMPTS, sampling))
    with lora_model.disable_adapter():
        fast.set_state(torch.Generator().manual_seed(3).get_state())
        base = fast.generate(PROMPTS, sampling)
        assert_same(base, make_gen(lora_model, "hf").generate(PROMPTS, sampling))
    assert [c.logprobs for g in base for c in g] != [c.logprobs for g in adapted for c in g]
    for name, p in lora_model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_unsupported_models_fall_back_to_hf() -> None:
    """Another architecture, a sliding window, a dynamic RoPE, a forward hook: HF's forward runs
    (same samples as decode "hf"), with one warning naming why."""
    cases = {
        "MistralForCausalLM is not one of": tiny_model("mistral"),
        "sliding-window": tiny_model(
            "qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1
        ),
        "rope type 'dynamic'": tiny_model(
            "llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
        ),
    }
    hooked = tiny_model("llama")
    hooked.lm_head.register_forward_hook(lambda module, args, output: output)
    cases["forward hooks on lm_head"] = hooked
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    for reason, model in cases.items():
        fast = make_gen(model, "fast")
        with pytest.warns(UserWarning, match="falls back to HF"):
            out = fast.generate(PROMPTS, sampling)
        assert fast._fast is None and reason in (fast.fast_decode_declined or ""), reason
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once, not on every call
            fast.generate(PROMPTS, sampling)
        assert_same(out, make_gen(model, "hf").generate(PROMPTS, sampling))


def test_config_switch_reaches_the_generator(tiny_model_dir: Path) -> None:
    from rlvr.build import build_generator, decode_options
    from rlvr.config import RunConfig

    cfg = RunConfig.model_validate(
        {
            "model": {"name": str(tiny_model_dir), "bf16": "off"},
            "generator": {"decode": "fast", "decode_dtype": "bfloat16"},
        }
    )
    assert decode_options(cfg) == {"decode": "fast", "decode_dtype": torch.bfloat16}
    generator = build_generator(load_policy(str(tiny_model_dir)), cfg)
    assert generator.decode == "fast" and generator.decode_dtype == torch.bfloat16
    default = RunConfig.model_validate({"model": {"name": str(tiny_model_dir), "bf16": "off"}})
    assert decode_options(default) == {"decode": "hf", "decode_dtype": torch.float32}


@pytest.mark.precision  # resolves model.bf16: auto (under a CPU kind and RLVR_AUTO_BF16 it sets)
@pytest.mark.parametrize(
    ("native", "env", "bf16", "expected"),
    [
        (True, None, "auto", ("fast", torch.bfloat16)),  # the default on a native-bf16 CPU
        (False, None, "auto", ("hf", torch.float32)),  # AVX2: HF's forward, as before
        (True, None, "off", ("hf", torch.float32)),  # model.bf16: off means no bf16 anywhere
        (False, None, "on", ("fast", torch.bfloat16)),
        (True, "off", "auto", ("hf", torch.float32)),  # RLVR_AUTO_BF16 overrides the CPU check
        (False, "on", "auto", ("fast", torch.bfloat16)),
    ],
)
def test_decode_auto_samples_from_a_bf16_copy_exactly_on_native_bf16_cpus(
    native: bool,
    env: str | None,
    bf16: str,
    expected: tuple[str, torch.dtype],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """generator.decode and decode_dtype left at auto: rlvr's decode path from a bf16 copy where the
    CPU has native bf16 (it learned more in 10 minutes there, docs/performance.md), else HF's."""
    import rlvr.build
    import rlvr.devices
    from rlvr.config import RunConfig

    monkeypatch.setattr(rlvr.devices, "cpu_has_bf16", lambda: native)
    if env is None:
        monkeypatch.delenv("RLVR_AUTO_BF16", raising=False)
    else:
        monkeypatch.setenv("RLVR_AUTO_BF16", env)
    cfg = RunConfig.model_validate({"model": {"bf16": bf16}})
    assert tuple(rlvr.build.decode_options(cfg).values()) == expected
    assert (cfg.objective.tis_cap == 2.0) == (expected[1] == torch.bfloat16)


def test_the_float32_path_reads_the_policys_own_matrices() -> None:
    """No float32 copy of the weights: every matrix of a float32 DecodeWeights is the policy's own
    tensor (same storage), so the fast path adds no weight memory and sees each update in place."""
    model = tiny_model("llama")
    weights = DecodeWeights.build(model, torch.float32)
    own = {p.data_ptr() for p in model.parameters()}
    matrices = [weights.head] + [
        t for lw in weights.layers for t in (*lw.qkv, lw.o, *lw.gate_up, lw.down)
    ]
    assert len(weights.layers[0].qkv) == 3 and len(weights.layers[0].gate_up) == 2
    assert all(t.data_ptr() in own for t in matrices)


def test_finished_rows_are_filled_from_the_end_and_rows_keep_their_keys() -> None:
    """HFGenerator's order after rows finish: survivors in place, the last ones fill the holes; the
    static cache's in-place compaction (only moved rows copied) leaves every row with its own keys
    and values."""
    assert fill_holes_order([1, 2, 4, 5]) == [4, 1, 2, 5]
    assert fill_holes_order([0, 1, 2]) == [0, 1, 2]
    assert fill_holes_order([3]) == [3]
    assert fill_holes_order([0, 2, 3, 6, 7]) == [0, 6, 2, 3, 7]
    weights = DecodeWeights.build(tiny_model("llama"), torch.float32)
    decoder = StaticDecode(weights, reserve=2)
    rows, width = 6, 4
    decoder.forward(
        torch.randint(0, 100, (rows, width)),
        torch.ones((rows, width), dtype=torch.long),
        torch.arange(width)[None].expand(rows, width),
    )
    assert decoder.kv is not None
    before = decoder.kv[:, :, :rows, :, :width].clone()
    order = fill_holes_order([1, 2, 4, 5])
    decoder.select(torch.tensor(order))
    assert decoder.rows == 4
    torch.testing.assert_close(decoder.kv[:, :, :4, :, :width], before[:, :, order], rtol=0, atol=0)


def test_the_update_runs_without_the_samplers_weight_copy(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bf16 sampling copy is dropped once the rollouts are in, so the update's peak memory does
    not hold it; each step's rollouts build it again from the new weights (one build a step)."""
    import gc

    import rlvr.train.loop as loop
    from rlvr.config import load_config

    builds: list[int] = []
    real_build = DecodeWeights.build.__func__  # type: ignore[attr-defined]

    def counted_build(cls: type, *args: Any, **kwargs: Any) -> DecodeWeights:
        builds.append(1)
        return real_build(cls, *args, **kwargs)

    live_at_update: list[int] = []
    real_update = loop.policy_update

    def update(*args: Any, **kwargs: Any) -> Any:
        gc.collect()
        live_at_update.append(sum(isinstance(o, DecodeWeights) for o in gc.get_objects()))
        return real_update(*args, **kwargs)

    monkeypatch.setattr(DecodeWeights, "build", classmethod(counted_build))
    monkeypatch.setattr(loop, "policy_update", update)
    cfg = load_config(
        tiny_config_dir / "tiny.yaml",
        [
            f"model.name={tiny_model_dir}",
            f"output_dir={tmp_path / 'run'}",
            "model.bf16=off",
            "generator.decode=fast",
            "generator.decode_dtype=bfloat16",
            "train.steps=3",
            "eval.at_start=false",
            "eval.at_end=false",
            "tracking.progress=false",
        ],
    )
    loop.train(cfg, config_dir=tiny_config_dir)
    assert live_at_update == [0, 0, 0]
    assert len(builds) == 3


@pytest.mark.parametrize("kind", KINDS)
def test_fixed_shape_steps_sample_what_the_eager_steps_do(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA graph's body (rollout/decode_graphs.py) run eagerly, step_mode "static": every
    step over the cache's whole capacity, rows in power-of-two buckets with the finished ones
    computed and ignored, keys written at a column held on the device. It samples the eager
    step's tokens with its log-probs to float rounding, rows leaving at stop strings on the way.
    What only a GPU adds, the capture and the replays, is tests/test_cuda.py's."""
    from rlvr.rollout import decode_graphs

    model = tiny_model(kind)
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=16, stop=STOPS)
    eager = make_gen(model, "fast").generate(PROMPTS, sampling)
    build, buckets = DecodeWeights.build.__func__, []  # type: ignore[attr-defined]
    step = decode_graphs.StaticSteps.step

    def static_build(cls: Any, m: Any, dtype: torch.dtype = torch.float32, **_: Any) -> Any:
        return build(cls, m, dtype, step_mode="static")

    def spied(self: Any, ids: torch.Tensor, *args: Any) -> torch.Tensor:
        buckets.append((ids.shape[0], self.kv.shape[2]))
        return step(self, ids, *args)

    monkeypatch.setattr(DecodeWeights, "build", classmethod(static_build))
    monkeypatch.setattr(decode_graphs.StaticSteps, "step", spied)
    generator = make_gen(model, "fast")
    static = generator.generate(PROMPTS, sampling)
    assert generator._fast is not None and generator._fast.step_mode == "static"
    assert_same(static, eager, tol=1e-5)
    rows_seen = {rows for rows, _ in buckets}
    assert len(rows_seen) > 2  # rows left the batch: several buckets were run
    assert any(rows & (rows - 1) for rows in rows_seen)  # and not only powers of two
