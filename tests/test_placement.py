"""Issue 34: `model.device` reaches every model a run builds, and micro-batches with a token budget.

No GPU here: the device each loader is asked for is recorded, so a loader that forgot `model.device`
(and would put a critic or teacher on the host beside a GPU policy) fails here, whatever this
machine has. The tensors themselves are audited in tests/test_device_audit.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlvr import devices
from rlvr.config import load_config
from rlvr.errors import ConfigError
from rlvr.records import Trajectory
from rlvr.train.loop import train
from rlvr.train.micro_batching import micro_batches


def tiny_cfg(config_dir: Path, model_dir: Path, out: Path, *overrides: str) -> Any:
    return load_config(
        config_dir / "tiny.yaml",
        [
            f"model.name={model_dir}",
            f"output_dir={out}",
            "tracking.progress=false",
            "model.bf16=off",
            *overrides,
        ],
    )


# ------------------------------------------------------------------------------------- the setting
def test_the_device_setting_is_checked_in_one_line() -> None:
    from pydantic import ValidationError

    from rlvr.config import ModelConfig

    assert ModelConfig().device == "auto"
    assert ModelConfig(device="CUDA:1").device == "cuda:1"
    with pytest.raises(ValidationError, match="expected auto, cpu, cuda or cuda:N"):
        ModelConfig(device="gpu")
    assert devices.resolve_device("cpu") == torch.device("cpu")


def test_auto_is_the_local_rank_gpu_where_cuda_is_available(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert devices.resolve_device("auto") == torch.device("cuda", 2)
    assert devices.resolve_device("cuda") == torch.device("cuda", 2)
    assert devices.resolve_device("cuda:3") == torch.device("cuda", 3)
    with pytest.raises(ConfigError, match="has 4 CUDA device"):
        devices.resolve_device("cuda:7")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.resolve_device("auto") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_asking_for_a_gpu_without_one_is_a_one_line_error(tiny_model_dir: Path) -> None:
    from rlvr.models import load_policy

    with pytest.raises(ConfigError, match=r"model\.device: cuda asked for, but torch sees no CUDA"):
        load_policy(str(tiny_model_dir), device="cuda")


def test_cuda_auto_precision_is_bf16_without_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    """`model.bf16: auto` on a CUDA device: bf16 where the GPU has it, nothing measured (the CPU
    calibration would time the whole model on the host)."""
    from rlvr.train import precision_choice

    monkeypatch.delenv("RLVR_AUTO_BF16", raising=False)
    monkeypatch.setattr(precision_choice, "device_of", lambda model: torch.device("cuda", 0))

    def never(model: Any) -> tuple[float, float]:
        raise AssertionError("measured on a GPU run")

    for native, expected in ((True, True), (False, False)):
        monkeypatch.setattr(precision_choice, "supports_bf16", lambda device, n=native: n)
        choice = precision_choice.choose(torch.nn.Linear(2, 2), measure_fn=never)
        assert choice.bf16 is expected and "cuda:0" in choice.reason


# ------------------------------------------------------------------------------------- placement
@pytest.mark.parametrize(
    "algorithm, extra",
    [
        ("grpo", ["objective.beta=0.04"]),  # the frozen reference copy
        ("ppo", []),  # the critic
        ("grpo", ["model.lora.enabled=true", "objective.beta=0.04"]),
    ],
    ids=["grpo-reference", "ppo-critic", "lora"],
)
def test_every_model_a_run_loads_follows_model_device(
    algorithm: str,
    extra: list[str],
    tiny_config_dir: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With `model.device: cpu` no loader may resolve `auto` (it would pick the GPU on a GPU host
    while the policy sits elsewhere), every model ends on the CPU, and the first line says so."""
    import rlvr.models as models

    asked: list[str] = []
    resolve = devices.resolve_device

    def recording(setting: str = "auto") -> torch.device:
        asked.append(str(setting))
        return resolve(setting)

    monkeypatch.setattr(models, "resolve_device", recording)
    loaded: list[Any] = []
    load = models.load_model_weights

    def load_and_keep(*args: Any, **kwargs: Any) -> Any:
        model = load(*args, **kwargs)
        loaded.append(model)
        return model

    monkeypatch.setattr(models, "load_model_weights", load_and_keep)
    import rlvr.train.critic as critic

    monkeypatch.setattr(critic, "load_model_weights", load_and_keep)
    cfg = tiny_cfg(
        tiny_config_dir,
        tiny_model_dir,
        tmp_path / "run",
        f"algorithm={algorithm}",
        "model.device=cpu",
        "train.steps=1",
        "eval.n=4",
        "tracking.progress=true",
        *extra,
    )
    train(cfg, config_dir=tiny_config_dir)
    expected = 2 if algorithm == "ppo" else 1
    assert len(loaded) == expected, loaded
    assert asked and set(asked) == {"cpu"}, asked
    assert all(devices.device_of(m) == torch.device("cpu") for m in loaded)
    out = capsys.readouterr().err  # the progress console writes to stderr
    assert f"model {tiny_model_dir} on cpu: weights float32" in " ".join(out.split())


