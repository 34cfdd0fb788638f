"""Precision: the RLVR_AUTO_BF16 override, the conftest check that keeps `precision` marks honest, and
the sampler/trainer log-prob gap under bf16 autocast with the truncated IS weights that correct it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from rlvr.algorithms import truncated_importance_weights
from rlvr.build import use_bf16
from rlvr.config import ModelConfig
from rlvr.errors import ConfigError
from rlvr.models import eos_token_ids, load_policy
from rlvr.precision import BF16_LOGPROB_GAP, FP32_LOGPROB_GAP, native_bf16
from rlvr.records import Trajectory
from rlvr.rollout.generator import SamplingParams
from rlvr.rollout.hf import HFGenerator
from rlvr.train.batch import TrainBatch, collate, token_logprobs

pytest_plugins = ["pytester"]


@pytest.mark.precision  # it asks what `auto` resolves to
def test_auto_bf16_env_overrides_the_cpu_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLVR_AUTO_BF16", "on")
    assert native_bf16() and use_bf16(ModelConfig(bf16="auto"))
    assert not use_bf16(ModelConfig(bf16="off"))
    monkeypatch.setenv("RLVR_AUTO_BF16", "off")
    assert not native_bf16() and not use_bf16(ModelConfig(bf16="auto"))
    assert use_bf16(ModelConfig(bf16="on"))
    monkeypatch.setenv("RLVR_AUTO_BF16", "yes")
    with pytest.raises(ConfigError, match="RLVR_AUTO_BF16='yes': expected 'on' or 'off'"):
        native_bf16()


def test_a_test_that_resolves_auto_must_carry_the_precision_mark(
    pytester: pytest.Pytester,
) -> None:
    shutil.copy(Path(__file__).parent / "conftest.py", pytester.path / "conftest.py")
    pytester.makepyfile(
        test_probe="""
        import pytest
        from rlvr.build import use_bf16
        from rlvr.config import ModelConfig

        def test_unmarked_auto():
            use_bf16(ModelConfig(bf16="auto"))

        @pytest.mark.precision
        def test_marked_auto():
            use_bf16(ModelConfig(bf16="auto"))

        def test_pinned():
            assert not use_bf16(ModelConfig(bf16="off"))
        """
    )
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*test_unmarked_auto ran with model.bf16: auto*"])


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Any]:
    policy = load_policy(str(tiny_model_dir))
    return policy.model.eval(), policy.tokenizer


def _sampled_batch(model: Any, tok: Any, bf16_sampler: bool) -> TrainBatch:
    """16 completions of two prompts sampled by HFGenerator, laid out as the trainer sees them."""
    prompts = [tok.encode(p, add_special_tokens=False) for p in ("abc", "hello w")]
    generator = HFGenerator(
        model, tok, eos_token_ids(model, tok), seed=0, autocast_bf16=bf16_sampler
    )
    groups = generator.generate(prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=12))
    trajectories = [
        Trajectory(
            task_id=str(p),
            token_ids=(*prompt, *c.token_ids),
            policy_mask=(0,) * len(prompt) + (1,) * len(c.token_ids),
            logprobs=(0.0,) * len(prompt) + c.logprobs,
            prompt_length=len(prompt),
            completion_text="",
            finish_reason=c.finish_reason,
        )
        for p, (prompt, group) in enumerate(zip(prompts, groups, strict=True))
        for c in group
    ]
    zeros = [[0.0] * (len(t.token_ids) - t.prompt_length) for t in trajectories]
    return collate(trajectories, zeros, int(tok.pad_token_id))


def test_bf16_sampler_and_trainer_gap_is_rounding_and_tis_corrects_it(
    tiny: tuple[Any, Any],
) -> None:
    """Pins both precisions: the sampler under bf16 autocast or fp32, the trainer in fp32 and in bf16.
    fp32 against fp32 must agree within rlvr.precision's fp32 tolerance, any pair with bf16 within its
    bf16 one (measured here 2e-4 to 6e-4); the truncated IS weights exp(trainer - sampler) must stay
    near 1 with none at the cap, so TIS leaves a same-weights batch's update essentially unchanged.
    The tiny model's logits are small (std ~0.2); SmolLM2's reach 25-40 and its bf16 gap is ~100x
    larger (benchmarks/precision_gap.py, docs/performance.md), with weights still in [0.75, 1.25]."""
    model, tok = tiny
    for bf16_sampler in (False, True):
        batch = _sampled_batch(model, tok, bf16_sampler)
        mask = batch.mask_B_C.bool()
        for bf16_trainer in (False, True):
            with torch.no_grad():
                trainer_B_C, _ = token_logprobs(model, batch, bf16=bf16_trainer, fused=False)
            gap = (trainer_B_C - batch.behaviour_logprobs_B_C)[mask].abs().mean()
            if not (bf16_sampler or bf16_trainer):
                assert gap < FP32_LOGPROB_GAP
                continue
            assert gap < BF16_LOGPROB_GAP, (bf16_sampler, bf16_trainer, gap)
            weights = truncated_importance_weights(
                trainer_B_C, batch.behaviour_logprobs_B_C, cap=2.0
            )[mask]
            assert abs(float(weights.mean()) - 1.0) < 0.01
            assert float(weights.max()) < 2.0  # nothing capped: TIS reweights, drops nothing
