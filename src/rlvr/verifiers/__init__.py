"""Verifiers: reward functions that check a completion, and the rubric that weighs them.

Imported here so configs and user code can write `from rlvr.verifiers import Rubric, numeric_match`.
math_verify (slow to import) is only loaded the first time `math_equiv` runs.
"""

from __future__ import annotations

from rlvr.verifiers.builtin import (
    BUILTIN_REWARDS,
    answer_tag_format,
    exact_match,
    extract_last_number,
    extract_tagged,
    json_schema_format,
    math_equiv,
    numeric_match,
    regex_format,
)
from rlvr.verifiers.rubric import (
    RewardFunction,
    Rubric,
    Score,
    resolve_reward_fn,
    trajectory_reward,
)
from rlvr.verifiers.trace import tool_trace

# Registered here rather than in builtin.py: trace.py needs rubric.py, which imports builtin.py.
# Any import of rlvr.verifiers.rubric runs this package __init__ first, so the name always resolves.
BUILTIN_REWARDS.setdefault("tool_trace", tool_trace)

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFunction",
    "Rubric",
    "Score",
    "answer_tag_format",
    "exact_match",
    "extract_last_number",
    "extract_tagged",
    "json_schema_format",
    "math_equiv",
    "numeric_match",
    "regex_format",
    "resolve_reward_fn",
    "tool_trace",
    "trajectory_reward",
]
