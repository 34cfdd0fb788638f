"""Curricula (`curriculum:`): difficulty levels promoted on rolling train success, and mixture
weights on a schedule (docs/curriculum.md is the user's view).

Levels. `curriculum.levels` is a list of env option overrides, easiest first, each applied over
`task.env.options` of one source (`curriculum.source`, default the only one). Every step, the
success of that source's sampled episodes (the mean of reward component `curriculum.metric`, or of
the weighted total with `reward`; default the source's eval metric) is one value of the level's
history; a step where the source drew no usable episode adds none. After a step the run moves to
the next level when

    steps counted at this level >= min_steps_per_level (default: window)  and
    mean(the last `window` values at this level) >= threshold

(`advance` is that rule on one step, `level_history` the rule over a whole history: both pure).
The count and the window start afresh at each level; the last level is never left.

A new level rebuilds the source (`Sources.with_env_options`): its env family with the new options,
its train tasks, and a sampler at their start. Held-out tasks are the final level's whatever the
level (`eval_level: final`, the default: `eval/accuracy` is one fixed task set from the base eval to
the end, at the target difficulty), or follow the level (`current`). Train and held-out never
overlap: instances are split by a hash of their id, so an instance is held out at every level or at
none; each level's train tasks are checked against the held-out ones when it is built.

Schedule. `curriculum.schedule` = [{step, weights}]: from `step` on the named mixture components
are drawn with those weights (unnamed ones keep their `mixture` weight); a pure function of the step.

Logged every step: `curriculum/level` (index into `levels` of the level the step's tasks came
from), `curriculum/success` (the rolling success after the step, the number held against the
threshold), and `curriculum/weight/<source>` under a schedule. A promotion adds an event row after
the step's metrics, as monitor alerts do: {"event": "curriculum/promoted", "action": "promote",
"message", "evidence": {"from_level", "to_level", "success", "steps_at_level"}}.

Resume: the level, the steps counted at it and its window are in the checkpoint (state.json
"curriculum"); `load_state_dict` rebuilds the source at that level before the loop restores the
samplers' positions, so a resumed run draws exactly the tasks an uninterrupted one would. Building
a level never moves the run's global RNGs (an env's `generate` that used them would otherwise make
a resumed run differ from an uninterrupted one).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError

from rlvr.config import RunConfig
from rlvr.errors import ConfigError
from rlvr.records import Trajectory
from rlvr.tasks import TaskSplits
from rlvr.train.sources import Sources

PROMOTED = "curriculum/promoted"


# ------------------------------------------------------------------------------ the rule (pure)
@dataclass(frozen=True)
class PromotionRule:
    num_levels: int
    threshold: float
    window: int
    min_steps: int


@dataclass(frozen=True)
class LevelState:
    level: int = 0
    steps: int = 0  # steps counted at this level
    recent: tuple[float, ...] = ()  # their last `window` successes


def advance(
    state: LevelState, value: float | None, rule: PromotionRule
) -> tuple[LevelState, bool, float]:
    """One step whose success was `value` (None or NaN: nothing to count). Returns the state for the
    next step, whether this step promoted, and the rolling success after it (NaN when none)."""
    if value is None or not math.isfinite(value):
        return state, False, statistics.fmean(state.recent) if state.recent else math.nan
    recent = (*state.recent, float(value))[-rule.window :]
    success = statistics.fmean(recent)
    counted = LevelState(state.level, state.steps + 1, recent)
    if (
        state.level + 1 < rule.num_levels
        and counted.steps >= rule.min_steps
        and success >= rule.threshold
    ):
        return LevelState(state.level + 1), True, success
    return counted, False, success


def level_history(values: Sequence[float | None], rule: PromotionRule) -> list[int]:
    """The level each step was played at, given every step's success (step 1 first)."""
    state, levels = LevelState(), []
    for value in values:
        levels.append(state.level)
        state, _, _ = advance(state, value, rule)
    return levels


# ------------------------------------------------------------------------------ in the run
@contextmanager
def _rng_untouched() -> Iterator[None]:
    py, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(py)
    np.random.set_state(np_state)


