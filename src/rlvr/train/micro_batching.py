"""Micro-batch planning: which rows each process forwards together, for the update and for scoring.

Rows of one prompt go together (their prompt is forwarded once), similar lengths together (less
padding), under `train.micro_batch_size` rows and `train.max_tokens_per_micro_batch` tokens. Under
torchrun every rank gets a contiguous run of the prompt order with about equal tokens (`shard_rows`),
and under fsdp every rank runs as many forwards as the busiest one (`RankPlan`). `per_token_scores`
runs a gradient-free scorer (reference log-probs, critic values) over the same plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlvr.build import device_or_cpu
from rlvr.config import RunConfig
from rlvr.records import Trajectory
from rlvr.scale.torch_dist import DistContext, contiguous_cuts
from rlvr.train.batch import TrainBatch, collate
from rlvr.train.packing import packing_wanted


def micro_batches(
    trajectories: Sequence[Trajectory],
    indices: Sequence[int],
    size: int,
    max_tokens: int | None = None,
    *,
    packed: bool = False,
) -> list[list[int]]:
    """Split `indices` into micro-batches of at most `size` rows: rows of one prompt together (its
    forward pass is shared), similar lengths together (less padding). With `max_tokens`
    (`train.max_tokens_per_micro_batch`) a micro-batch also holds at most that many padded tokens,
    counted as rows x its longest row (prompt + completion: an upper bound on what the forward holds
    activations for), or with `packed` (rows laid end to end, rlvr.train.packing) as the sum of the
    rows' lengths; a row longer than the cap goes alone."""
    ordered = prompt_order(trajectories, indices)
    if max_tokens is None:
        return [ordered[s : s + size] for s in range(0, len(ordered), size)]
    chunks: list[list[int]] = []
    current: list[int] = []
    longest = total = 0
    for i in ordered:
        length = len(trajectories[i].token_ids)
        widest = max(longest, length)
        tokens = total + length if packed else (len(current) + 1) * widest
        if current and (len(current) + 1 > size or tokens > max_tokens):
            chunks.append(current)
            current, widest, total = [], length, 0
        current.append(i)
        longest = widest
        total += length
    if current:
        chunks.append(current)
    return chunks


def prompt_order(trajectories: Sequence[Trajectory], indices: Sequence[int]) -> list[int]:
    """`indices` grouped by task (in order of first appearance), shortest first within a task."""
    first_seen: dict[str, int] = {}
    for i in indices:
        first_seen.setdefault(trajectories[i].task_id, i)
    return sorted(
        indices, key=lambda i: (first_seen[trajectories[i].task_id], len(trajectories[i].token_ids))
    )


def shard_rows(
    trajectories: Sequence[Trajectory], indices: Sequence[int], world_size: int
) -> list[list[int]]:
    """Every rank's rows of `indices` (a list per rank): contiguous runs of the prompt order with about
    equal tokens to forward, cut between tasks unless cutting inside one balances better by more than
    the prompt it then forwards twice (rlvr.scale.torch_dist.contiguous_cuts). A rank's run is
    already in `micro_batches` order."""
    ordered = prompt_order(trajectories, indices)
    # A row costs its completion; a task's prompt is forwarded once per rank that holds its rows.
    costs = [float(len(trajectories[i].token_ids) - trajectories[i].prompt_length) for i in ordered]
    starts, prompts = [], []
    for k, i in enumerate(ordered):
        if k == 0 or trajectories[i].task_id != trajectories[ordered[k - 1]].task_id:
            starts.append(k)
            prompts.append(float(trajectories[i].prompt_length))
            costs[k] += prompts[-1]
    cuts = contiguous_cuts(costs, starts, world_size, prompts)
    return [ordered[cuts[r] : cuts[r + 1]] for r in range(world_size)]


def per_token_scores(
    score: Callable[[TrainBatch], torch.Tensor],
    trajectories: Sequence[Trajectory],
    cfg: RunConfig,
    pad_token_id: int,
    dist: DistContext | None = None,
    device: torch.device | None = None,
) -> list[list[float]]:
    """`score(batch) -> (B, C)` (reference log-probs, critic values) for every usable trajectory, as one
    list per trajectory with a value per completion token (zeros for a trajectory that did not score).
    Runs without gradient, micro-batched like the update. With `dist` each rank scores its shard of
    the rows (in lock-step under fsdp, see `RankPlan`) and every rank gets every row's scores."""
    out = [[0.0] * (len(t.token_ids) - t.prompt_length) for t in trajectories]
    usable = [i for i, t in enumerate(trajectories) if t.usable]
    plan = RankPlan.make(
        trajectories,
        usable,
        cfg.train.micro_batch_size,
        dist,
        max_tokens=cfg.train.max_tokens_per_micro_batch,
    )
    zeros = [[0.0] * (len(t.token_ids) - t.prompt_length) for t in trajectories]
    device = dist.device if dist is not None else device
    with torch.no_grad():
        for chunk in plan.chunks:
            scores_B_C = score(plan.collate(trajectories, zeros, pad_token_id, chunk, device))
            if chunk is plan.padding:
                continue  # fsdp lock-step forward (RankPlan): its scores are not this rank's rows
            for row, i in enumerate(chunk):
                out[i] = scores_B_C[row, : len(out[i])].tolist()
    if dist is None:
        return out
    mine = [(i, out[i]) for chunk in plan.chunks if chunk is not plan.padding for i in chunk]
    for i, values in dist.all_gather_objects(mine):
        out[i] = values
    return out


