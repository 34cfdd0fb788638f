"""A tool env written as a user would write one: length conversions with a `convert` tool.

Each instance asks to convert an amount between two of mm, cm, m, km, e.g. "Convert 37 km to m.".
The policy may call the tool (Hermes format, rlvr.envs.tools):

    <tool_call>
    {"name": "convert", "arguments": {"value": 37, "from_unit": "km", "to_unit": "m"}}
    </tool_call>

and gets its result back as a "tool" message (an observation: no gradient), then answers with
`<answer>NUMBER</answer>`. A turn without a tool call is the final answer (ToolEnv.finish).

Reward parts (summed over the episode's turns):
  success     1.0 when the final answer equals the converted amount (weight 1).
  format      1.0 when the final answer is in an answer tag (weight 0.1).
  used_tool   1.0 when at least one call returned a result (weight 0: logged, not optimised).
  call_shape  earned on the first turn only: 1.0 when it holds a tool call, else how close its opening
              is to the call's opening `<tool_call>` (difflib similarity, 0..1). Weight 0 by default: a
              shaping signal for models too small to call tools at all (examples/tiny_tool_env.yaml
              turns it on); it pays for the call's shape, not for the answer, so it can be farmed and
              must not be the only thing a real run optimises.

Used by examples/tiny_tool_env.yaml (`task.env.name: unit_converter_env.py:UnitConverterFamily`) and
by tests/test_example_tool_env.py; docs/envs.md walks through it.
"""

from __future__ import annotations

import difflib
import json
import math
import random
from typing import Any, ClassVar

from pydantic import Field

from rlvr.envs import EnvFamily, EnvOptions, EnvReset, EnvStep, Tool, ToolEnv
from rlvr.envs.tools import parse_tool_calls
from rlvr.records import Task
from rlvr.verifiers.builtin import extract_last_number, extract_tagged

METRES_PER_UNIT = {"mm": 0.001, "cm": 0.01, "m": 1.0, "km": 1000.0}
CALL_OPENING = "<tool_call>"


def convert(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a length from one unit to another.

    Args:
        value: The amount to convert.
        from_unit: The unit of the amount: mm, cm, m or km.
        to_unit: The unit to convert to: mm, cm, m or km.
    """
    for unit in (from_unit, to_unit):
        if unit not in METRES_PER_UNIT:
            raise ValueError(f"unknown unit {unit!r} (use mm, cm, m or km)")
    result = value * METRES_PER_UNIT[from_unit] / METRES_PER_UNIT[to_unit]
    # Plain decimals, never "2e-05": answers are read back with extract_last_number, which has no
    # exponents (`rlvr env check` showed the scripted solver failing on such an answer).
    return f"{result:.6f}".rstrip("0").rstrip(".")


CONVERT = Tool.from_function(convert)

SYSTEM_PROMPT = (
    "Convert lengths with the convert tool. When you have the result, "
    "reply with <answer>NUMBER</answer>."
)


def call_shape(text: str) -> float:
    """1.0 for a turn holding a tool call, else how similar its opening is to `<tool_call>`."""
    if parse_tool_calls(text):
        return 1.0
    opening = text.lstrip()[: len(CALL_OPENING)]
    return difflib.SequenceMatcher(None, opening, CALL_OPENING).ratio()


class UnitConverterOptions(EnvOptions):
    max_value: int = Field(100, ge=2, le=10**6, description="Largest amount to convert.")


class UnitConverterEnv(ToolEnv):
    max_turns = 3

    def __init__(self, task: Task) -> None:
        super().__init__([CONVERT])
        self.task = task
        self.answer = float(task.fields["answer"])
        # Per-episode state: one env instance plays one episode, so plain attributes suffice.
        self.turns = 0
        self.results_ok = 0

    def reset(self) -> EnvReset:
        return EnvReset([dict(m) for m in self.task.messages], self.tool_schemas)

    def step(self, assistant_text: str) -> EnvStep:
        self.turns += 1
        shape = {"call_shape": call_shape(assistant_text)} if self.turns == 1 else {}
        result = super().step(assistant_text)  # runs the calls, or calls finish() for an answer
        self.results_ok += int(
            result.info.get("tool_calls", 0) - result.info.get("tool_failures", 0)
        )
        if not shape:
            return result
        return EnvStep(result.messages, {**result.rewards, **shape}, result.done, result.info)

    def finish(self, assistant_text: str) -> EnvStep:
        tagged = extract_tagged(assistant_text, "answer")
        number = extract_last_number(tagged if tagged is not None else assistant_text)
        try:
            correct = number is not None and math.isclose(float(number), self.answer, rel_tol=1e-9)
        except ValueError:
            correct = False
        rewards = {
            "success": float(correct),
            "format": float(tagged is not None),
            "used_tool": float(self.results_ok > 0),
        }
        return EnvStep(rewards=rewards, done=True, info={"answered": 1})


class UnitConverterFamily(EnvFamily):
    name = "unit_converter"
    description = "Convert a length between mm, cm, m and km with a convert tool."
    Options = UnitConverterOptions
    success_metric = "success"
    reward_weights: ClassVar[dict[str, float]] = {
        "format": 0.1,
        "used_tool": 0.0,
        "call_shape": 0.0,
    }

    def generate(self, seed: int) -> Task:
        options = self.options
        assert isinstance(options, UnitConverterOptions)
        rng = random.Random(seed)
        value = rng.randint(1, options.max_value)
        from_unit, to_unit = rng.sample(sorted(METRES_PER_UNIT), 2)
        question = f"Convert {value} {from_unit} to {to_unit}."
        return Task(
            id=f"unit_converter:{question}",
            messages=(
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": question},
            ),
            fields={"answer": float(convert(value, from_unit, to_unit))},
        )

    def make(self, task: Task) -> UnitConverterEnv:
        return UnitConverterEnv(task)

    def scripted_action(self, task: Task, messages: list[dict[str, Any]]) -> str:
        """A policy that solves every instance (`messages`: the episode so far after the opening):
        call the tool, then answer with its result. `rlvr env check` plays it."""
        results = [m["content"] for m in messages if m["role"] == "tool"]
        if results:
            return f"<answer>{results[-1]}</answer>"
        _, value, from_unit, _, to_unit = task.messages[-1]["content"].rstrip(".").split()
        arguments = {"value": int(value), "from_unit": from_unit, "to_unit": to_unit}
        call = json.dumps({"name": "convert", "arguments": arguments})
        return f"<tool_call>\n{call}\n</tool_call>"
