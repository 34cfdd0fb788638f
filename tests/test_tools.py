"""Tool calls (rlvr.envs.tools): parsing, argument checks, execution failures, counters, ToolEnv.

Every way a call can go wrong must become an error result of a known kind, never a crash.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from rlvr.envs.base import EnvReset, EnvStep
from rlvr.envs.tools import (
    ERROR_KINDS,
    Tool,
    ToolCall,
    ToolEnv,
    ToolResult,
    check_arguments,
    execute_calls,
    parse_tool_calls,
    tool_info,
)


# ------------------------------------------------------------------------------------------ tools
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: Ignored.
    """
    raise ValueError(f"kaput {x}")


def search(
    query: str,
    limit: int = 3,
    scale: float = 1.0,
    exact: bool = False,
    tags: list[str] | None = None,
) -> dict[str, Any]:
    """Search the catalogue.

    Args:
        query: What to look for.
        limit: How many results.
        scale: A score factor.
        exact: Whether to match exactly.
        tags: Tags to filter by.
    """
    return {"query": query, "limit": limit}


ADD = Tool.from_function(add)
BOOM = Tool.from_function(boom)
SEARCH = Tool.from_function(search)


def call_block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


# ------------------------------------------------------------------------------------------ schema
def test_schema_from_a_typed_function_with_a_google_docstring() -> None:
    assert ADD.name == "add"
    assert ADD.fn is add
    assert ADD.schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first number."},
                    "b": {"type": "integer", "description": "The second number."},
                },
                "required": ["a", "b"],
            },
            "return": {"type": "integer"},
        },
    }
    fn = SEARCH.schema["function"]
    assert fn["name"] == "search"
    assert fn["description"] == "Search the catalogue."
    props = fn["parameters"]["properties"]
    assert {k: v["type"] for k, v in props.items()} == {
        "query": "string",
        "limit": "integer",
        "scale": "number",
        "exact": "boolean",
        "tags": "array",
    }
    assert props["tags"]["items"] == {"type": "string"}
    assert props["query"]["description"] == "What to look for."
    # Only the parameter without a default is required.
    assert fn["parameters"]["required"] == ["query"]


# ------------------------------------------------------------------------------------------ parse
def test_parse_one_well_formed_call() -> None:
    text = "Let me add.\n" + call_block('{"name": "add", "arguments": {"a": 2, "b": 3}}')
    assert parse_tool_calls(text) == [ToolCall("add", {"a": 2, "b": 3})]


def test_parse_no_call() -> None:
    assert parse_tool_calls("The answer is 5.") == []
    assert parse_tool_calls("") == []


def test_parse_several_blocks_in_order() -> None:
    text = (
        call_block('{"name": "add", "arguments": {"a": 1, "b": 2}}')
        + "\nand then\n"
        + call_block('{"name": "search", "arguments": {"query": "x"}}')
        + "\n"
        + call_block('{"name": "boom", "arguments": {"x": 7}}')
    )
    calls = parse_tool_calls(text)
    assert [c.name for c in calls] == ["add", "search", "boom"]
    assert [c.arguments for c in calls] == [{"a": 1, "b": 2}, {"query": "x"}, {"x": 7}]
    assert all(c.error is None for c in calls)


def test_parse_unterminated_last_block() -> None:
    # A turn cut by a stop string or the token limit: the open block is parsed too.
    text = (
        call_block('{"name": "add", "arguments": {"a": 1, "b": 2}}')
        + '\n<tool_call>\n{"name": "add", "arguments": {"a": 10, "b": 20}}'
    )
    calls = parse_tool_calls(text)
    assert calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("add", {"a": 10, "b": 20})]
    # Cut in the middle of the JSON: malformed, not silently dropped.
    cut = parse_tool_calls('<tool_call>\n{"name": "add", "argum')
    assert len(cut) == 1
    assert cut[0].name == ""
    assert cut[0].error is not None and cut[0].error.startswith("malformed: tool call is not valid")


def test_parse_malformed_json() -> None:
    calls = parse_tool_calls(call_block("{name: add, arguments: {a: 1}}"))
    assert len(calls) == 1
    assert calls[0].name == "" and calls[0].arguments == {}
    assert calls[0].error is not None
    assert calls[0].error.startswith("malformed: tool call is not valid JSON (")