@dataclass
class RankPlan:
    """The micro-batches (lists of row indices) this process forwards, for one pass over `rows`.

    Single process: all of `rows`. Under torchrun: this rank's shard (`shard_rows`). Under fsdp every
    forward is a collective, so every rank must run as many forwards as the busiest one: the list is
    topped up with `padding` (the shortest row of the batch, scored and then weighted 0). For the same
    reason fsdp takes the shared-prompt path only if no row has a 1-token completion (that path calls
    the model once instead of twice for such a micro-batch) and never the fused head (it calls the
    decoder and the lm_head weight outside the root module's forward, where FSDP gathers them).
    """

    chunks: list[list[int]]
    padding: list[int]
    share_prefix: bool
    fused: bool
    packed: bool = False

    @classmethod
    def make(
        cls,
        trajectories: Sequence[Trajectory],
        rows: Sequence[int],
        size: int,
        dist: DistContext | None,
        share_prefix: bool = True,
        fused: bool = True,
        *,
        max_tokens: int | None = None,
        packed: bool = False,
    ) -> RankPlan:
        """`packed`: the micro-batches run their rows end to end (rlvr.train.packing) wherever they
        run whole; their token cap then counts real tokens."""
        if dist is None:
            chunks = micro_batches(trajectories, rows, size, max_tokens, packed=packed)
            return cls(chunks, [], share_prefix, fused, packed)
        shards = shard_rows(trajectories, rows, dist.world_size)
        chunks = micro_batches(trajectories, shards[dist.rank], size, max_tokens, packed=packed)
        padding: list[int] = []
        if dist.fsdp and rows:
            steps = max(
                len(micro_batches(trajectories, s, size, max_tokens, packed=packed)) for s in shards
            )
            padding = [min(rows, key=lambda i: len(trajectories[i].token_ids))]
            chunks += [padding] * (steps - len(chunks))  # the same list object: `is` finds it
            short = any(
                len(trajectories[i].token_ids) - trajectories[i].prompt_length < 2 for i in rows
            )
            share_prefix = share_prefix and not short
            fused = False
        return cls(chunks, padding, share_prefix, fused, packed)

    def collate(
        self,
        trajectories: Sequence[Trajectory],
        token_advantages: Sequence[Sequence[float]],
        pad_token_id: int,
        chunk: list[int],
        device: torch.device | None = None,
    ) -> TrainBatch:
        batch = collate(
            [trajectories[i] for i in chunk],
            [token_advantages[i] for i in chunk],
            pad_token_id,
            device,
            pack=self.packed,
        )
        return batch if device is None else batch.to(device)


def use_fused_logprobs(cfg: RunConfig) -> bool:
    """`train.fused_logprobs`, with auto = LoRA runs in either precision, and every run on a GPU,
    where the (rows, length, vocab) fp32 logits are the update's largest activation (8 x 1024 x 152k
    ids = 5 GB) and memory, not the CPU's page faults, is what binds (see rlvr/config/training.py)."""
    setting = cfg.train.fused_logprobs
    if setting != "auto":
        return bool(setting)
    return cfg.model.lora.enabled or device_or_cpu(cfg.model.device).type == "cuda"


def packs_rows(cfg: RunConfig, model: Any, *, training: bool) -> bool:
    """Whether micro-batches are collated packed (`train.padding_free`, rlvr.train.packing): only
    where their rows run whole, i.e. the shared-prompt path is off, or gradient checkpointing turns it
    off (in training mode only: HF keeps the KV cache in eval mode)."""
    whole = not cfg.train.share_prompt_prefix or (training and cfg.model.gradient_checkpointing)
    return whole and packing_wanted(cfg.train.padding_free, model)


def trains_on(trajectory: Trajectory, cfg: RunConfig) -> bool:
    """Whether a trajectory enters the loss: it scored, and (DAPO overlong filtering) was not cut off."""
    if not trajectory.usable:
        return False
    return not (cfg.objective.mask_truncated and trajectory.finish_reason == "length")
