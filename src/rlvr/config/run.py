"""`RunConfig`: every section together, the single source of a run's settings, and the checks across sections."""

from __future__ import annotations

from typing import Any

from pydantic import (
    Field,
    ValidationInfo,
    model_validator,
)

from rlvr.config.base import _Section, bf16_sampling_copy
from rlvr.config.model import ModelConfig
from rlvr.config.monitors import MonitorsConfig
from rlvr.config.objective import CriticConfig, DistillConfig, ObjectiveConfig
from rlvr.config.rollout import (
    DistributedConfig,
    ExternalConfig,
    FilterConfig,
    GeneratorConfig,
    RolloutConfig,
    SamplingConfig,
)
from rlvr.config.tasks import (
    CurriculumConfig,
    MixtureComponent,
    RewardSpec,
    TaskConfig,
    _default_rewards,
)
from rlvr.config.training import (
    LORA_LR,
    CheckpointConfig,
    EvalConfig,
    SandboxConfig,
    TrackingConfig,
    TrainConfig,
    WatchdogConfig,
)
from rlvr.errors import ConfigError
from rlvr.registry import ALGORITHMS as ALGORITHM_REGISTRY
from rlvr.registry import TRACKERS as TRACKER_REGISTRY
from rlvr.registry import Registry, absolute_ref


def _resolve_extension(registry: Registry[Any], ref: str, config_dir: Any) -> tuple[str, Any]:
    """(`ref` with a relative file made absolute against the config's folder, what it names).

    Asked of rlvr.registry, which lists no names here: a built-in, a file, a module or an installed
    plug-in. An unknown name is a ValueError whose one line names the field and the known names."""
    ref = absolute_ref(ref, config_dir)
    try:
        return ref, registry.resolve(ref)
    except ConfigError as err:
        raise ValueError(str(err)) from None


