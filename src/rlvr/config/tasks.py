"""`task:`, `rewards:`, `mixture:` and `curriculum:`: what the run trains on and how it is scored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    model_validator,
)

from rlvr.config.base import _Section

Operation = Literal["+", "-", "*"]


class ArithmeticConfig(_Section):
    digits: int = Field(2, ge=1, le=6, description="Digits per operand.")
    operations: list[Operation] = Field(default_factory=lambda: list[Operation](["+"]))
    heldout_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="Share of problems never trained on."
    )
    prompt: str = Field("What is {a} {op} {b}?", description="Template with {a}, {op}, {b}.")


class DatasetConfig(_Section):
    path: str = Field(..., description="A .jsonl/.json/.parquet file, or a datasets hub name.")
    split: str = "train"
    heldout_path: str | None = Field(
        None, description="Separate held-out file; else a split is carved."
    )
    heldout_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    prompt_column: str = "prompt"
    answer_column: str | None = "answer"
    system_column: str | None = None
    extra_columns: list[str] = Field(default_factory=list, description="More fields for verifiers.")


class EnvConfig(_Section):
    name: str = Field(..., description="A built-in env (`rlvr envs` lists them).")
    options: dict[str, Any] = Field(default_factory=dict, description="The env family's options.")
    reward_weights: dict[str, float] = Field(
        default_factory=dict, description="Weight per env reward part, over the env's defaults."
    )
    num_train: int = Field(2000, ge=1, description="Distinct training instances generated.")
    num_heldout: int = Field(200, ge=1, description="Distinct held-out instances generated.")
    heldout_fraction: float = Field(0.1, gt=0.0, lt=1.0)


class TaskConfig(_Section):
    source: Literal["arithmetic", "dataset", "env"] = "arithmetic"
    arithmetic: ArithmeticConfig = ArithmeticConfig()
    dataset: DatasetConfig | None = None
    env: EnvConfig | None = None
    system_prompt: str | None = Field(None, description="Prepended as a system message when set.")

    @model_validator(mode="after")
    def _source_present(self) -> TaskConfig:
        if self.source == "dataset" and self.dataset is None:
            raise ValueError(
                "task.source is 'dataset' but task.dataset is missing (needs at least path)"
            )
        if self.source == "env" and self.env is None:
            raise ValueError("task.source is 'env' but task.env is missing (needs at least name)")
        if self.source == "env" and self.system_prompt is not None:
            raise ValueError(
                "task.system_prompt is not used by an env (the env writes its prompts)"
            )
        return self


class RewardSpec(_Section):
    fn: str = Field(..., description="Built-in name, 'module:function' or 'file.py:function'.")
    name: str | None = Field(None, description="Metric name; defaults to the function's name.")
    weight: float = Field(1.0, description="0 = computed and logged, not optimised.")
    options: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments.")
    style: Literal["auto", "rlvr", "trl", "trl_text"] = Field(
        "auto",
        description="How it is called. rlvr: fn(completion_text, **task_fields) per completion. "
        "trl: TRL's batch signature fn(prompts, completions, completion_ids, **columns) -> list of "
        "float or None, chat messages; trl_text: the same with plain strings. auto: trl when the "
        "function has a `completions` parameter, else rlvr (docs/coming_from_trl.md).",
    )


def _default_rewards(task: Any) -> list[dict[str, Any]]:
    # Envs score themselves (their reward parts); plain tasks default to a numeric answer check.
    source = task.get("source") if isinstance(task, dict) else getattr(task, "source", None)
    return [] if source == "env" else [{"fn": "numeric_match", "name": "correct"}]


class MixtureComponent(_Section):
    """One source of a mixture: a task set or env with its own rubric, drawn with `weight`."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="Used in metric names.")
    weight: float = Field(1.0, gt=0.0, description="Relative sampling weight.")
    task: TaskConfig
    rewards: list[RewardSpec] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _rewards_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and "rewards" not in data:
            data = {**data, "rewards": _default_rewards(data.get("task", {}))}
        return data


class ScheduleEntry(_Section):
    step: int = Field(..., ge=0, description="From this step on (step 0: from the start).")
    weights: dict[str, float] = Field(
        ..., description="Mixture weight per component name; unnamed ones keep their own."
    )


class CurriculumConfig(_Section):
    """Difficulty levels promoted on rolling train success, and/or mixture weights on a schedule
    (rlvr.train.curriculum, docs/curriculum.md). Off while both lists are empty."""

    levels: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Env option overrides per level, easiest first, over task.env.options.",
    )
    source: str | None = Field(
        None, description="Mixture component the levels apply to (default: the only source)."
    )
    metric: str | None = Field(
        None, description="Reward component (or 'reward') read as success; default eval's metric."
    )
    threshold: float = Field(0.8, description="Promote when the rolling success reaches this.")
    window: int = Field(
        8, ge=1, description="Rolling success = mean of the last N steps at a level."
    )
    min_steps_per_level: int | None = Field(
        None, ge=1, description="Steps at a level before it can be left; default window."
    )
    eval_level: Literal["final", "current"] = Field(
        "final", description="Held-out eval on the final level's tasks, or the current level's."
    )
    schedule: list[ScheduleEntry] = Field(
        default_factory=list, description="Mixture weights from given steps on (needs a mixture)."
    )
