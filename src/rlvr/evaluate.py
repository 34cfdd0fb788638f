"""Held-out evaluation: greedy pass@1 and sampled mean@k, scored by the same rubric as training."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from rlvr.errors import ConfigError
from rlvr.records import Task, flatten
from rlvr.rollout.generator import Generator, SamplingParams
from rlvr.rollout.single_turn import rollout_groups
from rlvr.verifiers import Rubric


def evaluate(
    tasks: Sequence[Task],
    generator: Generator,
    tokenizer: Any,
    rubric: Rubric,
    *,
    metric: str,
    max_new_tokens: int,
    k: int = 1,
    temperature: float = 1.0,
    stop: tuple[str, ...] = (),
) -> dict[str, float]:
    """Accuracy on `tasks`: the mean of reward component `metric` (a 0/1 verifier).

    k == 1: greedy decoding, `eval/accuracy` is pass@1. k > 1: k samples per task at `temperature`,
    `eval/accuracy` is mean@k (the expected accuracy of one sample) and `eval/pass@k` the share of
    tasks with at least one correct sample. Rollouts whose verifier raised count as wrong here and are
    reported in `eval/errors`.
    """
    if not tasks:
        raise ConfigError("no held-out tasks to evaluate (empty held-out split)")
    greedy = k == 1
    sampling = SamplingParams(
        n=k, temperature=0.0 if greedy else temperature, max_new_tokens=max_new_tokens, stop=stop
    )
    groups = rollout_groups(tasks, generator, tokenizer, sampling, rubric)
    trajectories = flatten(groups)
    values = [t.rewards.get(metric, 0.0) for t in trajectories]
    out = {
        "eval/accuracy": statistics.fmean(values),
        "eval/reward": statistics.fmean(t.reward for t in trajectories),
        "eval/mean_length": statistics.fmean(t.num_policy_tokens for t in trajectories),
        "eval/errors": float(sum(not t.usable for t in trajectories)),
        "eval/n": float(len(tasks)),
    }
    if not greedy:
        out["eval/pass@k"] = statistics.fmean(
            float(any(t.rewards.get(metric, 0.0) >= 1.0 for t in g.trajectories)) for g in groups
        )
    return out
