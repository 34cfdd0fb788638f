"""Tools: plain typed Python functions the policy can call, and `ToolEnv`, an env that runs them.

A tool is a function with type hints and a Google-style docstring; its JSON schema comes from
`transformers.utils.get_json_schema` (the same schema `apply_chat_template(tools=...)` expects).
Calls are parsed in the format of the model's family (rlvr.envs.tool_formats: Hermes / Qwen2.5,
Qwen3, Llama 3.x JSON, Mistral), which the rollout engine picks from the chat template and sets on
the env (`ToolEnv.tool_format`); Hermes by default:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

Every way a call can go wrong (malformed JSON, unknown tool, wrong or missing arguments, a tool that
raises, a tool that runs past its timeout, too many calls in one turn) becomes an error observation
fed back to the model and a counted failure; a rollout never crashes on a tool. A timed-out call's
thread is abandoned (Python cannot kill a thread): tools that may hang on purpose belong in a
subprocess sandbox, not here.
"""

from __future__ import annotations

import inspect
import json
import threading
import typing
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema

from rlvr.envs.base import Env, EnvStep, Message
from rlvr.envs.tool_formats import HERMES, ToolCall, ToolFormat, ToolResult

_MAX_RESULT_CHARS = 4000

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "too_many_calls")


@dataclass(frozen=True)
class Tool:
    """A callable plus its JSON schema; build with `Tool.from_function(fn)`."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]

    @classmethod
    def from_function(cls, fn: Callable[..., Any]) -> Tool:
        return cls(name=fn.__name__, fn=fn, schema=get_json_schema(fn))


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>` block in `text`, in order (the Hermes format; an unterminated last block is
    parsed too). Other families' formats: `rlvr.envs.tool_formats.TOOL_FORMATS[name].parse`."""
    return HERMES.parse(text)


def _type_ok(value: Any, annotation: Any) -> bool:
    """A shallow check of a JSON value against a parameter's annotation (int, float, str, bool, list,
    dict, Optional / Union of those); unknown annotations accept anything."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    base = origin or annotation
    if base is bool:
        return isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base in (str, list, dict):
        return isinstance(value, base)
    return True


def check_arguments(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """None when `arguments` fit the tool's signature, else a one-line reason."""
    signature = inspect.signature(tool.fn)
    hints = typing.get_type_hints(tool.fn)
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    params = {n: p for n, p in signature.parameters.items() if p.kind not in variadic}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    unknown = sorted(set(arguments) - set(params))
    if unknown and not takes_any:
        return f"unexpected argument(s) {', '.join(unknown)}; {tool.name} takes {', '.join(params)}"
    missing = [n for n, p in params.items() if p.default is p.empty and n not in arguments]
    if missing:
        return f"missing argument(s) {', '.join(missing)}"
    for name, value in arguments.items():
        expected = hints.get(name, inspect.Parameter.empty)
        if not _type_ok(value, expected):
            shown = getattr(expected, "__name__", str(expected))
            return f"argument '{name}' should be {shown}, got {type(value).__name__} {value!r:.40}"
    return None


def run_tool(tool: Tool, arguments: dict[str, Any], timeout_s: float) -> ToolResult:
    """Run one call in a daemon thread with a timeout; exceptions become error results."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            value = tool.fn(**arguments)
            box["value"] = value if isinstance(value, str) else json.dumps(value, default=str)
        except Exception as exc:  # the tool's failure is the model's observation, not our crash
            box["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=target, daemon=True, name=f"tool-{tool.name}")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return ToolResult(
            tool.name, f"Error: {tool.name} timed out after {timeout_s:g}s", "timeout"
        )
    if "error" in box:
        return ToolResult(tool.name, f"Error: {box['error']}"[:_MAX_RESULT_CHARS], "raised")
    return ToolResult(tool.name, str(box.get("value", ""))[:_MAX_RESULT_CHARS])


def execute_calls(
    calls: Sequence[ToolCall], tools: Sequence[Tool], *, timeout_s: float, max_calls: int
) -> list[ToolResult]:
    """Results for `calls` in order; failures are error results with their kind."""
    by_name = {t.name: t for t in tools}
    results = []
    for i, call in enumerate(calls):
        if i >= max_calls:
            results.append(
                ToolResult(
                    call.name,
                    f"Error: at most {max_calls} tool call(s) per turn; this one was not run",
                    "too_many_calls",
                )
            )
        elif call.error is not None:
            results.append(ToolResult(call.name, f"Error: {call.error}", "malformed"))
        elif call.name not in by_name:
            known = ", ".join(by_name)
            results.append(
                ToolResult(
                    call.name,
                    f"Error: unknown tool '{call.name}' (available: {known})",
                    "unknown_tool",
                )
            )
        else:
            problem = check_arguments(by_name[call.name], call.arguments)
            if problem is not None:
                results.append(ToolResult(call.name, f"Error: {problem}", "bad_arguments"))
            else:
                results.append(run_tool(by_name[call.name], call.arguments, timeout_s))
    return results


def tool_info(results: Sequence[ToolResult]) -> dict[str, Any]:
    """Counters the rollout metrics aggregate: calls, failures, and failures by kind."""
    info: dict[str, Any] = {
        "tool_calls": len(results),
        "tool_failures": sum(r.error_kind is not None for r in results),
    }
    for kind in ERROR_KINDS:
        info[f"tool_errors/{kind}"] = sum(r.error_kind == kind for r in results)
    return info


class ToolEnv(Env):
    """An env whose turns are either tool calls (run, results returned as "tool" messages) or a
    final answer (handed to `finish`). Subclasses give the tools and implement `finish`.

    `timeout_s`, `max_calls_per_turn` and `tool_format` are set by the rollout engine from the
    config (`rollout.tool_timeout_s`, `rollout.max_tool_calls_per_turn`, `rollout.tool_format`: the
    chat template's own format unless overridden). `calls_made` numbers the episode's calls (the
    ids of Mistral's results).
    """

    max_turns = 6
    timeout_s: float = 5.0
    max_calls_per_turn: int = 4
    tool_format: ToolFormat = HERMES
    calls_made: int = 0

    def __init__(self, tools: Sequence[Tool]) -> None:
        self.tools = list(tools)

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools]

    @abstractmethod
    def finish(self, assistant_text: str) -> EnvStep:
        """Score a turn without tool calls (the final answer)."""

    def step(self, assistant_text: str) -> EnvStep:
        fmt = self.tool_format
        calls = fmt.parse(assistant_text)
        if not calls:
            return self.finish(assistant_text)
        results = execute_calls(
            calls, self.tools, timeout_s=self.timeout_s, max_calls=self.max_calls_per_turn
        )
        messages: list[Message] = []
        for call, result in zip(calls, results, strict=True):
            self.calls_made += 1
            messages.append(fmt.result_message(result, fmt.call_id(call, self.calls_made)))
        return EnvStep(messages=messages, info=tool_info(results))
