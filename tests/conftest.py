"""Shared fixtures: a tiny random model written once per session, and a tiny run config."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# Never touch the network from tests. One thread: tiny models gain nothing from two, and under
# load two OpenMP threads on two cores made a tiny forward 100x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# `model.bf16: auto` measures the host in a real run (rlvr.train.precision_choice); tests must not
# time tiny models or write to ~/.cache, so auto is fp32 here unless the caller says otherwise
# (`make test` runs the `precision` tests a second time with RLVR_AUTO_BF16=on).
os.environ.setdefault("RLVR_AUTO_BF16", "off")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlvr.models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture()
def tiny_config_dir(tmp_path: Path) -> Path:
    """A folder holding a copy of examples/tiny.yaml and its reward file."""
    shutil.copy(EXAMPLES / "tiny.yaml", tmp_path / "tiny.yaml")
    shutil.copy(EXAMPLES / "tiny_rewards.py", tmp_path / "tiny_rewards.py")
    return tmp_path


@pytest.fixture()
def lora_policy(tiny_model_dir: Path) -> object:
    """The tiny model with LoRA adapters (r 4) whose B matrices are nonzero, so the adapters change
    the outputs (fresh peft adapters start with B = 0); in eval mode."""
    import torch

    from rlvr.models import LoraSettings, load_policy

    policy = load_policy(str(tiny_model_dir), lora=LoraSettings(r=4, alpha=8, dropout=0.0))
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    policy.model.eval()
    return policy


@pytest.fixture(autouse=True)
def _auto_precision_needs_the_mark(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """A test that lets `model.bf16: auto` pick its precision must carry `@pytest.mark.precision`.

    Such a test takes the bf16 path on CPUs with native bf16 and the fp32 path elsewhere, so a
    tolerance written on one kind can fail on the other. `make test` runs every test marked
    `precision` a second time with `auto` resolved the other way (RLVR_AUTO_BF16, rlvr.precision), and
    this check keeps the mark honest: it fails any unmarked test that asked the CPU. Tests that pin
    `model.bf16` (or `autocast_bf16=`) never ask and need no mark. Tests that resolve `auto` only in a
    subprocess (torchrun, a launched server) are not seen here: mark them by hand. The sampler's
    `generator.decode_dtype: auto` (rlvr.precision.bf16_sampler_on) follows RLVR_AUTO_BF16 too, which
    this file always sets, so it never asks the CPU in a test: unmarked tests sample on HF's path,
    and the `precision` tests run again from the bf16 copy.
    """
    import rlvr.precision as precision

    asked: list[bool] = []
    detect = precision.native_bf16

    def recorded() -> bool:
        asked.append(True)
        return detect()

    monkeypatch.setattr(precision, "native_bf16", recorded)
    yield
    if asked and request.node.get_closest_marker("precision") is None:
        pytest.fail(
            f"{request.node.nodeid} ran with model.bf16: auto (its precision depends on the CPU): "
            "pin model.bf16 or mark the test @pytest.mark.precision",
            pytrace=False,
        )
