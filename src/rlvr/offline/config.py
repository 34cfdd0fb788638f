"""Typed configs of the offline stages (SFT, DPO, reward model, teacher data), each field described once.

Every stage config has `model`, `data`, `train` (the optimisation knobs shared by all stages),
`output_dir`, `checkpoint_every` and `eval_every`, plus the stage's own keys at the top level.
Like `RunConfig`, unknown keys are errors and the configs are frozen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import yaml
from pydantic import Field, ValidationError, model_validator

from rlvr.config import (
    ModelConfig,
    RewardSpec,
    _format_validation_error,
    _Section,
    apply_overrides,
)
from rlvr.errors import ConfigError
from rlvr.yaml_types import file_booleans


class OfflineDataConfig(_Section):
    path: str | None = Field(
        None,
        description="A .jsonl/.json file (or rows passed in Python): chat rows {messages} (SFT) or pairs "
        "{prompt, chosen, rejected} (DPO, reward model).",
    )
    heldout_path: str | None = Field(None, description="Separate held-out file; else carved.")
    heldout_fraction: float = Field(
        0.1, ge=0.0, lt=1.0, description="Share carved off for held-out metrics; 0 = no eval."
    )


class OfflineTrainConfig(_Section):
    steps: int | None = Field(
        None, ge=1, description="Optimizer steps; None = epochs over the training rows."
    )
    epochs: float = Field(1.0, gt=0.0, description="Passes over the data when steps is None.")
    batch_size: int = Field(
        8, ge=1, description="Examples (pairs, packed rows) per optimizer step."
    )
    micro_batch_size: int = Field(
        8, ge=1, description="Examples per forward/backward; fewer than batch_size accumulates."
    )
    learning_rate: float | None = Field(
        None, gt=0.0, description="None = the stage's default (SFT 2e-5, DPO 1e-6, RM 1e-5)."
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = "linear"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = Field(1.0, gt=0.0)
    max_length: int = Field(1024, ge=2, description="Tokens per example (prompt + completion).")
    truncate: bool = Field(
        False,
        description="Cut examples longer than max_length on the right; off = such an example is "
        "an error.",
    )
    seed: int = 0


class _StageConfig(_Section):
    model: ModelConfig = ModelConfig()
    data: OfflineDataConfig = OfflineDataConfig()
    train: OfflineTrainConfig = OfflineTrainConfig()
    output_dir: str = Field(..., description="Checkpoints, metrics.jsonl, model/, DONE.json.")
    checkpoint_every: int = Field(0, ge=0, description="Save every k steps (0 = only the end).")
    keep_last: int = Field(2, ge=1, description="Checkpoints kept.")
    eval_every: int = Field(0, ge=0, description="Held-out eval every k steps (0 = end only).")
    progress: bool = Field(True, description="A live progress bar with the loss on stderr.")

    # Each stage's default learning rate; train.learning_rate overrides it.
    default_learning_rate: ClassVar[float] = 1e-5

    def learning_rate(self) -> float:
        return self.train.learning_rate or self.default_learning_rate


class SFTConfig(_StageConfig):
    packing: bool = Field(
        False,
        description="Pack several examples into one row of max_length (block-diagonal attention, "
        "positions restart per example).",
    )
    assistant_only_loss: bool = Field(
        True, description="Train only on assistant tokens (else on every token but the first)."
    )

    default_learning_rate: ClassVar[float] = 2e-5  # TRL's SFTConfig default


class DPOConfig(_StageConfig):
    beta: float = Field(
        0.1, gt=0.0, description="Strength of the KL tie to the reference (DPO paper, TRL: 0.1)."
    )
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field(
        "sigmoid",
        description="sigmoid: DPO (Rafailov et al. 2023); ipo: IPO (Azar et al. 2023); "
        "hinge: SLiC-HF (Zhao et al. 2023).",
    )
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=0.5, description="cDPO: probability that a label is flipped (sigmoid)."
    )

    @model_validator(mode="after")
    def _smoothing_sigmoid_only(self) -> DPOConfig:
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError("label_smoothing applies to loss_type 'sigmoid' only")
        return self

    # TRL's DPOConfig default: DPO starts from a tuned model and should move it little.
    default_learning_rate: ClassVar[float] = 1e-6


class RewardModelConfig(_StageConfig):
    margin_key: str | None = Field(
        None,
        description="Pair field holding a margin (Llama 2's BT margin); None = no margin.",
    )


class DistillDataConfig(_Section):
    teacher: str = Field(..., description="Teacher: HF model directory, hub id or alias.")
    bf16: Literal["auto", "on", "off"] = "auto"
    prompts_path: str = Field(
        ..., description="A .jsonl/.json file of rows {prompt: str or messages} or {messages}."
    )
    prompt_column: str = "prompt"
    system_prompt: str | None = Field(None, description="Prepended when a prompt has none.")
    samples_per_prompt: int = Field(1, ge=1)
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    batch_size: int = Field(16, ge=1, description="Prompts per generation call.")
    drop_truncated: bool = Field(
        True, description="Drop samples cut by max_new_tokens (SFT would learn to end them)."
    )
    reward: RewardSpec | None = Field(
        None,
        description="Rejection sampling: keep samples this reward scores >= min_reward; the "
        "prompt row's other columns are its task fields.",
    )
    min_reward: float = 1.0
    output_path: str = Field(..., description="The chat-format JSONL written (SFT input).")
    seed: int = 0


StageConfig = TypeVar("StageConfig", SFTConfig, DPOConfig, RewardModelConfig, DistillDataConfig)


def load_stage_config(
    cls: type[StageConfig], path: str | Path | None, overrides: list[str] | None = None
) -> StageConfig:
    """Read a stage config from YAML (or only `--set` overrides), validated; errors are one line."""
    source = str(path) if path is not None else "config"
    data: Any = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file '{file}' does not exist")
        try:
            data = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"{source}: malformed YAML: {problem}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of keys")
        data = file_booleans(data, cls)  # `bf16: off` means "off" (rlvr/yaml_types.py)
    data = apply_overrides(data, overrides or [], cls)
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None