class Curriculum:
    """The run's curriculum (inactive without levels and schedule): see the module docstring.

    The loop calls `before_step(step)` before sampling, `after_step(step, trajectories, metrics)`
    after the step's metrics (it adds the curriculum keys and returns the promotion event rows to
    log), and saves `state_dict()` / restores `load_state_dict(...)` with the checkpoint."""

    def __init__(self, cfg: RunConfig, sources: Sources, tasks: TaskSplits | None = None) -> None:
        c = cfg.curriculum
        self.sources = sources
        self.schedule = list(c.schedule)
        self.configured_weights = {m.name: m.weight for m in cfg.components()}
        self.state = LevelState()
        self.levels: list[dict[str, Any]] = []
        if not c.levels:
            return
        if tasks is not None:
            raise ConfigError(
                "curriculum.levels rebuilds an env's tasks; train(tasks=...) fixes them"
            )
        self.name = c.source or next(iter(sources)).name
        component = next(m for m in cfg.components() if m.name == self.name)
        assert component.task.env is not None  # the config's validator checked it is an env
        self.levels = [
            level_options(sources.by_name[self.name].family, component.task.env.options, i, over)
            for i, over in enumerate(c.levels)
        ]
        source = sources.by_name[self.name]
        self.metric = c.metric or source.metric
        if self.metric != "reward" and self.metric not in source.reward_names:
            raise ConfigError(
                f"curriculum.metric '{self.metric}' is not a reward component of source "
                f"'{self.name}' (components: {', '.join(source.reward_names)}, or 'reward')"
            )
        self.rule = PromotionRule(
            len(self.levels), c.threshold, c.window, c.min_steps_per_level or c.window
        )
        self.final_heldout = None
        if c.eval_level == "final":
            with _rng_untouched():
                final = sources.with_env_options(self.name, self.levels[-1])
            self.final_heldout = final.splits.heldout
        self._build(0)

    @property
    def active(self) -> bool:
        return bool(self.levels or self.schedule)

    def _build(self, level: int) -> None:
        """Make source `name` play `level`: new tasks, a sampler at their start, its weight kept."""
        with _rng_untouched():
            new = self.sources.with_env_options(self.name, self.levels[level])
        heldout = self.final_heldout if self.final_heldout is not None else new.splits.heldout
        shared = {t.id for t in new.splits.train} & {t.id for t in heldout}
        if shared:
            raise ConfigError(
                f"curriculum level {level}: {len(shared)} train tasks are also held out "
                f"(e.g. {sorted(shared)[0]!r}); the env's make_splits must split by instance id"
            )
        new.splits = TaskSplits(train=new.splits.train, heldout=heldout)
        new.weight = self.sources.by_name[self.name].weight
        self.sources.by_name[self.name] = new

    def before_step(self, step: int) -> None:
        """Set the mixture weights the schedule gives `step`."""
        if not self.schedule:
            return
        weights = dict(self.configured_weights)
        for entry in self.schedule:
            if entry.step <= step:
                weights = {**self.configured_weights, **entry.weights}
        for name, source in self.sources.by_name.items():
            source.weight = weights[name]

    def success(self, trajectories: Sequence[Trajectory]) -> float | None:
        """This step's success: the metric's mean over the source's usable episodes."""
        values = [
            t.reward if self.metric == "reward" else t.rewards[self.metric]
            for t in trajectories
            if t.source == self.name
            and t.usable
            and (self.metric == "reward" or self.metric in t.rewards)
        ]
        return statistics.fmean(values) if values else None

    def after_step(
        self, step: int, trajectories: Sequence[Trajectory], metrics: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """Add this step's curriculum metrics to `metrics`; promote when the rule says so (the
        next step plays the new level). Returns the event rows to log after the step's metrics."""
        if self.schedule:
            metrics.update(
                {f"curriculum/weight/{n}": s.weight for n, s in self.sources.by_name.items()}
            )
        if not self.levels:
            return []
        before = self.state
        self.state, promoted, success = advance(before, self.success(trajectories), self.rule)
        metrics["curriculum/level"] = before.level
        metrics["curriculum/success"] = success
        if not promoted:
            return []
        self._build(self.state.level)
        steps = before.steps + 1
        return [
            {
                "event": PROMOTED,
                "action": "promote",
                "message": f"curriculum: level {before.level} -> {self.state.level} "
                f"({self.levels[self.state.level]}) after step {step}: rolling {self.metric} "
                f"{success:.3g} >= {self.rule.threshold:g} over the last "
                f"{min(steps, self.rule.window)} of {steps} steps at level {before.level}",
                "evidence": {
                    "from_level": before.level,
                    "to_level": self.state.level,
                    "success": success,
                    "steps_at_level": steps,
                },
            }
        ]

    def state_dict(self) -> dict[str, Any]:
        s = self.state
        return {"level": s.level, "steps": s.steps, "recent": list(s.recent)}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Restore the level and its window, rebuilding the source at that level (call before the
        samplers' positions are restored)."""
        if not self.levels or not state:
            return
        level = int(state["level"])
        if not 0 <= level < len(self.levels):
            raise ConfigError(
                f"the checkpoint is at curriculum level {level}; this config has "
                f"{len(self.levels)} levels"
            )
        self.state = LevelState(
            level, int(state["steps"]), tuple(float(v) for v in state["recent"])
        )
        if level != 0:
            self._build(level)


def level_options(
    family: Any, base: Mapping[str, Any], index: int, overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """`overrides` over `base`, checked against the family's options model (one-line errors)."""
    options_model = type(family).Options
    known = list(options_model.model_fields)
    for key in overrides:
        if key not in known:
            raise ConfigError(
                f"curriculum.levels.{index}: '{key}' is not an option of env '{family.name}' "
                f"(options: {', '.join(known) or 'none'})"
            )
    merged = {**base, **overrides}
    try:
        options_model.model_validate(merged)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(
            f"curriculum.levels.{index}.{where}: {first['msg']} (got {first.get('input')!r}; "
            f"env '{family.name}')"
        ) from None
    return merged
