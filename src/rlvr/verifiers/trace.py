"""`tool_trace`: a verifier of *which tools the policy called*, read from the whole trajectory.

It lives outside `builtin.py` because it needs `@trajectory_reward` from `rubric.py`, which imports
`builtin.py`; `rlvr/verifiers/__init__.py` registers it in `BUILTIN_REWARDS` as "tool_trace".
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from rlvr.records import Trajectory
from rlvr.verifiers.rubric import trajectory_reward

__all__ = ["tool_trace", "trajectory_tool_calls"]


def trajectory_tool_calls(trajectory: Trajectory) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of every well-formed Hermes `<tool_call>` the policy made, in order.

    Read from the assistant messages; a trajectory without messages (single-turn) falls back to
    `completion_text`. Malformed calls (bad JSON, no name, non-object arguments) are skipped.
    """
    # Imported here: rlvr.envs.tools pulls in transformers, which a verifier import should not.
    from rlvr.envs.tools import parse_tool_calls

    texts = [
        str(m.get("content") or "") for m in trajectory.messages if m.get("role") == "assistant"
    ]
    if not trajectory.messages:
        texts = [trajectory.completion_text]
    return [
        (call.name, call.arguments)
        for text in texts
        for call in parse_tool_calls(text)
        if call.error is None
    ]


def _values_equal(expected: Any, actual: Any) -> bool:
    """== with 3 == 3.0 but True != 1, applied recursively inside lists and objects."""
    if isinstance(expected, bool) or isinstance(actual, bool):
        return isinstance(expected, bool) and isinstance(actual, bool) and expected == actual
    if isinstance(expected, numbers.Real) and isinstance(actual, numbers.Real):
        return float(expected) == float(actual)
    if isinstance(expected, Mapping) and isinstance(actual, Mapping):
        return expected.keys() == actual.keys() and all(
            _values_equal(v, actual[k]) for k, v in expected.items()
        )
    if isinstance(expected, list | tuple) and isinstance(actual, list | tuple):
        return len(expected) == len(actual) and all(
            _values_equal(e, a) for e, a in zip(expected, actual, strict=True)
        )
    return bool(expected == actual)


def _normalise_expected(expected_calls: Any) -> list[tuple[str, dict[str, Any]]]:
    """The expected calls as (name, partial arguments); ValueError for a malformed config."""
    if not isinstance(expected_calls, Sequence) or isinstance(expected_calls, str):
        raise ValueError("tool_trace: expected_calls must be a list of {name, arguments} objects")
    out = []
    for i, call in enumerate(expected_calls):
        if not isinstance(call, Mapping) or not isinstance(call.get("name"), str):
            raise ValueError(f"tool_trace: expected_calls[{i}] needs a string 'name', got {call!r}")
        arguments = call.get("arguments", {})
        if not isinstance(arguments, Mapping):
            raise ValueError(f"tool_trace: expected_calls[{i}].arguments must be an object")
        unknown = set(call) - {"name", "arguments"}
        if unknown:
            raise ValueError(f"tool_trace: expected_calls[{i}] has unknown keys {sorted(unknown)}")
        out.append((call["name"], dict(arguments)))
    return out


def _matches(expected: tuple[str, dict[str, Any]], actual: tuple[str, dict[str, Any]]) -> bool:
    name, arguments = expected
    actual_name, actual_arguments = actual
    return name == actual_name and all(
        key in actual_arguments and _values_equal(value, actual_arguments[key])
        for key, value in arguments.items()
    )


def _ordered_match(
    expected: list[tuple[str, dict[str, Any]]], actual: list[tuple[str, dict[str, Any]]]
) -> bool:
    """Whether `expected` matches a subsequence of `actual` (greedy earliest match is optimal)."""
    position = 0
    for want in expected:
        while position < len(actual) and not _matches(want, actual[position]):
            position += 1
        if position == len(actual):
            return False
        position += 1
    return True


def _multiset_match(
    expected: list[tuple[str, dict[str, Any]]], actual: list[tuple[str, dict[str, Any]]]
) -> bool:
    """Whether every expected call matches a distinct actual call (bipartite matching, since a
    partial pattern may fit several calls)."""
    owner: dict[int, int] = {}  # actual index -> expected index

    def assign(e: int, seen: set[int]) -> bool:
        for a in range(len(actual)):
            if a in seen or not _matches(expected[e], actual[a]):
                continue
            seen.add(a)
            if a not in owner or assign(owner[a], seen):
                owner[a] = e
                return True
        return False

    return all(assign(e, set()) for e in range(len(expected)))


@trajectory_reward
def tool_trace(
    trajectory: Trajectory,
    expected_calls: list[dict[str, Any]],
    ordered: bool = True,
    exact: bool = False,
    **_: Any,
) -> float:
    """1.0 iff the policy's tool calls contain `expected_calls`, else 0.0.

    `expected_calls` is `[{"name": "search", "arguments": {"query": "x"}}, ...]`; `arguments` may
    list only some keys (the others are not checked), values compare with == (3 == 3.0, but True is
    not 1; lists and objects compare in full). With `ordered` the expected calls must appear in this
    order as a subsequence of the calls made, otherwise as a multiset in any order; `exact` also
    forbids calls beyond the expected ones. Malformed calls are skipped (they are neither matches
    nor extras: the env already counts them as tool failures). A malformed `expected_calls` raises
    ValueError (broken task data or config).
    """
    expected = _normalise_expected(expected_calls)
    actual = trajectory_tool_calls(trajectory)
    if exact and len(actual) != len(expected):
        return 0.0
    matched = _ordered_match(expected, actual) if ordered else _multiset_match(expected, actual)
    return 1.0 if matched else 0.0