@pytest.mark.parametrize(
    "body",
    [
        '{"arguments": {"a": 1}}',  # no name
        '{"name": 5, "arguments": {}}',  # name not a string
        '["add", {"a": 1}]',  # not an object
        '"add"',
    ],
)
def test_parse_missing_or_bad_name(body: str) -> None:
    (call,) = parse_tool_calls(call_block(body))
    assert call.name == ""
    assert call.arguments == {}
    assert call.error == 'malformed: expected {"name": ..., "arguments": {...}}'


def test_parse_arguments_as_a_json_string() -> None:
    body = '{"name": "add", "arguments": "{\\"a\\": 4, \\"b\\": 5}"}'
    assert parse_tool_calls(call_block(body)) == [ToolCall("add", {"a": 4, "b": 5})]


def test_parse_parameters_alias_and_missing_arguments() -> None:
    assert parse_tool_calls(call_block('{"name": "add", "parameters": {"a": 1, "b": 2}}')) == [
        ToolCall("add", {"a": 1, "b": 2})
    ]
    assert parse_tool_calls(call_block('{"name": "now"}')) == [ToolCall("now", {})]


@pytest.mark.parametrize("arguments", ["[1, 2]", "3", '"not json"', "null", '"[1, 2]"'], ids=str)
def test_parse_non_object_arguments(arguments: str) -> None:
    (call,) = parse_tool_calls(call_block(f'{{"name": "add", "arguments": {arguments}}}'))
    assert call.name == "add"  # the name is kept so the error can say which tool
    assert call.arguments == {}
    assert call.error == "malformed: 'arguments' must be a JSON object"


# ------------------------------------------------------------------------------------------ check
def test_check_arguments_accepts_a_fitting_call() -> None:
    assert check_arguments(ADD, {"a": 1, "b": 2}) is None
    assert check_arguments(ADD, {"b": -4, "a": 0}) is None
    # Defaults may be left out; Optional accepts None; float accepts an int.
    assert check_arguments(SEARCH, {"query": "q"}) is None
    assert check_arguments(SEARCH, {"query": "q", "scale": 2, "tags": None}) is None
    assert check_arguments(SEARCH, {"query": "q", "scale": 0.5, "tags": ["a"]}) is None
    assert check_arguments(SEARCH, {"query": "q", "exact": True}) is None


def test_check_arguments_wrong_types() -> None:
    assert check_arguments(ADD, {"a": "1", "b": 2}) == "argument 'a' should be int, got str '1'"
    assert check_arguments(ADD, {"a": 1, "b": 2.5}) == "argument 'b' should be int, got float 2.5"
    # bool is a subclass of int in Python, but not an integer argument.
    assert check_arguments(ADD, {"a": True, "b": 2}) == "argument 'a' should be int, got bool True"
    problem = check_arguments(SEARCH, {"query": "q", "scale": False})
    assert problem is not None and problem.startswith("argument 'scale' should be float, got bool")
    problem = check_arguments(SEARCH, {"query": "q", "exact": 1})
    assert problem is not None and problem.startswith("argument 'exact' should be bool, got int")
    problem = check_arguments(SEARCH, {"query": 3})
    assert problem is not None and problem.startswith("argument 'query' should be str, got int")
    problem = check_arguments(SEARCH, {"query": "q", "tags": "a"})
    assert problem is not None and problem.startswith("argument 'tags' should be ")


def test_check_arguments_missing_and_unexpected() -> None:
    assert check_arguments(ADD, {"a": 1}) == "missing argument(s) b"
    assert check_arguments(ADD, {}) == "missing argument(s) a, b"
    assert check_arguments(ADD, {"a": 1, "b": 2, "c": 3}) == (
        "unexpected argument(s) c; add takes a, b"
    )
    assert check_arguments(ADD, {"a": 1, "z": 2, "c": 3}) == (
        "unexpected argument(s) c, z; add takes a, b"
    )


