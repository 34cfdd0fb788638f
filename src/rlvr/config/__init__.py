"""One typed config for `rlvr train` (and `rlvr eval`), each field described once.

Loaded from YAML, overridden with `--set a.b=value`; every error names the field and what is allowed,
in one line. Unknown keys are errors (a typo must not silently fall back to a default).

A package with one module per section (model, tasks, rollout, objective, training, monitors),
each with its validators; `RunConfig` (run.py) holds them all and stays the single source of a
run's settings; loading.py reads YAML and overrides. Import from here: `from rlvr.config import
RunConfig, load_config`.
"""

from __future__ import annotations

from rlvr.config.base import _Section, bf16_sampling_copy, decode_path
from rlvr.config.loading import (
    _format_validation_error,
    _list_item,
    _parse_override,
    apply_overrides,
    config_to_dict,
    load_config,
)
from rlvr.config.model import LoraConfig, ModelConfig
from rlvr.config.monitors import (
    EchoTrapMonitor,
    EntropyCollapseMonitor,
    KLBlowupMonitor,
    MonitorAction,
    MonitorsConfig,
    NonFiniteMonitor,
    RewardHackingMonitor,
    SamplerMismatchMonitor,
    _Monitor,
)
from rlvr.config.objective import CriticConfig, DistillConfig, ObjectiveConfig
from rlvr.config.rollout import (
    DistributedConfig,
    ExternalConfig,
    FilterConfig,
    GeneratorConfig,
    RolloutConfig,
    SamplingConfig,
    VllmLaunch,
)
from rlvr.config.run import RunConfig, _merge_under, _resolve_extension
from rlvr.config.tasks import (
    ArithmeticConfig,
    CurriculumConfig,
    DatasetConfig,
    EnvConfig,
    MixtureComponent,
    Operation,
    RewardSpec,
    ScheduleEntry,
    TaskConfig,
    _default_rewards,
)
from rlvr.config.training import (
    CheckpointConfig,
    EvalConfig,
    SandboxConfig,
    TrackingConfig,
    TrainConfig,
    WatchdogConfig,
)

__all__ = [
    "ArithmeticConfig",
    "CheckpointConfig",
    "CriticConfig",
    "CurriculumConfig",
    "DatasetConfig",
    "DistillConfig",
    "DistributedConfig",
    "EchoTrapMonitor",
    "EntropyCollapseMonitor",
    "EnvConfig",
    "EvalConfig",
    "ExternalConfig",
    "FilterConfig",
    "GeneratorConfig",
    "KLBlowupMonitor",
    "LoraConfig",
    "MixtureComponent",
    "ModelConfig",
    "MonitorAction",
    "MonitorsConfig",
    "NonFiniteMonitor",
    "ObjectiveConfig",
    "Operation",
    "RewardHackingMonitor",
    "RewardSpec",
    "RolloutConfig",
    "RunConfig",
    "SamplerMismatchMonitor",
    "SamplingConfig",
    "SandboxConfig",
    "ScheduleEntry",
    "TaskConfig",
    "TrackingConfig",
    "TrainConfig",
    "VllmLaunch",
    "WatchdogConfig",
    "_Monitor",
    "_Section",
    "_default_rewards",
    "_format_validation_error",
    "_list_item",
    "_merge_under",
    "_parse_override",
    "_resolve_extension",
    "apply_overrides",
    "bf16_sampling_copy",
    "config_to_dict",
    "decode_path",
    "load_config",
]
