"""Held-out evaluation: greedy pass@1 and sampled mean@k, scored as in training (same env, same rubric)."""

from __future__ import annotations

import dataclasses
import statistics
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlvr.envs import SingleTurnEnv
from rlvr.errors import ConfigError, RewardError
from rlvr.records import Task, Trajectory, flatten
from rlvr.rollout.engine import EnvFactory, RolloutLimits, Scoring, rollout_groups
from rlvr.rollout.generator import Generator, SamplingParams

if TYPE_CHECKING:
    from rlvr.train.sources import Sources

# A rollout's `reward_errors` name what failed: a rubric function by its name, or one of these,
# which are not rewards (the engine's env failures, an external agent's failures).
NOT_REWARDS = ("env", "agent")
ERROR_KINDS = ("reward", "env", "tool")


def failure_kind(component: str) -> str:
    """'env' / 'agent' for those failures, 'reward' for a rubric function that raised."""
    return component if component in NOT_REWARDS else "reward"


def describe_failure(trajectory: Trajectory) -> str:
    """One line naming what failed in `trajectory` and how: `reward 'correct' on task T: ...` or
    `the env on task T: ...`."""
    errors = dict(trajectory.info.get("reward_errors", {}))
    name, message = next(iter(sorted(errors.items())), ("?", "?"))
    what = f"reward '{name}'" if failure_kind(name) == "reward" else f"the {name}"
    return f"{what} failed on task {trajectory.task_id}: {message}"


def failure_counts(trajectories: Sequence[Trajectory]) -> str:
    """What failed in these rollouts, e.g. `3 reward errors, 1 env error` (a rollout may count
    under two kinds)."""
    kinds = [
        failure_kind(n) for t in trajectories for n in {failure_kind(e) for e in t.reward_errors}
    ]
    return ", ".join(
        f"{kinds.count(kind)} {kind} error{'s' if kinds.count(kind) != 1 else ''}"
        for kind in ("reward", *NOT_REWARDS)
        if kind in kinds
    )


def error_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """eval/errors (rollouts that could not be scored), split by what failed: eval/errors/reward,
    eval/errors/env; eval/errors/tool counts failed tool calls (the model saw an error message,
    the rollout itself was scored); eval/rollouts is how many rollouts there were."""
    kinds = [{failure_kind(n) for n in t.reward_errors} for t in trajectories]
    return {
        "eval/errors": float(sum(bool(k) for k in kinds)),
        "eval/errors/reward": float(sum("reward" in k for k in kinds)),
        "eval/errors/env": float(sum("env" in k for k in kinds)),
        "eval/errors/tool": float(sum(t.info.get("tool_failures", 0) for t in trajectories)),
        "eval/rollouts": float(len(trajectories)),
    }


def describe_errors(ev: Mapping[str, float]) -> str | None:
    """`3/20 rollouts errored (2 reward, 1 env); 4 tool calls failed`, or None when nothing did."""
    failed, total = int(ev.get("eval/errors", 0)), int(ev.get("eval/rollouts", 0))
    tools = int(ev.get("eval/errors/tool", 0))
    if not failed and not tools:
        return None
    parts = []
    if failed:
        parts.append(f"{failed}/{total or '?'} rollouts errored ({_kinds(ev)})")
    if tools:
        parts.append(f"{tools} tool call{'s' if tools != 1 else ''} failed")
    return "; ".join(parts)


def _kinds(ev: Mapping[str, float]) -> str:
    split = ", ".join(
        f"{int(ev.get(f'eval/errors/{kind}', 0))} {kind}"
        for kind in ERROR_KINDS[:2]
        if ev.get(f"eval/errors/{kind}", 0)
    )
    return split or "agent"


def all_failed(ev: Mapping[str, float]) -> bool:
    total = ev.get("eval/rollouts", 0)
    return bool(total) and ev.get("eval/errors", 0) >= total