# ------------------------------------------------------------------------------------------ execute
def run(calls: list[ToolCall], tools: list[Tool], **kw: Any) -> list[ToolResult]:
    kw.setdefault("timeout_s", 2.0)
    kw.setdefault("max_calls", 4)
    return execute_calls(calls, tools, **kw)


def test_execute_success_results_are_json() -> None:
    results = run(
        [ToolCall("add", {"a": 2, "b": 3}), ToolCall("search", {"query": "cat", "limit": 1})],
        [ADD, SEARCH],
    )
    assert results == [
        ToolResult("add", "5", None),
        ToolResult("search", '{"query": "cat", "limit": 1}', None),
    ]


def test_execute_string_results_pass_through() -> None:
    def echo(text: str) -> str:
        """Echo.

        Args:
            text: What to echo.
        """
        return text

    (result,) = run([ToolCall("echo", {"text": '"quoted"'})], [Tool.from_function(echo)])
    assert result == ToolResult("echo", '"quoted"', None)


def test_execute_unknown_tool() -> None:
    (result,) = run([ToolCall("mul", {"a": 1})], [ADD, BOOM])
    assert result.error_kind == "unknown_tool"
    assert result.name == "mul"
    assert result.content == "Error: unknown tool 'mul' (available: add, boom)"


def test_execute_malformed_call() -> None:
    (call,) = parse_tool_calls(call_block("{oops"))
    (result,) = run([call], [ADD])
    assert result.error_kind == "malformed"
    assert result.content.startswith("Error: malformed: tool call is not valid JSON")


def test_execute_bad_arguments_do_not_run_the_tool() -> None:
    ran = []

    def record(n: int) -> int:
        """Record.

        Args:
            n: A number.
        """
        ran.append(n)
        return n

    tool = Tool.from_function(record)
    results = run(
        [
            ToolCall("record", {"n": "1"}),
            ToolCall("record", {"n": True}),
            ToolCall("record", {}),
            ToolCall("record", {"n": 1, "m": 2}),
        ],
        [tool],
    )
    assert [r.error_kind for r in results] == ["bad_arguments"] * 4
    assert results[0].content == "Error: argument 'n' should be int, got str '1'"
    assert results[1].content == "Error: argument 'n' should be int, got bool True"
    assert results[2].content == "Error: missing argument(s) n"
    assert results[3].content == "Error: unexpected argument(s) m; record takes n"
    assert ran == []


def test_execute_a_tool_that_raises() -> None:
    (result,) = run([ToolCall("boom", {"x": 42})], [BOOM])
    assert result.error_kind == "raised"
    assert result.content == "Error: ValueError: kaput 42"


