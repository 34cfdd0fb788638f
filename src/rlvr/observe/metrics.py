"""Per-step rollout metrics, named as TRL names them where TRL has the metric."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlvr.algorithms.advantages import group_reward_std
from rlvr.records import Group, Trajectory, flatten

# Metrics that measure the machine rather than the run: they differ between two runs that are otherwise
# identical to the bit (a resumed run and the uninterrupted one, say).
WALL_CLOCK_METRICS = frozenset(
    {
        "time",
        "step_time",
        "rollout_time",
        "update_time",
        "tokens_per_second",
        "perf/update_gflops_per_s",
        "perf/decode_ms_per_step",
        "perf/precision",  # model.bf16: auto measures the host
    }
)


def signal_metrics(
    sampled: Sequence[Group], succeeded: Callable[[Trajectory], bool], group_size: int
) -> dict[str, float]:
    """Whether a step carried any signal, per step (issue 62): episodes and successes sampled,
    groups whose rewards differ at all and groups holding both a success and a failure (a success
    contrast: the only groups that say what success takes). The filter's side (groups kept, the
    share of them all-equal) is rlvr.train.selection.collect_groups'. `succeeded(t)` is the source's
    accuracy rule (its metric component >= 1, as the held-out eval counts a pass)."""
    trajs = flatten(sampled)
    valid_B = torch.tensor([t.usable for t in trajs], device="cpu")
    std_P = group_reward_std(
        torch.tensor([t.reward for t in trajs], device="cpu"), valid_B, group_size
    )
    wins = [[succeeded(t) for t in g.trajectories if t.usable] for g in sampled]
    return {
        "signal/episodes": float(len(trajs)),
        "signal/successes": float(sum(sum(w) for w in wins)),
        "signal/groups": float(len(sampled)),
        "signal/groups_reward_contrast": float((std_P > 0).sum()),
        "signal/groups_success_contrast": float(sum(any(w) and not all(w) for w in wins)),
    }


def rollout_metrics(
    groups: Sequence[Group], rubric_names: Sequence[str], group_size: int
) -> dict[str, float]:
    trajs = flatten(groups)
    # Host bookkeeping: Python numbers in, Python floats out.
    rewards_B = torch.tensor([t.reward for t in trajs], device="cpu")
    valid_B = torch.tensor([t.usable for t in trajs], device="cpu")
    std_P = group_reward_std(rewards_B, valid_B, group_size)
    usable = [t for t in trajs if t.usable]
    lengths = [t.num_policy_tokens for t in trajs]
    out: dict[str, float] = {
        "reward": statistics.fmean(t.reward for t in usable) if usable else float("nan"),
        # TRL's `reward_std`: the std of the whole batch's rewards (Bessel-corrected, unscored rows
        # left out, as TRL's nanstd leaves out its NaN rows). It mixes the spread between prompts
        # with the spread within them, so it is not the signal GRPO learns from:
        "reward_std": statistics.stdev(t.reward for t in usable)
        if len(usable) > 1
        else float("nan"),
        # that is the mean over groups of the in-group std (what the group advantages divide by).
        "reward_std_in_group": float(std_P.mean()),
        # group_reward_std is exactly 0 for a group with all-equal rewards (and > 0 otherwise): the
        # same rule the zero-std filter and the advantages use, whatever the float32 rounding.
        "frac_reward_zero_std": float((std_P == 0).float().mean()),
        "completions/mean_length": statistics.fmean(lengths),
        "completions/max_length": float(max(lengths)),
        "completions/min_length": float(min(lengths)),
        "completions/clipped_ratio": statistics.fmean(
            float(t.finish_reason == "length") for t in trajs
        ),
        # -log p of the sampled tokens under the sampler: a Monte Carlo estimate of the policy's entropy
        # that exists for every row, including rows the update skipped (see `entropy`).
        "completions/neg_logprob_mean": _neg_logprob_mean(trajs),
        # Share of trajectories whose completion tokens equal another's in their group (Echo Trap).
        "rollout/duplicate_frac": duplicate_fraction(groups),
    }
    for name in rubric_names:
        values = [t.rewards[name] for t in trajs if name in t.rewards]
        out[f"rewards/{name}/mean"] = statistics.fmean(values) if values else float("nan")
        out[f"rewards/{name}/std"] = statistics.pstdev(values) if len(values) > 1 else 0.0
        out[f"rewards/{name}/errors"] = float(sum(name in t.reward_errors for t in trajs))
    return out


def duplicate_fraction(groups: Sequence[Group]) -> float:
    """Fraction of trajectories whose completion token ids are identical to another trajectory's in
    the same group: 0 when every sample differs, 1 when no sample is unique (e.g. 8 copies, or 4 + 4)."""
    total = duplicated = 0
    for g in groups:
        counts = Counter(t.completion_ids for t in g.trajectories)
        total += len(g.trajectories)
        duplicated += sum(n for n in counts.values() if n > 1)
    return duplicated / total if total else 0.0


def agent_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Turns, tool use and env failures. `tools/call_frequency` is tool calls per trajectory and
    `tools/failure_frequency` the share of calls that failed (TRL's names); `tools/errors/<kind>`
    splits the failures (malformed, unknown_tool, bad_arguments, raised, timeout, too_many_calls)."""
    if not trajs:
        return {}
    calls = sum(float(t.info.get("tool_calls", 0.0)) for t in trajs)
    failures = sum(float(t.info.get("tool_failures", 0.0)) for t in trajs)
    out = {
        "turns/mean": statistics.fmean(len(t.turns) for t in trajs),
        "turns/max": float(max(len(t.turns) for t in trajs)),
        "turns/max_turns_ratio": statistics.fmean(
            float(t.finish_reason == "max_turns") for t in trajs
        ),
        "env/errors": float(sum("env" in t.reward_errors for t in trajs)),
        "tools/call_frequency": calls / len(trajs),
        "tools/failure_frequency": failures / calls if calls else 0.0,
        "tools/call_rate": statistics.fmean(float(t.info.get("tool_calls", 0) > 0) for t in trajs),
    }
    kinds = sorted({k for t in trajs for k in t.info if k.startswith("tool_errors/")})
    for key in kinds:
        out["tools/errors/" + key.split("/", 1)[1]] = sum(
            float(t.info.get(key, 0.0)) for t in trajs
        )
    return out


