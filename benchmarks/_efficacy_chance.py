"""benchmarks/efficacy.py's chance column and solver ceiling: what an env's own policies score on a
row's held-out instances, with no model.

- chance: the family's `random_action` (a random LEGAL, well-formed action each turn: the policy the
  format warm-up clones) played `episodes` times per instance;
- ceiling: the family's `scripted_action` (its solver), once per instance (it is deterministic; a
  slippery lake still makes it fail sometimes).
Both are played exactly as the row's eval plays a model: through the real rollout engine
(rlvr.rollout.engine.rollout_groups) with the row's turn cap, token budget and tool format, each
action tokenized with the row's tokenizer and cut at `sampling.max_new_tokens` as a sampled turn
would be, the episode scored by the row's rubric, and each episode in its own group of one
(`episode_index` 0, the greedy eval's: a slippery lake slips as it does for the model).

A trained model "learns the task" only as far as it beats chance, so the table's gain over chance
and its interval come from here (`gain_over_chance`). Per-instance results are stored so any
interval can be recomputed: one JSONL object per row and policy, with every instance's successes.
"""

from __future__ import annotations

import hashlib
import importlib
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

# The policies' plumbing (the text policy as a generator, the env wrapped to hand the policy its
# conversation) is rlvr's env demos': the warm-up plays random_action through the same code.
# (It is moving from rlvr.envs to rlvr.authoring; either place works.)


def _module(name: str) -> Any:
    for package in ("rlvr.authoring", "rlvr.envs"):
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(f"rlvr's env {name} module")


def ids_sha(ids: list[str]) -> str:
    """A short fingerprint of a held-out set (its ids in order): tells whether two measurements
    scored the same instances."""
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]


def policy_scores(
    cfg: Any, config_dir: Path, n: int, policy: str, episodes: int, seed: int = 0
) -> dict[str, Any]:
    """Per-instance successes of the family's `random_action` ("random", `episodes` per instance) or
    `scripted_action` ("scripted", one) on the first `n` held-out instances. A family without such
    a policy gets a record marked `absent` (with the row's instances and tries all the same)."""
    from rlvr.build import rollout_limits
    from rlvr.envs.base import AnswerWithFeedbackEnv
    from rlvr.envs.tool_formats import resolve_tool_format
    from rlvr.models import load_tokenizer, resolve_model_path
    from rlvr.rollout.engine import rollout_groups
    from rlvr.rollout.generator import SamplingParams
    from rlvr.train.sources import Sources

    (source,) = list(Sources(cfg, config_dir))
    family = source.family
    assert family is not None, "an env row"
    tasks = source.splits.heldout[:n]
    limits = replace(rollout_limits(cfg), env_workers=1)
    env = family.make(tasks[0]) if tasks else None
    turn_cap = limits.max_turns or (env.max_turns if env is not None else 1)
    record: dict[str, Any] = {
        "policy": policy,
        "n": len(tasks),
        # a wrong answer gets feedback and another try: the row's pass@1 is "within the turn cap"
        "tries": turn_cap if isinstance(env, AnswerWithFeedbackEnv) and turn_cap > 1 else 1,
        "heldout_sha": ids_sha([t.id for t in tasks]),
    }
    if not callable(getattr(family, f"{policy}_action", None)):
        return {**record, "absent": True}
    demos, check = _module("demos"), _module("check")
    tokenizer = load_tokenizer(resolve_model_path(cfg.model.name))
    max_new = cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens
    sampling = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new)
    calls = resolve_tool_format(limits.tool_format, tokenizer)
    plays = episodes if policy == "random" else 1
    started = time.time()
    per_instance: list[dict[str, Any]] = []
    turns: list[int] = []
    for index, task in enumerate(tasks):
        successes = []
        for episode in range(plays):
            act = demos._policy(family, policy, seed, index * plays + episode, calls)
            recorder = check._Recorder(family.make(task))
            generator = check._PolicyGenerator(act, tokenizer, task, recorder)
            (group,) = rollout_groups(
                [task], lambda _t, r=recorder: r, generator, tokenizer, sampling,
                source.scoring, limits,
            )  # fmt: skip
            trajectory = group.trajectories[0]
            successes.append(float(trajectory.rewards.get(source.metric, 0.0) >= 1.0))
            turns.append(len(trajectory.turns))
        per_instance.append({"id": task.id, "successes": successes})
    means = [statistics.fmean(p["successes"]) for p in per_instance]
    return {
        **record,
        "episodes_per_instance": plays,
        "success": statistics.fmean(means) if means else 0.0,
        "turns": statistics.fmean(turns) if turns else 0.0,
        "seconds": time.time() - started,
        "per_instance": per_instance,
    }


def id_split_sha(cfg: Any, n: int) -> str | None:
    """The fingerprint of the held-out set the row had when env splits went by instance id alone
    (what every row measured before split keys scored): a row result without its own fingerprint
    was measured on it. None for a family with its own make_splits."""
    from rlvr.envs import get_env_family
    from rlvr.envs.base import EnvFamily, split_instances

    env = cfg.task.env
    family = get_env_family(env.name, env.options)
    if type(family).make_splits is not EnvFamily.make_splits:
        return None
    _, heldout = split_instances(
        family.generate, env.num_train, env.num_heldout, env.heldout_fraction
    )
    return ids_sha([t.id for t in heldout[:n]])


def bootstrap_gain(
    after: list[float], chance: list[float], paired: bool, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """95% percentile bootstrap interval of mean(after) - mean(chance) over instances.

    `chance` holds each instance's success rate under the random policy. Paired (the same resampled
    instances on both sides) when `after` is per instance in `chance`'s order; else the two sides
    are resampled independently (an old row stored only its pass count: for 0/1 outcomes the count
    is all an unpaired resample needs)."""
    rng = random.Random(seed)
    n, m = len(after), len(chance)
    diffs = []
    for _ in range(resamples):
        if paired:
            picks = [rng.randrange(n) for _ in range(n)]
            diffs.append(sum(after[i] - chance[i] for i in picks) / n)
        else:
            a = sum(after[rng.randrange(n)] for _ in range(n)) / n
            diffs.append(a - sum(chance[rng.randrange(m)] for _ in range(m)) / m)
    diffs.sort()
    return diffs[int(0.025 * resamples)], diffs[int(0.975 * resamples) - 1]


def gain_over_chance(result: dict[str, Any], chance: dict[str, Any]) -> tuple[float, float, float]:
    """(after - chance, 95% interval low, high) for a row result, paired per instance when the
    result stored its per-instance results on the same held-out set."""
    rates = [statistics.fmean(p["successes"]) for p in chance["per_instance"]]
    stored = result.get("per_instance") or {}
    if stored.get("ids") == [p["id"] for p in chance["per_instance"]]:
        after = list(stored["after"])
        paired = True
    else:
        passed = round(result["after"] * result["n"])
        after = [1.0] * passed + [0.0] * (result["n"] - passed)
        paired = False
    low, high = bootstrap_gain(after, rates, paired)
    return statistics.fmean(after) - statistics.fmean(rates), low, high
