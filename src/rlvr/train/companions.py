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
from rlvr.scale.torch_dist import DistContext, reshard
from rlvr.train.batch import TrainBatch
from rlvr.train.checkpoint import load_data, load_sharded_optimizer, save_sharded_optimizer
from rlvr.train.critic import ValueModel, build_critic, critic_update
from rlvr.train.micro_batching import RankPlan, per_token_scores, trains_on
from rlvr.train.selection import Credit


class RunCritic:
    """PPO's value model with its own optimizer: values before the update, one fit per iteration."""

    def __init__(
        self,
        cfg: RunConfig,
        pad_token_id: int,
        device: torch.device,
        dist: DistContext | None = None,
    ) -> None:
        """`dist` (torchrun): the critic is placed like the policy (every rank from rank 0's
        weights; sharded under fsdp), scores and trains on each rank's shard of the rows."""
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
        self.dist = dist
        if dist is not None:  # before the optimizer: under fsdp it must hold the shards
            dist.prepare_model(self.model)
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
        values = per_token_scores(
            self.model,  # its forward: fsdp gathers the root's weights there
            trajectories,
            self.cfg,
            self.pad_token_id,
            self.dist,
            device=device_of(self.model),
        )
        reshard(self.model)  # fsdp: no backward follows to free the root's gathered weights
        return values

    def update(self, trajectories: Sequence[Trajectory], credit: Credit) -> dict[str, float]:
        """num_iterations optimizer steps of the clipped value loss towards `credit.returns`."""
        assert credit.returns is not None and credit.old_values is not None
        rows = [i for i, t in enumerate(trajectories) if trains_on(t, self.cfg)]
        if not rows:
            return {}
        # Each rank its shard of the rows (fsdp: topped up with padding micro-batches, RankPlan).
        plan = RankPlan.make(
            trajectories,
            rows,
            self.cfg.train.micro_batch_size,
            self.dist,
            max_tokens=self.cfg.train.max_tokens_per_micro_batch,
        )
        device = device_of(self.model) if self.dist is None else self.dist.device
        batches: list[TrainBatch] = []
        returns: list[torch.Tensor] = []
        old_values: list[torch.Tensor] = []
        for chunk in plan.chunks:
            batch = plan.collate(trajectories, credit.returns, self.pad_token_id, chunk, device)
            batches.append(batch)
            returns.append(batch.advantages_B_C)  # collate pads a per-token list: here, returns
            old = plan.collate(trajectories, credit.old_values, self.pad_token_id, chunk, device)
            old_values.append(old.advantages_B_C)
        total_tokens = float(sum(trajectories[i].num_policy_tokens for i in rows))
        widest = max(len(trajectories[i].token_ids) - trajectories[i].prompt_length for i in rows)
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
                total_sequences=float(len(rows)),
                norm_length=float(widest),  # the whole batch's, whichever rows this rank has
                real=[chunk is not plan.padding for chunk in plan.chunks],
                dist=self.dist,
            )
        return metrics

    def save(self, checkpoint_dir: Path) -> None:
        """The critic and its optimizer into `checkpoint_dir/critic`. Under torchrun every rank calls
        it: rank 0 writes the weights (gathered first under fsdp, a collective) and the optimizer;
        under fsdp the optimizer is sharded and every rank writes its shard."""
        dist = self.dist
        fsdp = dist is not None and dist.fsdp
        main = dist is None or dist.is_main
        target = checkpoint_dir / "critic"
        if fsdp or main:
            state = self.model.full_trainable_state()
            if main:
                self.model.save(target, state)
        if fsdp:
            assert dist is not None
            dist.barrier()  # the folder exists before the other ranks write into it
            save_sharded_optimizer(target, self.optimizer, self.model)
        elif main:
            torch.save(self.optimizer.state_dict(), target / "optimizer.pt")

    def load(self, checkpoint_dir: Path) -> None:
        self.model.load_into(checkpoint_dir / "critic")
        if self.dist is not None and self.dist.fsdp:
            load_sharded_optimizer(checkpoint_dir / "critic", self.optimizer, self.model)
        else:
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