def verifiability_metrics(
    trajs: Sequence[Trajectory], weights: dict[str, float], unverifiable: set[str]
) -> dict[str, float]:
    """Verifiable and non-verifiable (LLM judge) reward reported apart: `reward/verifiable`,
    `reward/non_verifiable` (weighted sums over usable rollouts). The judge's share rising while the
    verifiable share stays flat is the classic sign of a policy exploiting its judge."""
    if not unverifiable:
        return {}
    usable = [t for t in trajs if t.usable]
    out = {f"rewards/{name}/verifiable": float(name not in unverifiable) for name in weights}
    for key, keep in (("reward/verifiable", False), ("reward/non_verifiable", True)):
        totals = [
            sum(
                w * t.rewards.get(n, 0.0) for n, w in weights.items() if (n in unverifiable) == keep
            )
            for t in usable
        ]
        out[key] = statistics.fmean(totals) if totals else float("nan")
    return out


def source_metrics(trajs: Sequence[Trajectory], metric_of: dict[str, str]) -> dict[str, float]:
    """Per mixture source: `env/<source>/reward`, `env/<source>/accuracy` (its success metric), count."""
    out: dict[str, float] = {}
    for source, metric in metric_of.items():
        mine = [t for t in trajs if t.source == source and t.usable]
        out[f"env/{source}/count"] = float(len(mine))
        if mine:
            out[f"env/{source}/reward"] = statistics.fmean(t.reward for t in mine)
            out[f"env/{source}/accuracy"] = statistics.fmean(
                t.rewards.get(metric, 0.0) for t in mine
            )
    return out


def rollout_rows(groups: Sequence[Group]) -> list[dict[str, Any]]:
    return [
        {
            "task_id": t.task_id,
            "source": t.source,
            "completion": t.completion_text[:2000],
            "messages": [{**m, "content": str(m.get("content", ""))[:2000]} for m in t.messages],
            "reward": t.reward,
            "rewards": dict(t.rewards),
            "turn_rewards": list(t.turn_rewards),
            "errors": dict(t.info.get("reward_errors", {})),
            "finish_reason": t.finish_reason,
            "num_tokens": t.num_policy_tokens,
            "num_turns": len(t.turns),
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