def check_error_fraction(trajectories: Sequence[Trajectory], step: int, limit: float) -> None:
    """Stop a run whose step could not score more than `limit` of its rollouts (never train on
    silent zeros); the error names what failed (reward, env, agent) and one example."""
    failed = [t for t in trajectories if t.reward_errors]
    if not failed or len(failed) / len(trajectories) <= limit:
        return
    raise RewardError(
        f"step {step}: {len(failed)}/{len(trajectories)} rollouts could not be scored "
        f"({failure_counts(failed)}), above train.max_reward_error_fraction={limit}; "
        f"e.g. {describe_failure(failed[0])}"
    )


def check_eval_errors(
    ev: Mapping[str, float], failures: Sequence[str], when: str, console: Any
) -> None:
    """Print a warning line on `console` (None: print nothing) when rollouts of eval `ev` failed;
    stop when all of them did."""
    from rich.markup import escape

    errored = describe_errors(ev)
    if errored and console is not None:
        example = f"; e.g. {failures[0]}" if failures else ""
        console.print(f"[bold yellow]{when}[/]: {escape(errored + example)}", soft_wrap=True)
    refuse_if_all_failed(ev, failures, when)


def refuse_if_all_failed(ev: Mapping[str, float], failures: Sequence[str], when: str) -> None:
    """Every held-out rollout failed: its 0% measures the failure, not the model. Say so and stop."""
    if all_failed(ev):
        example = f"; e.g. {failures[0]}" if failures else ""
        raise RewardError(
            f"{when}: all {int(ev['eval/rollouts'])} held-out rollouts failed ({_kinds(ev)}), "
            f"so its 0% would measure the failures, not the model{example}"
        )


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
    failures: list[str] | None = None,
) -> dict[str, float]:
    """Accuracy on `tasks`: the mean of reward component `metric` (a 0/1 verifier).

    k == 1: greedy decoding, `eval/accuracy` is pass@1. k > 1: k samples per task at `temperature`,
    `eval/accuracy` is mean@k (the expected accuracy of one sample) and `eval/pass@k` the share of
    tasks with at least one correct sample. Rollouts whose verifier (or env) raised count as wrong
    here and are reported in `eval/errors` and split by kind (`error_metrics`); `failures`, when
    given, receives one line per failed rollout (`describe_failure`). `make_env` None plays each
    task as one turn.
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
    if failures is not None:
        failures.extend(describe_failure(t) for t in trajectories if t.reward_errors)
    # A TRL-style metric that returned None ("not applicable") on a rollout: out of the mean, as
    # TRL's nanmean leaves it; a failure (error) still counts as wrong.
    applicable = [t for t in trajectories if metric not in t.info.get("not_applicable", ())]
    values = [t.rewards.get(metric, 0.0) for t in applicable]
    out = {
        "eval/accuracy": statistics.fmean(values) if values else 0.0,
        "eval/reward": statistics.fmean(t.reward for t in trajectories),
        "eval/mean_length": statistics.fmean(t.num_policy_tokens for t in trajectories),
        **error_metrics(trajectories),
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
    failures: list[str] | None = None,
) -> dict[str, float]:
    """Held-out eval of every source of a run (first `n` held-out tasks each). A mixture reports
    eval/<source>/... per source, `eval/accuracy` as the unweighted mean over sources and the
    error counts summed over them."""
    out: dict[str, float] = {}
    accuracies = []
    totals: dict[str, float] = {}
    for source in sources:
        if n > len(source.splits.heldout):
            where = f"source '{source.name}'" if sources.is_mixture else "the task"
            warnings.warn(
                f"eval.n={n} but {where} has {len(source.splits.heldout)} held-out tasks: "
                f"evaluating those {len(source.splits.heldout)}",
                stacklevel=2,
            )
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
            failures=failures,
        )
        accuracies.append(ev["eval/accuracy"])
        for key in error_metrics([]):
            totals[key] = totals.get(key, 0.0) + ev[key]
        if sources.is_mixture:
            out.update(
                {key.replace("eval/", f"eval/{source.name}/", 1): v for key, v in ev.items()}
            )
        else:
            out.update(ev)
    if sources.is_mixture:
        out["eval/accuracy"] = statistics.fmean(accuracies)
        out.update(totals)
    return out
