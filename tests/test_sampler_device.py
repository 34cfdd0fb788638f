"""The sampler on the model's device (issue 34): its generator, one host read per decode step, the
checkpointed state across device kinds, and (marked `cuda`, run by benchmarks/gpu_check.py where a
GPU is) sampling on a GPU.

The tensors themselves are audited in tests/test_device_audit.py; bit-identical CPU tokens are pinned
by tests/test_generator.py, test_fast_decode.py and test_fast_turns.py.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import rlvr
from rlvr.models import eos_token_ids, load_policy
from rlvr.rollout.generator import SamplingParams
from rlvr.rollout.hf import HFGenerator
from rlvr.rollout.sampling import draw, inverse_cdf_sample

SRC = Path(rlvr.__file__).resolve().parent
# Tensor methods that wait for the device and copy to the host.
READS = {
    "tolist",
    "item",
    "__int__",
    "__float__",
    "__bool__",
    "__index__",
    "numpy",
    "nonzero",
    "cpu",
}


class HostReads(TorchFunctionMode):
    """Counts device-to-host reads made directly by rlvr's code (not transformers')."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[tuple[str, int]] = []

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if getattr(func, "__name__", "") in READS:
            frame = sys._getframe(1)
            while frame.f_code.co_name == "__torch_function__" and frame.f_back is not None:
                frame = frame.f_back  # forwarded by another mode (SkinnyLinear): its caller's
            path = Path(frame.f_code.co_filename).resolve()
            if SRC in path.parents:
                self.sites.append((path.name, frame.f_lineno))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Any]:
    policy = load_policy(str(tiny_model_dir))
    policy.model.eval()
    return policy.model, policy.tokenizer


def _reads(generator: HFGenerator, prompts: list[list[int]], steps: int, n: int) -> int:
    sampling = SamplingParams(n=n, temperature=1.0, max_new_tokens=steps, stop=("zzzzz",))
    with HostReads() as reads:
        out = generator.generate(prompts, sampling)
    assert all(len(c.token_ids) == steps for group in out for c in group)  # nobody stopped
    return len(reads.sites)


@pytest.mark.parametrize("decode", ["hf", "fast"])
def test_one_host_read_per_decode_step_whatever_the_rows(
    tiny: tuple[Any, Any], decode: Any
) -> None:
    """No EOS (an empty set) and a stop string the tiny model never writes: every row runs to the
    end, so 8 more steps must cost exactly 8 more reads, for 1 row or 12."""
    model, tok = tiny
    generator = HFGenerator(model, tok, set(), seed=3, autocast_bf16=False, decode=decode)
    prompts = [tok.encode("Q: 2+3=", add_special_tokens=False), [5, 6, 7, 8, 9]]
    for rows, n in ((prompts[:1], 1), (prompts, 6)):
        extra = _reads(generator, rows, 12, n) - _reads(generator, rows, 4, n)
        assert extra == 8, (decode, n, extra)


def test_the_generator_lives_on_the_models_device(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    generator = HFGenerator(model, tok, eos_token_ids(model, tok), seed=5)
    assert generator.rng.device == torch.device("cpu")
    assert generator.get_state().dtype == torch.uint8 and generator.get_state().numel() == 5056


def test_a_state_from_another_device_kind_reseeds_deterministically(
    tiny: tuple[Any, Any],
) -> None:
    """A CUDA generator's state (16 bytes: Philox seed and offset) cannot continue on the CPU's
    Mersenne Twister, nor a CPU state on a GPU: the stream is seeded from the state's bytes, with a
    warning, the same way each time. A state of the same kind restores exactly."""
    model, tok = tiny
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=6)
    prompts = [[5, 6, 7]]
    foreign = torch.arange(16, dtype=torch.uint8)
    outs = []
    for _ in range(2):
        generator = HFGenerator(model, tok, set(), seed=1, autocast_bf16=False)
        with pytest.warns(UserWarning, match="another device kind's"):
            generator.set_state(foreign)
        outs.append(generator.generate(prompts, sampling))
    assert outs[0] == outs[1]
    fresh = HFGenerator(model, tok, set(), seed=1, autocast_bf16=False)
    assert fresh.generate(prompts, sampling) != outs[0]  # not the seed's stream
    state = fresh.get_state()
    first = fresh.generate(prompts, sampling)
    fresh.set_state(state)
    assert fresh.generate(prompts, sampling) == first


