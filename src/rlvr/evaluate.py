"""Held-out evaluation: greedy pass@1 and sampled mean@k, scored as in training (same env, same rubric)."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rlvr.envs import SingleTurnEnv
from rlvr.errors import ConfigError
from rlvr.records import Task, flatten
from rlvr.rollout.engine import EnvFactory, RolloutLimits, Scoring, rollout_groups
from rlvr.rollout.generator import Generator, SamplingParams

if TYPE_CHECKING:
    from rlvr.train.sources import Sources


def evaluate(
    tasks: Sequence[Task],
    make_env: EnvFactory | None,
    generator: Generator,
    tokenizer: Any,
    scoring: Scoring | Callable[[Task], Scoring],
    *,
    metric: str,
    max_new_tokens: int,
    k: int = 1,
    temperature: float = 1.0,
    stop: tuple[str, ...] = (),
    limits: RolloutLimits | None = None,
) -> dict[str, float]:
    """Accuracy on `tasks`: the mean of reward component `metric` (a 0/1 verifier).

    k == 1: greedy decoding, `eval/accuracy` is pass@1. k > 1: k samples per task at `temperature`,
    `eval/accuracy` is mean@k (the expected accuracy of one sample) and `eval/pass@k` the share of
    tasks with at least one correct sample. Rollouts whose verifier (or env) raised count as wrong
    here and are reported in `eval/errors`. `make_env` None plays each task as one turn.
    """
    if not tasks:
        raise ConfigError("no held-out tasks to evaluate (empty held-out split)")
    greedy = k == 1
    sampling = SamplingParams(
        n=k, temperature=0.0 if greedy else temperature, max_new_tokens=max_new_tokens, stop=stop
    )
    if limits is not None and limits.max_total_tokens < max_new_tokens:
        # Eval may allow longer answers than training did; never cap it at the training budget.
        limits = dataclasses.replace(limits, max_total_tokens=max_new_tokens)
    groups = rollout_groups(
        tasks, make_env or SingleTurnEnv, generator, tokenizer, sampling, scoring, limits
    )
    trajectories = flatten(groups)
    values = [t.rewards.get(metric, 0.0) for t in trajectories]
    out = {
        "eval/accuracy": statistics.fmean(values),
        "eval/reward": statistics.fmean(t.reward for t in trajectories),
        "eval/mean_length": statistics.fmean(t.num_policy_tokens for t in trajectories),
        "eval/errors": float(sum(not t.usable for t in trajectories)),
        "eval/n": float(len(tasks)),
    }
    out["eval/tool_call_rate"] = statistics.fmean(
        float(t.info.get("tool_calls", 0) > 0) for t in trajectories
    )
    out["eval/turns"] = statistics.fmean(len(t.turns) for t in trajectories)
    if not greedy:
        out["eval/pass@k"] = statistics.fmean(
            float(any(t.rewards.get(metric, 0.0) >= 1.0 for t in g.trajectories)) for g in groups
        )
    return out


def evaluate_sources(
    sources: Sources,
    generator: Generator,
    tokenizer: Any,
    *,
    n: int,
    max_new_tokens: int,
    stop: tuple[str, ...] = (),
    limits: RolloutLimits | None = None,
    k: int = 1,
    temperature: float = 1.0,
) -> dict[str, float]:
    """Held-out eval of every source of a run (first `n` held-out tasks each). A mixture reports
    eval/<source>/... per source and `eval/accuracy` as the unweighted mean over sources."""
    out: dict[str, float] = {}
    accuracies = []
    for source in sources:
        ev = evaluate(
            source.splits.heldout[:n],
            source.make_env,
            generator,
            tokenizer,
            source.scoring,
            metric=source.metric,
            max_new_tokens=max_new_tokens,
            stop=stop,
            limits=limits,
            k=k,
            temperature=temperature,
        )
        accuracies.append(ev["eval/accuracy"])
        if sources.is_mixture:
            out.update(
                {key.replace("eval/", f"eval/{source.name}/", 1): v for key, v in ev.items()}
            )
        else:
            out.update(ev)
    if sources.is_mixture:
        out["eval/accuracy"] = statistics.fmean(accuracies)
    return out
