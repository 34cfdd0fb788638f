"""Where a run's tasks come from: one task set or env, or a weighted mixture of them.

Each source (a `MixtureComponent` of the config; a plain config is one source named "main") has its
own train/held-out split, its own rubric, and its own env: a built-in family for `task.source: env`,
otherwise the one-step `SingleTurnEnv`. Tasks carry their source's name (`Task.source`), so the
engine asks the right env and rubric for each, and metrics can be split by source.

The mixture draws each prompt's source with the configured weights from a seeded RNG whose state,
like each source's sampler position, is checkpointed.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlvr.build import build_rubric
from rlvr.config import MixtureComponent, RewardSpec, RunConfig, TaskConfig
from rlvr.envs import Env, EnvFamily, SingleTurnEnv, get_env_family
from rlvr.errors import ConfigError
from rlvr.records import Task
from rlvr.rollout.engine import Scoring
from rlvr.sandbox.client import configure as configure_sandbox
from rlvr.tasks import TaskSampler, TaskSplits, load_tasks


@dataclass
class Source:
    name: str
    weight: float
    splits: TaskSplits
    scoring: Scoring
    family: EnvFamily | None
    metric: str  # the reward component read as accuracy on held-out tasks
    sampler: TaskSampler

    def make_env(self, task: Task) -> Env:
        return self.family.make(task) if self.family is not None else SingleTurnEnv(task)

    @property
    def reward_names(self) -> list[str]:
        rubric = list(self.scoring.rubric.names) if self.scoring.rubric else []
        return rubric + [n for n in self.scoring.env_weights if n not in rubric]


def _build_source(
    component: MixtureComponent,
    cfg: RunConfig,
    config_dir: Path | None,
    tasks: TaskSplits | None,
) -> Source:
    family = None
    env_weights: dict[str, float] = {}
    if component.task.source == "env":
        assert component.task.env is not None
        family = get_env_family(component.task.env.name, component.task.env.options)
        env_weights = {**family.reward_weights, **component.task.env.reward_weights}
        env_weights.setdefault(family.success_metric, 1.0)
    splits = tasks if tasks is not None else load_tasks(component.task)
    splits = TaskSplits(
        train=[dataclasses.replace(t, source=component.name) for t in splits.train],
        heldout=[dataclasses.replace(t, source=component.name) for t in splits.heldout],
    )
    rubric = build_rubric(component.rewards, base_dir=config_dir) if component.rewards else None
    if rubric is not None:  # a parameter no task can fill fails here, before any model loads
        rubric.check_tasks([*splits.train, *splits.heldout])
    names = list(rubric.names if rubric else []) + list(env_weights)
    external = cfg.rollout.mode == "external"
    # An external agent's own reward parts are known only once it returns: default "agent".
    fallback = names[0] if names else "agent"
    metric = cfg.eval.metric or (family.success_metric if family else fallback)
    if metric not in names and not external:
        raise ConfigError(
            f"eval.metric '{metric}' is not a reward component of source '{component.name}' "
            f"(components: {', '.join(names)})"
        )
    return Source(
        name=component.name,
        weight=component.weight,
        splits=splits,
        scoring=Scoring(rubric=rubric, env_weights=env_weights),
        family=family,
        metric=metric,
        sampler=TaskSampler(splits.train, seed=cfg.train.seed),
    )


class Sources:
    """All sources of a run, the mixture draw, and per-task dispatch of env and scoring."""

    def __init__(
        self, cfg: RunConfig, config_dir: Path | None = None, tasks: TaskSplits | None = None
    ) -> None:
        components = cfg.components()
        if tasks is not None and len(components) > 1:
            raise ConfigError("train(tasks=...) replaces a single task source, not a mixture")
        # Code runs here or on the sandbox service of `sandbox.url` (in this process and, through
        # the environment, in Ray workers and other children).
        sandbox = cfg.sandbox
        configure_sandbox(sandbox.url, sandbox.api, sandbox.api_key, sandbox.timeout_seconds)
        self.by_name: dict[str, Source] = {
            c.name: _build_source(c, cfg, config_dir, tasks) for c in components
        }
        self.rng = random.Random(f"mixture:{cfg.train.seed}")
        self.cfg, self.config_dir = cfg, config_dir  # to rebuild a source (a curriculum level)

    def with_env_options(self, name: str, options: Mapping[str, Any]) -> Source:
        """Source `name` as it is built with these env options (a curriculum level): its family,
        train and held-out tasks, and a sampler at their start. The run's sources are unchanged."""
        component = next(c for c in self.cfg.components() if c.name == name)
        assert component.task.env is not None
        env = component.task.env.model_copy(update={"options": dict(options)})
        task = component.task.model_copy(update={"env": env})
        return _build_source(
            component.model_copy(update={"task": task}), self.cfg, self.config_dir, None
        )

    @property
    def is_mixture(self) -> bool:
        return len(self.by_name) > 1

    def __iter__(self) -> Any:
        return iter(self.by_name.values())

    def of(self, task: Task) -> Source:
        return self.by_name[task.source]

    def make_env(self, task: Task) -> Env:
        return self.of(task).make_env(task)

    def scoring(self, task: Task) -> Scoring:
        return self.of(task).scoring

    def next_batch(self, n: int) -> list[Task]:
        """n tasks; with a mixture each one's source is drawn by weight."""
        sources = list(self.by_name.values())
        if len(sources) == 1:
            return sources[0].sampler.next_batch(n)
        picks = self.rng.choices(sources, weights=[s.weight for s in sources], k=n)
        return [s.sampler.next_batch(1)[0] for s in picks]

    @property
    def reward_names(self) -> list[str]:
        names: list[str] = []
        for s in self:
            names += [n for n in s.reward_names if n not in names]
        return names

    @property
    def reward_weights(self) -> dict[str, float]:
        """Weight of every reward component across sources (rubric functions and env parts)."""
        weights: dict[str, float] = {}
        for s in self:
            weights.update(s.scoring.env_weights)
            if s.scoring.rubric is not None:
                weights.update(s.scoring.rubric.weights)
        return weights

    @property
    def unverifiable(self) -> set[str]:
        """Components whose function is not a verifier (an LLM judge)."""
        from rlvr.verifiers.judge import is_verifiable

        return {
            f.name
            for s in self
            if s.scoring.rubric is not None
            for f in s.scoring.rubric.functions
            if not is_verifiable(f.fn)
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "samplers": {name: s.sampler.state_dict() for name, s in self.by_name.items()},
            "mixture_rng": self.rng.getstate(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "samplers" not in state:  # a checkpoint from before mixtures: one sampler
            next(iter(self)).sampler.load_state_dict(dict(state))
            return
        for name, sampler_state in state["samplers"].items():
            if name in self.by_name:
                self.by_name[name].sampler.load_state_dict(sampler_state)
        rng_state = state["mixture_rng"]
        self.rng.setstate((rng_state[0], tuple(rng_state[1]), rng_state[2]))


def absolutize_reward_files(cfg: RunConfig, config_dir: Path | None) -> RunConfig:
    """Resolve relative paths in the config against the config's folder and make them absolute:
    'file.py:function' rewards and external agent, 'file.py:Family' envs and dataset files, in the
    main task and in every mixture component. The run's saved config then works from anywhere."""
    base = config_dir or Path.cwd()

    def fix_spec(spec: str) -> str:
        file_part, sep, attr = spec.rpartition(":")
        if sep and file_part.endswith(".py") and not Path(file_part).is_absolute():
            return f"{(base / file_part).resolve()}:{attr}"
        return spec

    def fix_task(task: TaskConfig) -> TaskConfig:
        if task.dataset is not None:
            updates = {}
            for key in ("path", "heldout_path"):
                value = getattr(task.dataset, key)
                if value and not Path(value).is_absolute() and (base / value).exists():
                    updates[key] = str((base / value).resolve())
            if updates:
                task = task.model_copy(update={"dataset": task.dataset.model_copy(update=updates)})
        if task.env is not None and fix_spec(task.env.name) != task.env.name:
            env = task.env.model_copy(update={"name": fix_spec(task.env.name)})
            task = task.model_copy(update={"env": env})
        return task

    def fix_rewards(rewards: list[RewardSpec]) -> list[RewardSpec]:
        return [r.model_copy(update={"fn": fix_spec(r.fn)}) for r in rewards]

    mixture = [
        c.model_copy(update={"task": fix_task(c.task), "rewards": fix_rewards(c.rewards)})
        for c in cfg.mixture
    ]
    external = cfg.external
    if external.agent is not None:
        external = external.model_copy(update={"agent": fix_spec(external.agent)})
    return cfg.model_copy(
        update={
            "task": fix_task(cfg.task),
            "rewards": fix_rewards(cfg.rewards),
            "mixture": mixture,
            "external": external,
        }
    )
