"""`model.bf16: auto` measured per host (rlvr.train.precision_choice), and the RL sampler never autocasting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import rlvr.build as build
import rlvr.devices as devices
import rlvr.precision as precision
from rlvr.config import ModelConfig, load_config
from rlvr.models import load_policy
from rlvr.observe.tracking import read_metrics
from rlvr.train import precision_choice
from rlvr.train.loop import train


@pytest.fixture()
def unforced(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No RLVR_AUTO_BF16 (conftest pins it off), a private cache folder, no answers recorded yet."""
    monkeypatch.delenv(precision.AUTO_BF16_ENV, raising=False)
    monkeypatch.setenv("RLVR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(precision, "_MEASURED_AUTO_BF16", {})
    return tmp_path / "cache" / "update_precision.json"


def never_measured(model: object) -> tuple[float, float]:
    raise AssertionError("measured although the answer was known")


def test_a_cpu_without_native_bf16_stays_fp32_without_measuring(
    unforced: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: False)
    model = load_policy(str(tiny_model_dir)).model
    choice = precision_choice.choose(model, measure_fn=never_measured)
    assert not choice.bf16 and choice.bits == 32.0
    assert "no native bf16" in choice.reason
    assert not unforced.exists()


@pytest.mark.parametrize(
    ("fp32_s", "bf16_s", "picks_bf16"),
    [(1.0, 0.5, True), (1.0, 0.85, True), (1.0, 0.9, False), (1.0, 1.3, False)],
)
def test_native_bf16_is_chosen_only_when_measured_faster_by_the_margin(
    unforced: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    fp32_s: float,
    bf16_s: float,
    picks_bf16: bool,
) -> None:
    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: True)
    model = load_policy(str(tiny_model_dir)).model
    calls: list[int] = []

    def timed(m: object) -> tuple[float, float]:
        calls.append(1)
        return fp32_s, bf16_s

    choice = precision_choice.choose(model, measure_fn=timed)
    assert choice.bf16 is picks_bf16
    assert (choice.fp32_s, choice.bf16_s) == (fp32_s, bf16_s)
    assert "measured now" in choice.reason
    # The second run on this host reads the cache: no second measurement, the same answer.
    again = precision_choice.choose(model, measure_fn=never_measured)
    assert again.bf16 is picks_bf16 and "cached" in again.reason
    assert calls == [1]
    stored = json.loads(unforced.read_text())
    assert next(iter(stored.values()))["bf16_s"] == bf16_s


def test_the_cache_is_per_model_shape(
    unforced: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: True)
    small = load_policy(str(tiny_model_dir)).model
    config = small.config
    config.num_hidden_layers = config.num_hidden_layers + 1
    bigger = AutoModelForCausalLM.from_config(config)
    assert precision_choice.cache_key(small) != precision_choice.cache_key(bigger)
    precision_choice.choose(small, measure_fn=lambda m: (1.0, 0.5))
    assert not precision_choice.choose(bigger, measure_fn=lambda m: (1.0, 2.0)).bf16


# It asks `auto` on purpose (with the variable set either way), so it carries the mark.
@pytest.mark.precision
def test_the_environment_variable_wins_and_nothing_is_measured(
    unforced: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_policy(str(tiny_model_dir)).model
    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: True)
    for value, bf16 in (("on", True), ("off", False)):
        monkeypatch.setenv(precision.AUTO_BF16_ENV, value)
        choice = precision_choice.resolve(model, "m", measure_fn=never_measured)
        assert choice.bf16 is bf16 and precision.AUTO_BF16_ENV in choice.reason
        assert build.use_bf16(ModelConfig(name="m", bf16="auto")) is bf16


def test_torchrun_and_gpus_are_not_measured(
    unforced: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: True)
    model = load_policy(str(tiny_model_dir)).model
    choice = precision_choice.choose(model, distributed=True, measure_fn=never_measured)
    assert not choice.bf16 and "torchrun" in choice.reason