def _merge_under(defaults: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """`data` over `defaults`, recursively for sections; `data` is not modified."""
    merged = dict(defaults)
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge_under(merged[key], value)
        else:
            merged[key] = value
    return merged


class RunConfig(_Section):
    algorithm: str = Field(
        "grpo",
        description="Chooses advantage function, loss and their defaults: a built-in (grpo, "
        "dr_grpo, dapo, gspo, cispo, rloo, reinforce_pp, reinforce_pp_baseline, ppo, distill), "
        "'file.py:NAME', 'package.module:NAME' or an installed plug-in (docs/extending.md).",
    )
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(fn="numeric_match", name="correct")],
        description="Rubric functions; default numeric_match for plain tasks, none for envs.",
    )
    mixture: list[MixtureComponent] = Field(
        default_factory=list,
        description="Several task sets / envs in one run, each with its rubric; replaces task and rewards.",
    )
    sampling: SamplingConfig = SamplingConfig()
    rollout: RolloutConfig = RolloutConfig()
    generator: GeneratorConfig = GeneratorConfig()
    distributed: DistributedConfig = DistributedConfig()
    external: ExternalConfig = ExternalConfig()
    filter: FilterConfig = FilterConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    critic: CriticConfig = CriticConfig()
    distill: DistillConfig = DistillConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    tracking: TrackingConfig = TrackingConfig()
    monitors: MonitorsConfig = MonitorsConfig()
    watchdog: WatchdogConfig = WatchdogConfig()
    curriculum: CurriculumConfig = CurriculumConfig()
    sandbox: SandboxConfig = SandboxConfig()
    output_dir: str = Field(
        "runs/latest",
        description="RUN_DIR: metrics, checkpoints, config. A relative path is taken from the "
        "working directory rather than the config file's folder (unlike the reward, env and data "
        "files a config names), so `rlvr train examples/x.yaml` writes runs/ where you run it.",
    )

    @model_validator(mode="before")
    @classmethod
    def _rewards_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and "rewards" not in data and not data.get("mixture"):
            data = {**data, "rewards": _default_rewards(data.get("task", {}))}
        return data

    @model_validator(mode="before")
    @classmethod
    def _extensions(cls, data: Any, info: ValidationInfo) -> Any:
        """The algorithm's defaults merged under the config, and the algorithm and trackers named
        as the registry finds them (a relative file made absolute: the saved config works from
        anywhere). `load_config` passes the config file's folder as `config_dir`."""
        if not isinstance(data, dict):
            return data
        config_dir = (info.context or {}).get("config_dir")
        name = data.get("algorithm", "grpo")
        if isinstance(name, str):  # anything else is left to the field's own type error
            ref, algorithm = _resolve_extension(ALGORITHM_REGISTRY, name, config_dir)
            data = _merge_under(dict(algorithm.defaults), {**data, "algorithm": ref})
        tracking = data.get("tracking")
        report_to = tracking.get("report_to") if isinstance(tracking, dict) else None
        if isinstance(report_to, list | str) and report_to != "none":
            names = [report_to] if isinstance(report_to, str) else report_to
            refs = [
                _resolve_extension(TRACKER_REGISTRY, n, config_dir)[0] if isinstance(n, str) else n
                for n in names
            ]
            data = {**data, "tracking": {**tracking, "report_to": refs}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _lora_learning_rate(cls, data: Any) -> Any:
        """LoRA's own default learning rate (LORA_LR) when the config gives none."""
        if not isinstance(data, dict):
            return data
        model, train = data.get("model") or {}, data.get("train") or {}
        lora = model.get("lora") if isinstance(model, dict) else None
        enabled = lora.get("enabled") if isinstance(lora, dict) else getattr(lora, "enabled", None)
        if enabled is True and isinstance(train, dict) and "learning_rate" not in train:
            data = {**data, "train": {**train, "learning_rate": LORA_LR}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _tis_on_when_off_engine(cls, data: Any) -> Any:
        """Truncated importance sampling (cap 2.0, Yao et al. 2025) unless the user set tis_cap: on
        when another engine (a server, vLLM in process), older weights (async rollouts) or a bf16
        copy of the weights (decode: fast, `bf16_sampling_copy`) sample the tokens."""
        if not isinstance(data, dict):
            return data
        gen, rollout = data.get("generator") or {}, data.get("rollout") or {}
        objective, model = data.get("objective") or {}, data.get("model") or {}
        off_engine = isinstance(gen, dict) and gen.get("backend") in ("server", "vllm_colocate")
        stale = isinstance(rollout, dict) and bool(rollout.get("async_rollouts"))
        bf16_copy = isinstance(gen, dict) and bf16_sampling_copy(
            gen.get("backend"),
            gen.get("decode", GeneratorConfig.model_fields["decode"].default),
            gen.get("decode_dtype", GeneratorConfig.model_fields["decode_dtype"].default),
            model.get("bf16", ModelConfig.model_fields["bf16"].default)
            if isinstance(model, dict)
            else None,
            model.get("device", "auto") if isinstance(model, dict) else "auto",
        )
        # A correction named by the user that truncates or masks at the cap gets the cap too.
        correction = objective.get("off_policy_correction") if isinstance(objective, dict) else None
        capped = isinstance(correction, str) and correction.startswith(("tis_", "mis_"))
        if (
            (off_engine or stale or bf16_copy or capped)
            and isinstance(objective, dict)
            and "tis_cap" not in objective
        ):
            data = {**data, "objective": {**objective, "tis_cap": 2.0}}
        return data

    @model_validator(mode="after")
    def _check_sources(self) -> RunConfig:
        if self.model.lora.dropout > 0:
            # The RL update turns dropout off (rlvr.train.batch.disable_dropout): the policy it
            # optimises is the one that sampled, without dropout. Say so rather than ignore it.
            raise ValueError(
                f"model.lora.dropout={self.model.lora.dropout:g} is not used by RL updates (dropout "
                "is off so the trained policy is the one that sampled); set it to 0"
            )
        components = self.components()
        for c in components:
            names = [r.name or r.fn.rsplit(":", 1)[-1] for r in c.rewards]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"reward names must be unique; repeated: {', '.join(dupes)}")
            # An external agent may score its own rollouts (its returned reward parts).
            if not c.rewards and c.task.source != "env" and self.rollout.mode != "external":
                raise ValueError(
                    f"{'mixture ' + c.name + ': ' if self.mixture else ''}rewards is empty; "
                    "a task without an env needs at least one reward function"
                )
        f = self.filter
        if f.dynamic_sampling and f.group_filter == "none" and not f.drop_zero_std:
            raise ValueError(
                "filter.dynamic_sampling needs something to filter: set filter.drop_zero_std "
                "or filter.group_filter"
            )
        obj = self.objective
        if obj.kl_estimator == "k1" and not obj.kl_in_reward:
            # Checked whatever beta is: a monitor's `mitigate` action may raise it during the run.
            raise ValueError(
                "objective.kl_estimator k1 in the loss has zero expected gradient "
                "(E[grad log pi] = 0), so beta would never pull towards the reference: use k2 "
                "(exact reverse-KL gradient on-policy) or k3 (follows KL(ref || pi)), or set "
                "objective.kl_in_reward: true"
            )
        algorithm = ALGORITHM_REGISTRY.resolve(self.algorithm)
        if algorithm.token_credit == "gae" and obj.credit != "trajectory":
            raise ValueError(
                f"objective.credit is not used by {algorithm.name}: GAE assigns credit per token "
                "from the critic (turn rewards land on each turn's last token)"
            )
        if obj.credit == "turn" and not algorithm.group_relative:
            raise ValueError(
                f"objective.credit turn replaces the outcome advantage with group-relative turn "
                f"returns, so {self.algorithm}'s estimator would be unused: use credit bi-level "
                f"({self.algorithm}'s advantage plus the turn term) or trajectory"
            )
        if obj.credit == "gigpo" and not algorithm.group_relative:
            raise ValueError(
                f"objective.credit gigpo adds group-relative step advantages (anchor states) to a "
                f"group-relative episode advantage; {self.algorithm}'s is not: use grpo, dr_grpo, "
                "dapo, gspo or cispo, or credit bi-level"
            )
        if (
            algorithm.token_credit == "reward_to_go"
            and obj.kl_in_reward
            and obj.credit != "trajectory"
        ):
            raise ValueError(
                f"{algorithm.name} with the KL in the reward assigns credit per token (reward-to-go, "
                "each turn's reward on its last token): objective.credit must be trajectory"
            )
        if algorithm.needs_teacher and self.distill.teacher is None:
            raise ValueError(
                f"algorithm '{algorithm.name}' needs distill.teacher (a model alias or directory)"
            )
        if self.rollout.mode == "external" and (self.external.agent is None) == (
            self.external.command is None
        ):
            raise ValueError(
                "rollout: external needs exactly one of external.agent ('file.py:function') and "
                "external.command (a program)"
            )
        gen = self.generator
        if gen.backend == "server" and (gen.url is None) == (gen.launch is None):
            raise ValueError(
                "generator.backend: server needs exactly one of generator.url, generator.launch"
            )
        if gen.backend == "vllm_colocate" and (gen.url is not None or gen.launch is not None):
            raise ValueError(
                "generator.backend: vllm_colocate runs vLLM in the trainer's process: drop "
                "generator.url / generator.launch (they are for backend: server)"
            )
        if self.rollout.async_rollouts and (
            self.rollout.mode == "external" or gen.other_engine() or self.distributed.ray
        ):
            raise ValueError(
                "rollout.async_rollouts samples on an in-process copy of the policy: use it with "
                "rollout.mode internal, generator.backend hf and without distributed.ray"
            )
        if self.model.precision == "lean" and self.distributed.strategy == "fsdp":
            raise ValueError(
                "model.precision: lean is for one device (its optimizer is not sharded): use "
                "distributed.strategy: ddp, or fsdp with model.precision: mixed"
            )
        if self.distributed.ray and (self.rollout.mode == "external" or gen.other_engine()):
            raise ValueError(
                "distributed.ray plays episodes with in-process generators: use it with "
                "rollout.mode internal and generator.backend hf"
            )
        if self.mixture:
            if {"task", "rewards"} & self.model_fields_set:
                raise ValueError("give either mixture or task/rewards, not both")
            names = [c.name for c in self.mixture]
            if len(set(names)) != len(names):
                raise ValueError("mixture component names must be unique")
        return self

    @model_validator(mode="after")
    def _check_curriculum(self) -> RunConfig:
        c, names = self.curriculum, [m.name for m in self.components()]
        where = "curriculum"
        if len(c.levels) == 1:
            raise ValueError(f"{where}.levels needs at least two levels (one is no curriculum)")
        if c.levels:
            if c.source is None and self.mixture:
                raise ValueError(f"{where}.source: name the mixture component the levels apply to")
            name = c.source or names[0]
            if name not in names:
                raise ValueError(
                    f"{where}.source '{name}' is not a task source ({', '.join(names)})"
                )
            if next(m for m in self.components() if m.name == name).task.source != "env":
                raise ValueError(f"{where}.levels override env options: source '{name}' is no env")
        elif c.source is not None or c.metric is not None:
            raise ValueError(f"{where}.source / metric are read only with curriculum.levels")
        if c.schedule and not self.mixture:
            raise ValueError(f"{where}.schedule sets mixture weights: the run has no mixture")
        steps = [e.step for e in c.schedule]
        if steps != sorted(set(steps)):
            raise ValueError(f"{where}.schedule steps must increase: {steps}")
        for i, e in enumerate(c.schedule):
            unknown = sorted(set(e.weights) - set(names))
            if unknown:
                raise ValueError(
                    f"{where}.schedule.{i}.weights: unknown source {unknown[0]!r} ({', '.join(names)})"
                )
            merged = {m.name: e.weights.get(m.name, m.weight) for m in self.mixture}
            if min(merged.values()) < 0 or sum(merged.values()) <= 0:
                raise ValueError(
                    f"{where}.schedule.{i}.weights: need >= 0 and one > 0, got {merged}"
                )
        if (c.levels or c.schedule) and self.rollout.async_rollouts:
            raise ValueError(
                f"{where} changes the task sources between steps; rollout.async_rollouts samples "
                "ahead of them: turn one off"
            )
        return self

    def components(self) -> list[MixtureComponent]:
        """The run's task sources: the mixture, or the single task + rewards as one component."""
        if self.mixture:
            return list(self.mixture)
        return [MixtureComponent(name="main", task=self.task, rewards=self.rewards)]