def test_draw_on_the_cpu_is_the_inverse_cdf() -> None:
    probs = torch.softmax(torch.randn(5, 300, generator=torch.Generator().manual_seed(0)), -1)
    probs[:, ::3] = 0.0
    a = draw(probs, torch.Generator().manual_seed(2))
    b = inverse_cdf_sample(probs, torch.Generator().manual_seed(2))
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------------- on a GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture()
def gpu_tiny(tiny_model_dir: Path) -> Iterator[tuple[Any, Any]]:
    policy = load_policy(str(tiny_model_dir), device="cuda")
    policy.model.eval()
    yield policy.model, policy.tokenizer


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("decode", ["hf", "fast"])
def test_sampling_on_the_gpu_matches_a_full_forward(gpu_tiny: tuple[Any, Any], decode: Any) -> None:
    """Sampled rows on a GPU (multinomial draw, GPU generator, a turn session, stop strings, rows
    leaving mid-way): log-probs equal a plain forward's, and a reseeded generator repeats them."""
    model, tok = gpu_tiny
    torch.backends.cuda.matmul.allow_tf32 = False
    generator = HFGenerator(
        model, tok, eos_token_ids(model, tok), seed=2, autocast_bf16=False, decode=decode,
        turn_cache=True,
    )  # fmt: skip
    assert generator.rng.device.type == "cuda"
    prompts = [tok.encode(p, add_special_tokens=False) for p in ("Q: 2+3=", "hello there")]
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, stop=("a",))
    state = generator.get_state()
    with generator.turn_session():
        first = generator.generate(prompts, sampling)
        follow = [p + list(g[0].token_ids) + [5] for p, g in zip(prompts, first, strict=True)]
        second = generator.generate(follow, sampling)
    generator.set_state(state)
    assert generator.generate(prompts, sampling) == first
    for prompt_list, groups in ((prompts, first), (follow, second)):
        for prompt, group in zip(prompt_list, groups, strict=True):
            for c in group:
                ids = torch.tensor([[*prompt, *c.token_ids]], device="cuda")
                with torch.no_grad():
                    logits = model(input_ids=ids).logits[0].float()
                logprobs = torch.log_softmax(logits, -1)
                want = [float(logprobs[len(prompt) - 1 + j, t]) for j, t in enumerate(c.token_ids)]
                assert max(abs(a - b) for a, b in zip(c.logprobs, want, strict=True)) < 1e-4


@pytest.mark.cuda
@needs_cuda
def test_the_gpu_draw_follows_the_distribution() -> None:
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0]], device="cuda").repeat(20000, 1)
    tokens = draw(probs, torch.Generator(device="cuda").manual_seed(0))
    counts = torch.bincount(tokens, minlength=5).float() / tokens.numel()
    assert counts[1] == 0 and counts[4] == 0
    assert torch.allclose(counts, probs[0], atol=0.02)


@pytest.mark.cuda
@needs_cuda
def test_the_generator_follows_a_model_moved_to_the_gpu(tiny_model_dir: Path) -> None:
    """Built beside a CPU model, then the model moves (as a rank's DDP setup can do): the first
    generate moves the generator too, seeded as if it had been built there."""
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    outs = []
    for move_later in (False, True):
        policy = load_policy(str(tiny_model_dir), device="cpu" if move_later else "cuda")
        model, tok = policy.model, policy.tokenizer
        generator = HFGenerator(model, tok, set(), seed=4, autocast_bf16=False)
        if move_later:
            model.to("cuda")
        outs.append(generator.generate([[5, 6, 7]], sampling))
        assert generator.rng.device.type == "cuda"
    assert outs[0] == outs[1]
