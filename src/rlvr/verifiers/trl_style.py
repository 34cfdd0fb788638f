"""TRL's reward-function calling convention, so a GRPOTrainer script's rewards run unchanged.

TRL calls a reward function once per batch: `fn(prompts=[...], completions=[...],
completion_ids=[...], **columns)`, every argument a list with one entry per completion, and takes back
a list of floats in which `None` means "this function does not apply to this sample". rlvr's own
functions are called once per completion with the completion text first. This module does the
batch call for a rubric component whose `style` is "trl" (conversational: prompts and completions
as chat message lists, which is what rlvr trains on since it always applies the chat template) or
"trl_text" (TRL's standard format: plain strings).

`None` follows TRL (GRPOTrainer, checked against TRL 1.16): the component is left out of that
sample's weighted sum (TRL's nansum) and out of the component's mean; a sample on which *every*
reward function returned None is unscorable: it is left out of its group's baseline and of the
update (TRL zeroes its advantage), and a warning names it. `style: auto` picks "trl" for a
function that has a parameter named `completions` (rlvr's functions take one completion), so
naming it is the only way to opt in without `style:` in the config.

What TRL passes and rlvr does not: `trainer_state`, `log_extra`, `log_metric` (a function that
requires one of them is refused when the rubric is built).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Literal

from rlvr.errors import ConfigError
from rlvr.records import Task, Trajectory

RewardStyle = Literal["rlvr", "trl", "trl_text"]

# The batch-wide arguments TRL passes besides the dataset's columns.
TRL_ARGUMENTS = frozenset({"prompts", "completions", "completion_ids"})
# TRL-only arguments rlvr does not provide: a function that requires one cannot run here.
_NOT_PROVIDED = frozenset({"trainer_state", "log_extra", "log_metric", "environments"})


def detect_style(fn: Callable[..., Any]) -> RewardStyle:
    """ "trl" when `fn` has a parameter named `completions` (TRL's batch signature), else "rlvr"."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "rlvr"
    return "trl" if "completions" in parameters else "rlvr"


def check_trl_signature(
    name: str, fn: Callable[..., Any]
) -> tuple[frozenset[str] | None, frozenset[str]]:
    """(accepted keyword names or None for **kwargs, required names) of a TRL-style function; a
    function that needs positional-only arguments or TRL's trainer hooks is refused here."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None, frozenset()
    if any(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in parameters):
        raise ConfigError(
            f"reward function {name!r} (TRL style): TRL passes every argument by keyword, "
            "so it cannot have positional-only parameters"
        )
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    keyword = [p for p in parameters if p.kind in keyword_kinds]
    required = frozenset(p.name for p in keyword if p.default is inspect.Parameter.empty)
    hooks = sorted(required & _NOT_PROVIDED)
    if hooks:
        raise ConfigError(
            f"reward function {name!r} (TRL style) requires {', '.join(hooks)}, which rlvr does not "
            "pass; give it a default (e.g. trainer_state=None)"
        )
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None, required
    return frozenset(p.name for p in keyword), required


def _prompt(task: Task, style: RewardStyle) -> Any:
    messages = [dict(m) for m in task.messages]
    if style == "trl":
        return messages
    # TRL's standard format: the prompt text (the last user message; rlvr made it from the string).
    users = [m["content"] for m in messages if m.get("role") == "user"]
    return users[-1] if users else ""


def _completion(trajectory: Trajectory, style: RewardStyle) -> Any:
    if style == "trl_text":
        return trajectory.completion_text
    # Multi-turn: everything after the prompt (assistant turns and tool results), as TRL passes it.
    if trajectory.messages:
        return [dict(m) for m in trajectory.messages]
    return [{"role": "assistant", "content": trajectory.completion_text}]


def batch_arguments(
    pairs: Sequence[tuple[Trajectory, Task]],
    style: RewardStyle,
    options: dict[str, Any],
    accepted: frozenset[str] | None,
) -> dict[str, Any]:
    """TRL's keyword arguments for one batch: prompts, completions, completion_ids and each task
    field as a list (None where a task lacks the field), options as given; filtered to `accepted`."""
    columns = sorted({name for _, task in pairs for name in task.fields} - TRL_ARGUMENTS)
    arguments: dict[str, Any] = {
        "prompts": [_prompt(task, style) for _, task in pairs],
        "completions": [_completion(trajectory, style) for trajectory, _ in pairs],
        "completion_ids": [list(trajectory.completion_ids) for trajectory, _ in pairs],
        **{column: [task.fields.get(column) for _, task in pairs] for column in columns},
        **options,
    }
    if accepted is None:
        return arguments
    return {key: value for key, value in arguments.items() if key in accepted}


def call_batch(
    fn: Callable[..., Any], arguments: dict[str, Any], size: int
) -> list[float | Exception | None]:
    """One TRL-style call; per sample a finite float, None (not applicable) or the error to record.

    A call that raises or returns the wrong number of values fails every sample of the batch (TRL
    would stop the run; rlvr counts them against train.max_reward_error_fraction)."""
    try:
        values = fn(**arguments)
        values = list(values)
    except Exception as exc:
        return [exc] * size
    if len(values) != size:
        error = ValueError(
            f"returned {len(values)} rewards for {size} completions (TRL style: one per completion)"
        )
        return [error] * size
    return [_checked(value) for value in values]


def _checked(value: Any) -> float | Exception | None:
    if value is None:
        return None
    if not isinstance(value, numbers.Real):
        return TypeError(
            f"returned {type(value).__name__} {value!r:.80}, expected a number or None"
        )
    result = float(value)
    if not math.isfinite(result):
        return ValueError(f"returned {result}; TRL style: return None for 'not applicable'")
    return result