def test_execute_a_tool_past_its_timeout_returns_promptly() -> None:
    release = threading.Event()

    def slow(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        release.wait(seconds)
        return "done"

    tool = Tool.from_function(slow)
    try:
        t0 = time.monotonic()
        (result,) = run([ToolCall("slow", {"seconds": 5.0})], [tool], timeout_s=0.2)
        elapsed = time.monotonic() - t0
    finally:
        release.set()  # let the abandoned thread end
    assert result == ToolResult("slow", "Error: slow timed out after 0.2s", "timeout")
    assert 0.2 <= elapsed < 1.5  # waited for the timeout, not for the 5 s sleep


def test_execute_too_many_calls_are_not_run() -> None:
    counter = {"n": 0}

    def tick(step: int) -> int:
        """Count calls.

        Args:
            step: Added to the counter.
        """
        counter["n"] += step
        return counter["n"]

    tool = Tool.from_function(tick)
    calls = [ToolCall("tick", {"step": 1}) for _ in range(5)]
    results = run(calls, [tool], max_calls=2)
    assert counter["n"] == 2  # only the first two ran
    assert [r.content for r in results[:2]] == ["1", "2"]
    assert [r.error_kind for r in results] == [None, None] + ["too_many_calls"] * 3
    assert results[4].content == "Error: at most 2 tool call(s) per turn; this one was not run"


def test_execute_keeps_order_and_one_failure_does_not_stop_the_rest() -> None:
    calls = [
        ToolCall("boom", {"x": 1}),
        ToolCall("add", {"a": 1, "b": 1}),
        ToolCall("nope", {}),
        ToolCall("add", {"a": 5, "b": 5}),
    ]
    results = run(calls, [ADD, BOOM])
    assert [(r.name, r.error_kind) for r in results] == [
        ("boom", "raised"),
        ("add", None),
        ("nope", "unknown_tool"),
        ("add", None),
    ]
    assert [results[1].content, results[3].content] == ["2", "10"]


# ------------------------------------------------------------------------------------------ info
def test_tool_info_counts_calls_failures_and_kinds() -> None:
    results = [
        ToolResult("add", "5"),
        ToolResult("x", "Error", "unknown_tool"),
        ToolResult("add", "Error", "bad_arguments"),
        ToolResult("add", "Error", "bad_arguments"),
        ToolResult("slow", "Error", "timeout"),
        ToolResult("add", "7"),
    ]
    info = tool_info(results)
    assert info == {
        "tool_calls": 6,
        "tool_failures": 4,
        "tool_errors/malformed": 0,
        "tool_errors/unknown_tool": 1,
        "tool_errors/bad_arguments": 2,
        "tool_errors/raised": 0,
        "tool_errors/timeout": 1,
        "tool_errors/too_many_calls": 0,
    }
    assert set(ERROR_KINDS) == {k.split("/", 1)[1] for k in info if k.startswith("tool_errors/")}
    empty = tool_info([])
    assert empty["tool_calls"] == 0 and empty["tool_failures"] == 0


# ------------------------------------------------------------------------------------------ ToolEnv
class AddEnv(ToolEnv):
    max_turns = 4

    def __init__(self) -> None:
        super().__init__([ADD, BOOM])
        self.finished_with: list[str] = []

    def reset(self) -> EnvReset:
        return EnvReset([{"role": "user", "content": "2 + 3?"}], self.tool_schemas)

    def finish(self, assistant_text: str) -> EnvStep:
        self.finished_with.append(assistant_text)
        return EnvStep(rewards={"success": float("5" in assistant_text)}, done=True)


def test_tool_env_turn_with_calls_returns_tool_messages() -> None:
    env = AddEnv()
    assert env.reset().tools == [ADD.schema, BOOM.schema]
    text = (
        call_block('{"name": "add", "arguments": {"a": 2, "b": 3}}')
        + call_block('{"name": "boom", "arguments": {"x": 0}}')
        + call_block("{broken")
    )
    step = env.step(text)
    assert step.done is False
    assert step.rewards == {}
    assert step.messages == [
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "tool", "name": "boom", "content": "Error: ValueError: kaput 0"},
        {
            "role": "tool",
            "name": "unknown",  # a call without a parsable name
            "content": step.messages[2]["content"],
        },
    ]
    assert step.messages[2]["content"].startswith("Error: malformed:")
    assert step.info["tool_calls"] == 3
    assert step.info["tool_failures"] == 2
    assert step.info["tool_errors/raised"] == 1
    assert step.info["tool_errors/malformed"] == 1
    assert env.finished_with == []


def test_tool_env_respects_its_per_turn_limits() -> None:
    env = AddEnv()
    env.max_calls_per_turn = 1
    step = env.step(
        call_block('{"name": "add", "arguments": {"a": 1, "b": 1}}')
        + call_block('{"name": "add", "arguments": {"a": 2, "b": 2}}')
    )
    assert [m["content"] for m in step.messages] == [
        "2",
        "Error: at most 1 tool call(s) per turn; this one was not run",
    ]
    assert step.info["tool_errors/too_many_calls"] == 1


def test_tool_env_turn_without_a_call_goes_to_finish() -> None:
    env = AddEnv()
    step = env.step("The answer is 5.")
    assert env.finished_with == ["The answer is 5."]
    assert step.done is True
    assert step.messages == []
    assert step.rewards == {"success": 1.0}


def kw_tool(a: int, **options: Any) -> int:
    """Takes extra options.

    Args:
        a: A number.
        options: Extra keyword options.
    """
    return a


def test_check_arguments_with_var_keyword_parameter() -> None:
    tool = Tool.from_function(kw_tool)
    assert check_arguments(tool, {"a": 1}) is None
    assert check_arguments(tool, {"a": 1, "verbose": True}) is None