# ------------------------------------------------------------------------ micro-batch token budget
def _rows(lengths: list[int], prompt: int = 4) -> list[Trajectory]:
    return [
        Trajectory(
            task_id="t",
            token_ids=tuple(range(n)),
            policy_mask=(0,) * prompt + (1,) * (n - prompt),
            logprobs=(0.0,) * n,
            prompt_length=prompt,
            completion_text="",
            finish_reason="stop",
        )
        for n in lengths
    ]


def test_micro_batches_hold_at_most_the_token_budget() -> None:
    rows = _rows([10, 12, 30, 8, 64, 9])
    chunks = micro_batches(rows, range(len(rows)), size=4, max_tokens=32)
    assert sorted(i for c in chunks for i in c) == list(range(len(rows)))
    for chunk in chunks:
        width = max(len(rows[i].token_ids) for i in chunk)
        assert len(chunk) <= 4
        assert len(chunk) == 1 or len(chunk) * width <= 32, chunk
    assert [4] in chunks  # the 64-token row is over the cap: alone
    assert micro_batches(rows, range(len(rows)), size=4) == micro_batches(
        rows, range(len(rows)), size=4, max_tokens=None
    )


@pytest.mark.slow
def test_a_token_budget_leaves_the_update_unchanged(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Micro-batches of 16 rows vs a 60-token budget (2-3 rows of ~25 tokens): the normalisers count
    the whole batch, so the step's loss and gradient norm agree to float rounding, and the weights
    after it to well under one Adam step (lr 3e-3): Adam's normalised step amplifies the rounding
    of near-zero gradients. Later steps would sample from the slightly different weights."""
    from safetensors.torch import load_file

    from rlvr.observe.tracking import read_metrics

    weights, first = {}, {}
    for cap in ("null", "60"):
        cfg = tiny_cfg(
            tiny_config_dir,
            tiny_model_dir,
            tmp_path / f"cap-{cap}",
            f"train.max_tokens_per_micro_batch={cap}",
            "eval.at_start=false",
            "eval.at_end=false",
            "train.steps=1",
        )
        summary = train(cfg, config_dir=tiny_config_dir)
        model_file = summary.run_dir / "checkpoints" / "step-000001" / "model" / "model.safetensors"
        weights[cap] = load_file(str(model_file))
        first[cap] = next(m for m in read_metrics(summary.run_dir) if "loss" in m)
    assert first["60"]["update/micro_batches"] > first["null"]["update/micro_batches"]
    for key in ("loss", "grad_norm"):
        assert first["60"][key] == pytest.approx(first["null"][key], rel=1e-5, abs=1e-7), key
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    assert any(not torch.equal(initial[k], weights["60"][k]) for k in initial)
    for name in weights["60"]:
        torch.testing.assert_close(weights["60"][name], weights["null"][name], rtol=0, atol=3e-4)
