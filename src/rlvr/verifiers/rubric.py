"""Combine reward functions into one scalar reward per trajectory, keeping every component visible.

A `Rubric` is a list of weighted `RewardFunction`s. Scoring a trajectory runs every component and
returns a `Score` with each component's value, the weighted total and, separately, the errors. A
function that raises or returns something that is not a finite number is recorded as an error
and never turned into 0.0: a silent zero would teach the policy that a possibly-correct answer was
wrong, so the training loop instead leaves such a trajectory out of the update.

(Just over 500 lines: loading, calling and scoring are one pipeline, and TRL-style batch calls
live in trl_style.py; splitting the rest would scatter the error rules a reader needs in one place.)
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

from rlvr.errors import ConfigError
from rlvr.observe.watchdog import watch
from rlvr.records import Task, Trajectory
from rlvr.registry import REWARDS, load_object
from rlvr.verifiers.trl_style import (
    TRL_ARGUMENTS,
    RewardStyle,
    batch_arguments,
    call_batch,
    check_trl_signature,
)

__all__ = [
    "Prefetched",
    "RewardFunction",
    "Rubric",
    "Score",
    "as_reward_function",
    "parallel_reward",
    "resolve_callable",
    "resolve_reward_fn",
    "trajectory_reward",
]

F = TypeVar("F", bound=Callable[..., Any])

# Attribute set by @trajectory_reward; kept in a constant so the decorator and the check agree.
_WANTS_TRAJECTORY = "__rlvr_trajectory_reward__"

# Longest error message kept per component: errors are logged per step and must stay one line.
_MAX_ERROR_CHARS = 500


_PARALLEL = "__rlvr_parallel_reward__"

# (id(trajectory), function name) -> value (None: a TRL-style "not applicable"), or the exception
# it raised; see Rubric.prefetch.
Prefetched = dict[tuple[int, str], "float | Exception | None"]


def parallel_reward(fn: F) -> F:
    """Mark `fn` as slow and thread-safe (e.g. running code in the sandbox): the rollout engine then
    scores it for all trajectories of a step at once in worker threads, so one slow sample does not
    hold back the others. Functions using signals (math_verify's timeouts) must not be marked."""
    setattr(fn, _PARALLEL, True)
    return fn


def trajectory_reward(fn: F) -> F:
    """Mark `fn` as wanting the whole `Trajectory` (turns, token ids, info) instead of the text.

    Multi-turn and tool-use rewards need more than the final text, e.g. how many tool calls were
    made or whether the rollout was truncated. The function is called as `fn(trajectory, **kwargs)`.
    """
    setattr(fn, _WANTS_TRAJECTORY, True)
    return fn


def _one_line(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _MAX_ERROR_CHARS else flat[: _MAX_ERROR_CHARS - 3] + "..."


def _describe(exc: BaseException) -> str:
    message = str(exc)
    return _one_line(f"{type(exc).__name__}: {message}" if message else type(exc).__name__)


def resolve_reward_fn(
    spec: str, base_dir: str | os.PathLike[str] | None = None
) -> Callable[..., float]:
    """Turn a config string into a reward function.

    `spec` is a built-in name (see `BUILTIN_REWARDS`), an installed plug-in (entry-point group
    `rlvr.rewards`), `"package.module:function"`, or `"path/to/file.py:function"` (relative paths
    are taken from `base_dir`, e.g. the config file's folder, else the working directory). The
    attribute may be dotted (`module:Class.method`). Every failure is a `ConfigError` whose one-line
    message says what was wrong, so the CLI can print it without a traceback before any model is
    loaded.
    """
    fn: Callable[..., float] = REWARDS.resolve(spec, base_dir)
    return fn


def as_reward_function(obj: Any, ref: str) -> Callable[..., float]:
    """`obj` if it is callable (rlvr.registry's check for reward functions)."""
    if not callable(obj):
        raise ConfigError(f"reward function {ref!r} is a {type(obj).__name__}, not callable")
    fn: Callable[..., float] = obj
    return fn


def resolve_callable(
    spec: str, base_dir: str | os.PathLike[str] | None = None, what: str = "reward function"
) -> Any:
    """The callable that `"package.module:attr"` or `"path/to/file.py:attr"` names; `what` says
    what it is for in every error message (rlvr.registry.load_object, plus the callable check)."""
    location, _, attr_path = spec.rpartition(":")
    if not location or not attr_path:
        noun = "function" if what == "reward function" else "name"
        raise ConfigError(f"{what} {spec!r}: expected 'module:{noun}' or 'file.py:{noun}'")
    target = load_object(spec, base_dir, what)
    if not callable(target):
        raise ConfigError(
            f"{what} {spec!r}: {attr_path!r} is a {type(target).__name__}, not callable"
        )
    return target


@dataclass(frozen=True)
class _CallPlan:
    """What `inspect.signature` says about a reward function, worked out once per function.

    `accepted` is None when the function takes **kwargs (it gets every field), else the names it can
    take by keyword. `required` are those without a default, checked before the call so a missing
    task field gets a message that names the field and the task.
    """

    accepted: frozenset[str] | None
    required: frozenset[str]
    first: str | None = None  # the name of the parameter that receives the completion


def _call_plan(name: str, fn: Callable[..., Any]) -> _CallPlan:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        # Some C callables have no signature: pass everything and let the call itself complain.
        return _CallPlan(accepted=None, required=frozenset())
    params = list(signature.parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    first = None
    if params and params[0].kind in positional:
        first = params[0].name
        params = params[1:]  # receives the completion text (or the Trajectory)
    elif not params or params[0].kind is not inspect.Parameter.VAR_POSITIONAL:
        raise ConfigError(
            f"reward function {name!r}: it must take the completion as its first argument"
        )
    if any(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in params):
        raise ConfigError(
            f"reward function {name!r}: only its first argument may be positional-only; "
            "task fields and options are passed by keyword"
        )
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    keyword = [p for p in params if p.kind in keyword_kinds]
    required = frozenset(p.name for p in keyword if p.default is inspect.Parameter.empty)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return _CallPlan(accepted=None, required=required, first=first)
    return _CallPlan(accepted=frozenset(p.name for p in keyword), required=required, first=first)


@dataclass(frozen=True)
class RewardFunction:
    """One component of a rubric: a reward function, its weight and its config options.

    Calling convention (style "rlvr"): the first positional argument is
    `trajectory.completion_text` (or the `Trajectory` itself for `@trajectory_reward` functions);
    keyword arguments are the task's fields merged with `options` (options win), filtered to the
    parameters the function accepts unless it takes **kwargs. Task fields are filtered because a
    task carries fields for other components; an option the function cannot accept is a typo in the
    config and raises `ConfigError` here. Styles "trl" and "trl_text" call the function TRL's way, a
    batch at a time (rlvr.verifiers.trl_style), and allow None ("not applicable") per sample.
    """

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    options: Mapping[str, Any] = field(default_factory=dict)
    style: RewardStyle = "rlvr"
    _plan: _CallPlan = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ConfigError(f"reward function {self.name!r}: {self.fn!r} is not callable")
        if isinstance(self.weight, bool) or not isinstance(self.weight, numbers.Real):
            raise ConfigError(
                f"reward function {self.name!r}: weight {self.weight!r} is not a number"
            )
        if not math.isfinite(float(self.weight)):
            raise ConfigError(
                f"reward function {self.name!r}: weight {self.weight!r} is not finite"
            )
        object.__setattr__(self, "weight", float(self.weight))
        # A read-only copy: the caller's dict may change later, and the dataclass is frozen.
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))
        if self.style not in ("rlvr", "trl", "trl_text"):
            raise ConfigError(
                f"reward function {self.name!r}: style {self.style!r} is not rlvr, trl or trl_text"
            )
        if self.is_trl:
            accepted, required = check_trl_signature(self.name, self.fn)
            plan = _CallPlan(accepted=accepted, required=required)
        else:
            plan = _call_plan(self.name, self.fn)
        if plan.accepted is not None:
            unknown = sorted(set(self.options) - plan.accepted)
            if unknown:
                raise ConfigError(
                    f"reward function {self.name!r}: option(s) {', '.join(unknown)} not accepted "
                    f"(it takes: {', '.join(sorted(plan.accepted)) or 'no keyword arguments'})"
                )
        object.__setattr__(self, "_plan", plan)

    @property
    def wants_trajectory(self) -> bool:
        return bool(getattr(self.fn, _WANTS_TRAJECTORY, False))

    @property
    def is_trl(self) -> bool:
        """Called TRL's way: once per batch, None allowed per sample."""
        return self.style != "rlvr"

    def call_batch(
        self, pairs: Sequence[tuple[Trajectory, Task]]
    ) -> list[float | Exception | None]:
        """A TRL-style function's values for every pair, from one call."""
        arguments = batch_arguments(pairs, self.style, dict(self.options), self._plan.accepted)
        with watch("reward", self.name):
            return call_batch(self.fn, arguments, len(pairs))

    def check_fields(self, fields: frozenset[str], task_id: str) -> None:
        """Refuse, before any rollout, a function that cannot be called on a task with `fields`:
        a required parameter the task does not have, or a first parameter named like a task field
        (`def f(answer)`: it would receive the completion text, and answer=... again by keyword)."""
        if self.is_trl:
            missing = sorted(self._plan.required - fields - set(self.options) - TRL_ARGUMENTS)
            if missing:
                shown = ", ".join(sorted(fields)) or "none"
                raise ConfigError(
                    f"reward function {self.name!r} (TRL style) needs column(s) "
                    f"{', '.join(map(repr, missing))} that task {task_id!r} does not have "
                    f"(its fields: {shown}; dataset columns reach it via task.dataset.extra_columns)"
                )
            return
        first = self._plan.first
        if first is not None and (first in fields or first in self.options or first == "prompt"):
            raise ConfigError(
                f"reward function {self.name!r}: its first parameter {first!r} is a task field or "
                f"option, but the first argument is always the completion text; write "
                f"`def {getattr(self.fn, '__name__', 'fn')}(completion, {first}, **_)`"
            )
        # `prompt` is filled from the task's messages when the task has no such field.
        missing = sorted(self._plan.required - fields - set(self.options) - {"prompt"})
        if missing:
            shown = ", ".join(sorted(fields)) or "none"
            raise ConfigError(
                f"reward function {self.name!r} needs task field(s) {', '.join(map(repr, missing))} "
                f"that task {task_id!r} does not have (its fields: {shown})"
            )

    def keyword_arguments(self, task: Task) -> dict[str, Any]:
        """The keyword arguments this function gets for `task`: task fields, options on top.

        A function that names a `prompt` parameter also gets the task's prompt messages there when
        the task has no `prompt` field of its own (a reward model or judge scores the reply to it).
        """
        merged = {**task.fields, **self.options}
        accepted = self._plan.accepted
        if accepted is None:
            return merged
        if "prompt" in accepted and "prompt" not in merged:
            merged["prompt"] = [dict(m) for m in task.messages]
        return {key: value for key, value in merged.items() if key in accepted}

    def __call__(self, trajectory: Trajectory, task: Task) -> float | None:
        """The component's value as a finite float; raises on anything else (the rubric records it).

        bool is accepted (a pass/fail check) and becomes 0.0/1.0; any real number (int, float, numpy
        scalars) is converted; strings, tensors and NaN/inf raise, and so does None except from a
        TRL-style function (there it means "not applicable": None is returned).
        """
        if self.is_trl:
            (value,) = self.call_batch([(trajectory, task)])
            if isinstance(value, Exception):
                raise value
            return value
        kwargs = self.keyword_arguments(task)
        missing = sorted(self._plan.required - kwargs.keys())
        if missing:
            raise TypeError(
                f"task {task.id!r} has no field {', '.join(map(repr, missing))} "
                f"needed by reward function {self.name!r}"
            )
        first: Trajectory | str = (
            trajectory if self.wants_trajectory else trajectory.completion_text
        )
        with watch("reward", self.name):
            value = self.fn(first, **kwargs)
        if not isinstance(value, numbers.Real):
            raise TypeError(f"returned {type(value).__name__} {value!r:.80}, expected a number")
        result = float(value)
        if not math.isfinite(result):
            raise ValueError(f"returned {result}, expected a finite number")
        return result


@dataclass(frozen=True)
class Score:
    """The rubric's verdict on one trajectory.

    `rewards` holds the components that succeeded, `errors` the others (name -> one-line
    "ExcType: message"). `total` is the weighted sum over `rewards`; it is only meaningful when
    `errors` is empty, since a failed component's contribution is unknown.
    """

    rewards: dict[str, float]
    total: float
    errors: dict[str, str]
    # TRL-style components that returned None ("not applicable"): in neither rewards nor errors.
    skipped: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.errors


class Rubric:
    """Weighted reward functions; `score` runs all of them on a trajectory and sums the results.

    Components are independent: one that fails does not stop the others, so the logs still show the
    format reward of a trajectory whose answer check crashed. Weight 0.0 components run and are
    reported (useful as metrics, e.g. tracking correctness while training on format only) but add
    nothing to the total.
    """

    def __init__(self, functions: Sequence[RewardFunction]) -> None:
        if not functions:
            raise ConfigError("a rubric needs at least one reward function")
        seen: set[str] = set()
        for function in functions:
            if function.name in seen:
                raise ConfigError(f"reward function name {function.name!r} is used twice")
            seen.add(function.name)
        self._functions = tuple(functions)

    @property
    def functions(self) -> tuple[RewardFunction, ...]:
        return self._functions

    def check_tasks(self, tasks: Sequence[Task]) -> None:
        """Every function callable on every task's fields (`RewardFunction.check_fields`), checked
        once per distinct set of field names, so a misnamed parameter fails before a model loads
        rather than as an error in every rollout."""
        seen: set[frozenset[str]] = set()
        for task in tasks:
            fields = frozenset(task.fields)
            if fields in seen:
                continue
            seen.add(fields)
            for function in self._functions:
                function.check_fields(fields, task.id)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self._functions)

    @property
    def weights(self) -> dict[str, float]:
        return {f.name: f.weight for f in self._functions}

    def prefetch(self, pairs: Sequence[tuple[Trajectory, Task]], workers: int = 4) -> Prefetched:
        """Values of the `@parallel_reward` functions for every pair, computed in worker threads,
        and of the TRL-style functions, one batch call each (in this thread, as TRL calls them)."""
        out: Prefetched = {}
        for function in self._functions:
            if function.is_trl and pairs:
                for (trajectory, _), value in zip(pairs, function.call_batch(pairs), strict=True):
                    out[(id(trajectory), function.name)] = value
        slow = [f for f in self._functions if getattr(f.fn, _PARALLEL, False) and not f.is_trl]
        if not slow or not pairs:
            return out

        def one(job: tuple[RewardFunction, Trajectory, Task]) -> float | Exception | None:
            function, trajectory, task = job
            try:
                return function(trajectory, task)
            except Exception as exc:
                return exc

        jobs = [(f, t, task) for f in slow for t, task in pairs]
        with ThreadPoolExecutor(max(1, min(workers, len(jobs)))) as pool:
            for (function, trajectory, _), value in zip(jobs, pool.map(one, jobs), strict=True):
                out[(id(trajectory), function.name)] = value
        return out

    def score(
        self, trajectory: Trajectory, task: Task, prefetched: Prefetched | None = None
    ) -> Score:
        rewards: dict[str, float] = {}
        errors: dict[str, str] = {}
        skipped: list[str] = []
        total = 0.0
        for function in self._functions:
            try:
                key = (id(trajectory), function.name)
                if prefetched is not None and key in prefetched:
                    found = prefetched[key]
                    if isinstance(found, Exception):
                        raise found
                    value = found
                else:
                    value = function(trajectory, task)
            except Exception as exc:
                errors[function.name] = _describe(exc)
                continue
            if value is None:  # TRL's "not applicable": out of the sum, as TRL's nansum leaves it
                skipped.append(function.name)
                continue
            rewards[function.name] = value
            if function.weight != 0.0:
                total += function.weight * value
        return Score(rewards=rewards, total=total, errors=errors, skipped=tuple(skipped))

    def score_many(self, pairs: Sequence[tuple[Trajectory, Task]]) -> list[Score]:
        """Score each (trajectory, task) pair in order.

        Sequential on purpose: math_verify's timeouts use SIGALRM, which only works in the main
        thread, and rewards are cheap next to generation. Slow verifiers (code execution) should
        parallelise inside their own function.
        """
        return [self.score(trajectory, task) for trajectory, task in pairs]

    def __repr__(self) -> str:
        parts = ", ".join(f"{f.name}*{f.weight:g}" for f in self._functions)
        return f"Rubric({parts})"