def test_a_measured_answer_is_what_use_bf16_gives_for_that_model_only(
    unforced: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: True)
    model = load_policy(str(tiny_model_dir)).model
    precision_choice.resolve(model, "measured-model", measure_fn=lambda m: (1.0, 0.5))
    assert build.use_bf16(ModelConfig(name="measured-model", bf16="auto"))
    assert not build.use_bf16(ModelConfig(name="measured-model", bf16="off"))
    # Another model, never measured in this process: auto without measuring is fp32.
    monkeypatch.setattr(precision, "native_bf16", lambda: False)
    assert not build.use_bf16(ModelConfig(name="other", bf16="auto"))


def test_measuring_leaves_weights_gradients_mode_and_random_streams_alone(
    tiny_model_dir: Path,
) -> None:
    model = load_policy(str(tiny_model_dir)).model
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    fp32_s, bf16_s = precision_choice.measure(model, rows=2, tokens=8, repeats=1)
    assert fp32_s > 0 and bf16_s > 0
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.precision  # the config's validators ask `auto` too (the variable is unset here)
def test_an_rl_run_measures_logs_its_precision_and_samples_in_fp32(
    unforced: Path,
    tiny_model_dir: Path,
    tiny_config_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bf16 update (measured faster) with an fp32 sampler: the demo learned only that way."""
    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr(precision_choice, "measure", lambda m: (1.0, 0.5))
    made: list[bool] = []
    original = build.HFGenerator.__init__

    def spy(self: object, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(bool(self.autocast_bf16))  # type: ignore[attr-defined]

    monkeypatch.setattr(build.HFGenerator, "__init__", spy)
    cfg = load_config(
        tiny_config_dir / "tiny.yaml",
        [
            f"model.name={tiny_model_dir}",
            f"output_dir={tmp_path / 'run'}",
            "tracking.progress=false",
            "train.steps=2",
            "eval.at_start=false",
            "eval.at_end=false",
        ],
    )
    assert cfg.model.bf16 == "auto"
    summary = train(cfg, config_dir=tiny_config_dir)
    steps = [m for m in read_metrics(summary.run_dir) if "step_time" in m]
    assert [m["perf/precision"] for m in steps] == [16.0, 16.0]
    assert made and not any(made)  # every sampler the run built samples without autocast


def test_a_bf16_reference_scores_exactly_as_autocast_did(tiny_model_dir: Path) -> None:
    """Frozen reference weights rounded to bf16 once give the bits autocast's per-call casts gave."""
    from rlvr.records import Trajectory
    from rlvr.train.batch import collate, token_logprobs

    policy = load_policy(str(tiny_model_dir), need_reference=True)
    gen = torch.Generator().manual_seed(0)
    trajectories = []
    for i, (prompt, completion) in enumerate([(5, 7), (5, 4), (9, 6)]):
        ids = tuple(int(t) for t in torch.randint(3, 60, (prompt + completion,), generator=gen))
        trajectories.append(
            Trajectory(
                task_id=f"t{i}",
                token_ids=ids,
                policy_mask=(0,) * prompt + (1,) * completion,
                logprobs=(0.0,) * (prompt + completion),
                prompt_length=prompt,
                completion_text="",
                finish_reason="length",
            )
        )
    batch = collate(
        trajectories, [[1.0] * (len(t.token_ids) - t.prompt_length) for t in trajectories], 0
    )
    with policy.reference() as ref:
        before = token_logprobs(ref, batch, bf16=True)[0]
        tied = ref.get_output_embeddings().weight is ref.get_input_embeddings().weight
        embedding = ref.get_input_embeddings().weight.detach().clone()
        fp32_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    with policy.reference(bf16_matmuls=True) as ref:
        after = token_logprobs(ref, batch, bf16=True)[0]
        assert ref.get_output_embeddings().weight.dtype == torch.bfloat16
        assert ref.get_input_embeddings().weight.dtype == torch.float32
        assert torch.equal(ref.get_input_embeddings().weight, embedding)
        bf16_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    assert torch.equal(before, after)
    assert tied  # the tiny model ties its head, as SmolLM2 does: the untying path is exercised
    assert bf16_bytes < fp32_bytes
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())  # the policy untouched
    with pytest.raises(RuntimeError, match="bf16"), policy.reference():
        pass
