"""The models a run keeps besides the policy: ppo's critic and distill's teacher."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlvr.config import RunConfig
from rlvr.devices import device_of
from rlvr.errors import ConfigError
from rlvr.models import LoraSettings, Policy, load_policy
from rlvr.optim import adamw
from rlvr.records import Trajectory
from rlvr.train.batch import TrainBatch, collate
from rlvr.train.checkpoint import load_data
from rlvr.train.critic import ValueModel, build_critic, critic_update
from rlvr.train.micro_batching import micro_batches, per_token_scores, trains_on
from rlvr.train.selection import Credit


class RunCritic:
    """PPO's value model with its own optimizer: values before the update, one fit per iteration."""

    def __init__(self, cfg: RunConfig, pad_token_id: int, device: torch.device) -> None:
        c = cfg.critic
        lora = None
        if c.lora.enabled:
            lora = LoraSettings(
                r=c.lora.r,
                alpha=c.lora.alpha,
                dropout=c.lora.dropout,
                target_modules=c.lora.target_modules,
            )
        self.cfg = cfg
        self.model: ValueModel = build_critic(
            c.model or cfg.model.name,
            lora,
            torch.float32,
            gradient_checkpointing=cfg.model.gradient_checkpointing,
            device=device,
        )
        params = self.model.trainable_parameters()
        self.optimizer = adamw(
            params,
            lr=c.learning_rate,
            betas=cfg.train.adam_betas,
            weight_decay=cfg.train.weight_decay,
        )
        self.pad_token_id = pad_token_id

    def token_values(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        """V(s_t) for every completion token of every trajectory (no gradient)."""
        self.model.eval()
        return per_token_scores(
            self.model.values,
            trajectories,
            self.cfg,
            self.pad_token_id,
            device=device_of(self.model),
        )

    def update(self, trajectories: Sequence[Trajectory], credit: Credit) -> dict[str, float]:
        """num_iterations optimizer steps of the clipped value loss towards `credit.returns`."""
        assert credit.returns is not None and credit.old_values is not None
        rows = [i for i, t in enumerate(trajectories) if trains_on(t, self.cfg)]
        if not rows:
            return {}
        chunks = micro_batches(
            trajectories,
            rows,
            self.cfg.train.micro_batch_size,
            self.cfg.train.max_tokens_per_micro_batch,
        )
        device = device_of(self.model)
        batches: list[TrainBatch] = []
        returns: list[torch.Tensor] = []
        old_values: list[torch.Tensor] = []
        for chunk in chunks:
            batch = collate(
                [trajectories[i] for i in chunk],
                [credit.returns[i] for i in chunk],
                self.pad_token_id,
                device,
            ).to(device)
            batches.append(batch)
            returns.append(batch.advantages_B_C)  # collate pads a per-token list: here, returns
            old_values.append(
                collate(
                    [trajectories[i] for i in chunk],
                    [credit.old_values[i] for i in chunk],
                    self.pad_token_id,
                    device,
                ).advantages_B_C.to(device)
            )
        total_tokens = float(sum(trajectories[i].num_policy_tokens for i in rows))
        self.model.train()
        metrics: dict[str, float] = {}
        for _ in range(self.cfg.objective.num_iterations):
            metrics = critic_update(
                self.model,
                self.optimizer,
                batches,
                returns,
                old_values,
                clip_range=self.cfg.critic.value_clip,
                aggregation="token-mean",
                total_tokens=total_tokens,
                max_grad_norm=self.cfg.train.max_grad_norm,
            )
        return metrics

    def save(self, checkpoint_dir: Path) -> None:
        self.model.save(checkpoint_dir / "critic")
        torch.save(self.optimizer.state_dict(), checkpoint_dir / "critic" / "optimizer.pt")

    def load(self, checkpoint_dir: Path) -> None:
        self.model.load_into(checkpoint_dir / "critic")
        self.optimizer.load_state_dict(load_data(checkpoint_dir / "critic" / "optimizer.pt"))


def build_teacher(cfg: RunConfig, policy: Policy) -> Any:
    """The frozen teacher of `algorithm: distill`; its vocabulary must be the student's (the KL
    compares the two next-token distributions id by id)."""
    assert cfg.distill.teacher is not None
    loaded = load_policy(cfg.distill.teacher, device=device_of(policy.model))
    teacher = loaded.model.eval()
    teacher.requires_grad_(False)
    student_vocab = policy.model.get_output_embeddings().weight.shape[0]
    teacher_vocab = teacher.get_output_embeddings().weight.shape[0]
    if (
        student_vocab != teacher_vocab
        or policy.tokenizer.get_vocab() != loaded.tokenizer.get_vocab()
    ):
        raise ConfigError(
            f"distill.teacher '{cfg.distill.teacher}' has a different vocabulary from the student "
            f"({teacher_vocab} vs {student_vocab} ids); on-policy distillation needs the same tokenizer"
        )
    return teacher
