"""Per-step rollout metrics, named as TRL names them where TRL has the metric."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

from rlvr.algorithms.advantages import group_reward_std
from rlvr.records import Group, Trajectory, flatten


def rollout_metrics(
    groups: Sequence[Group], rubric_names: Sequence[str], group_size: int
) -> dict[str, float]:
    trajs = flatten(groups)
    rewards_B = torch.tensor([t.reward for t in trajs])
    valid_B = torch.tensor([t.usable for t in trajs])
    std_P = group_reward_std(rewards_B, valid_B, group_size)
    usable = [t for t in trajs if t.usable]
    lengths = [t.num_policy_tokens for t in trajs]
    out: dict[str, float] = {
        "reward": statistics.fmean(t.reward for t in usable) if usable else float("nan"),
        "reward_std": float(std_P.mean()),
        "frac_reward_zero_std": float((std_P < 1e-8).float().mean()),
        "completions/mean_length": statistics.fmean(lengths),
        "completions/max_length": float(max(lengths)),
        "completions/min_length": float(min(lengths)),
        "completions/clipped_ratio": statistics.fmean(
            float(t.finish_reason == "length") for t in trajs
        ),
        # -log p of the sampled tokens under the sampler: a Monte Carlo estimate of the policy's entropy
        # that exists for every row, including rows the update skipped (see `entropy`).
        "completions/neg_logprob_mean": _neg_logprob_mean(trajs),
    }
    for name in rubric_names:
        values = [t.rewards[name] for t in trajs if name in t.rewards]
        out[f"rewards/{name}/mean"] = statistics.fmean(values) if values else float("nan")
        out[f"rewards/{name}/std"] = statistics.pstdev(values) if len(values) > 1 else 0.0
        out[f"rewards/{name}/errors"] = float(sum(name in t.reward_errors for t in trajs))
    return out


def rollout_rows(groups: Sequence[Group]) -> list[dict[str, Any]]:
    return [
        {
            "task_id": t.task_id,
            "completion": t.completion_text[:2000],
            "reward": t.reward,
            "rewards": dict(t.rewards),
            "errors": dict(t.info.get("reward_errors", {})),
            "finish_reason": t.finish_reason,
            "num_tokens": t.num_policy_tokens,
        }
        for t in flatten(groups)
    ]


def _neg_logprob_mean(trajs: Sequence[Trajectory]) -> float:
    total, count = 0.0, 0
    for t in trajs:
        for lp, m in zip(t.logprobs, t.policy_mask, strict=True):
            if m:
                total -= lp
                count += 1
    return total / count if count else float("nan")
