"""Shared fixtures: a tiny random model written once per session, and a tiny run config."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# Never touch the network from tests. One thread: tiny models gain nothing from two, and under
# load two OpenMP threads on two cores made a tiny forward 100x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


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
