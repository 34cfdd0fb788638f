"""Offline training stages: SFT, DPO, a Bradley-Terry reward model, and teacher (distillation) data.

Each stage takes a typed config (rlvr.offline.config), writes everything under its `output_dir`
(metrics.jsonl, checkpoints, the final model as a plain HF directory, DONE.json) and returns a
`StageResult`, so one stage's `model_dir` is the next stage's `model.name`.
"""

from __future__ import annotations

from rlvr.offline.common import StageResult
from rlvr.offline.config import (
    DistillDataConfig,
    DPOConfig,
    OfflineDataConfig,
    OfflineTrainConfig,
    RewardModelConfig,
    SFTConfig,
    load_stage_config,
)
from rlvr.offline.distill_data import generate_teacher_data
from rlvr.offline.dpo import train_dpo
from rlvr.offline.reward_model import RewardScorer, load_reward_model, train_reward_model
from rlvr.offline.sft import train_sft

__all__ = [
    "DPOConfig",
    "DistillDataConfig",
    "OfflineDataConfig",
    "OfflineTrainConfig",
    "RewardModelConfig",
    "RewardScorer",
    "SFTConfig",
    "StageResult",
    "generate_teacher_data",
    "load_reward_model",
    "load_stage_config",
    "train_dpo",
    "train_reward_model",
    "train_sft",
]
