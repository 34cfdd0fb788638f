"""Tool-call formats: how each model family writes a call, and how the result goes back to it.

A model calls tools in the format its chat template was trained on; reading the calls in any other
format would leave it unable to use a tool at all. Four formats, each checked against the family's
real chat template (tests/data/tokenizers/, tests/test_tool_formats.py):

    hermes       <tool_call>\\n{"name": "add", "arguments": {"a": 2}}\\n</tool_call>   (Qwen2.5, Hermes,
                 and templates that ignore tools=, which get this format in the system message)
    qwen3        hermes, but calls inside a <think>...</think> block are thoughts, not calls
    llama3_json  the whole turn is {"name": "add", "parameters": {"a": 2}}, optionally after
                 <|python_tag|>; several calls separated by ";" (Llama 3.1 / 3.2 / 3.3 custom tools)
    mistral      [TOOL_CALLS][{"name": "add", "arguments": {"a": 2}, "id": "abc123xyz"}]  (Mistral 7B v0.3,
                 Nemo), or the newer [TOOL_CALLS]add[CALL_ID]abc123xyz[ARGS]{"a": 2} (Small 3.2)

`detect_tool_format` picks one from the chat template's text; `rollout.tool_format` overrides it.

Results go back as {"role": "tool", "name", "content"} messages, which each template renders its own
way (Llama as an `ipython` turn, Qwen as `<tool_response>` inside a user turn, Mistral as
`[TOOL_RESULTS]`). Mistral's templates refuse a result without a 9-character alphanumeric
`tool_call_id`: the call's own id when the model wrote a valid one, else `call00001`, `call00002`...
numbered over the episode.

Markers that are special tokens in the family's tokenizer (`[TOOL_CALLS]`, `<|python_tag|>`) would
vanish from `decode(skip_special_tokens=True)`; `ToolFormat.markers` names them so the engine keeps
them in the text an env parses (rlvr.rollout.chat.decode_turn).

A call that cannot be read becomes a `ToolCall` with `error` set (one line, starting "malformed:"),
which the env returns to the model as an `Error: ...` observation; parsing never raises.
"""

from __future__ import annotations

import contextlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

Message = dict[str, Any]
ToolFormatName = Literal["hermes", "qwen3", "llama3_json", "mistral"]
ToolFormatChoice = Literal["auto", "hermes", "qwen3", "llama3_json", "mistral"]

HERMES_INSTRUCTIONS = (
    "You can call these tools:\n<tools>\n{schemas}\n</tools>\n"
    "To call a tool, reply with only\n<tool_call>\n"
    '{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>\n'
    "and the result comes back in the next message."
)
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


@dataclass(frozen=True)
class ToolCall:
    """One parsed call, or the reason it could not be parsed (`error` set, `name` maybe empty).

    `id` is the id the model wrote for the call (Mistral's formats), "" when it wrote none."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None
    id: str = ""


@dataclass(frozen=True)
class ToolResult:
    """A call's result as it goes back to the model (rlvr.envs.tools runs the calls). Defined here,
    with `ToolCall`, because every format writes it (`result_message`)."""

    name: str
    content: str
    error_kind: str | None = None  # one of rlvr.envs.tools.ERROR_KINDS, None on success


def _json_values(text: str) -> tuple[list[Any], str | None, str]:
    """The JSON values at the start of `text`, separated by whitespace or ";" (Llama's separator).

    Returns (values, error, rest): `error` is a one-line reason when a value failed to parse (the
    values before it are kept), `rest` the text after the last value read."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    pos = 0
    while True:
        while pos < len(text) and (text[pos].isspace() or (values and text[pos] == ";")):
            pos += 1
        if pos >= len(text) or text[pos] not in "{[":
            return values, None, text[pos:]
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            return values, f"malformed: tool call is not valid JSON ({err.msg})", ""
        except (ValueError, RecursionError):  # absurd nesting or integer sizes from the model
            return values, "malformed: tool call JSON is too deep or too large", ""
        values.append(value)


def _load_json(text: str) -> tuple[Any, str | None]:
    """`text` as one JSON value, or (None, a one-line reason)."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as err:
        return None, f"malformed: tool call is not valid JSON ({err.msg})"
    except (ValueError, RecursionError):  # absurd nesting or integer sizes from the model
        return None, "malformed: tool call JSON is too deep or too large"


def _call_from_payload(payload: Any, expected: str) -> ToolCall:
    """A `ToolCall` from one decoded JSON call; `expected` spells the format for the error line."""
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall("", {}, f"malformed: expected {expected}")
    name = payload["name"]
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string
        with contextlib.suppress(ValueError, RecursionError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, "malformed: 'arguments' must be a JSON object")
    call_id = payload.get("id")
    return ToolCall(name, arguments, id=call_id if isinstance(call_id, str) else "")


def _dumps(value: Any) -> str:
    # transformers' `tojson` filter: json.dumps with ensure_ascii=False and default separators.
    return json.dumps(value, ensure_ascii=False)


class ToolFormat(ABC):
    """One family's tool-call format: how calls are read from a turn and written, how results go back.

    `markers`: special tokens of the format the env must see (kept when a turn is decoded).
    `turn_ends`: tokens that close an assistant turn; a turn that ended on any of them needs no
    other closing (Llama's `<|eom_id|>` stands for the template's `<|eot_id|>`).
    `needs_call_ids`: results carry `tool_call_id` (the template refuses them without one).
    """

    name: ClassVar[ToolFormatName]
    markers: ClassVar[tuple[str, ...]] = ()
    turn_ends: ClassVar[tuple[str, ...]] = ()
    needs_call_ids: ClassVar[bool] = False
    expected: ClassVar[str] = ""  # the call's shape, quoted in malformed-call errors
    call_syntax: ClassVar[str] = ""  # the call's shape as `rlvr env check` shows it

    @abstractmethod
    def parse(self, text: str) -> list[ToolCall]:
        """Every call in an assistant turn's text, in order; [] when the turn is not a call."""

    @abstractmethod
    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        """The text a model of this family writes for `calls`: what its chat template renders for an
        assistant message holding them (tested against the real templates)."""

    def instructions(self, schemas: Sequence[dict[str, Any]]) -> str:
        """The tools and this call format, for the system message of a template that ignores
        `tools=` (SmolLM2's, plain ChatML)."""
        example = self.render_calls([ToolCall("<tool name>", {"<argument>": "<value>"})])
        return (
            "You can call these tools:\n<tools>\n"
            + "\n".join(_dumps(s) for s in schemas)
            + f"\n</tools>\nTo call a tool, reply with only\n{example}\n"
            + "and the result comes back in the next message."
        )

    def call_id(self, call: ToolCall, number: int) -> str:
        """The id a result is filed under: the model's own when valid, else numbered (1-based)."""
        if _MISTRAL_ID.fullmatch(call.id):
            return call.id
        return f"call{number % 100_000:05d}"

    def result_message(self, result: ToolResult, call_id: str) -> Message:
        """The observation message for one call's result."""
        message: Message = {
            "role": "tool",
            "name": result.name or "unknown",
            "content": result.content,
        }
        if self.needs_call_ids:
            message["tool_call_id"] = call_id
        return message

    @abstractmethod
    def content_without_calls(self, text: str) -> str:
        """The turn's text outside its calls (the `content` of a structured assistant message)."""

    def assistant_message(self, text: str, call_ids: Sequence[str] = ()) -> Message:
        """An assistant turn as an OpenAI-style message: `tool_calls` (arguments as objects, the
        form chat templates render) when the turn holds well-formed calls, else plain content.
        `call_ids[i]` becomes the id of call i (Mistral's templates need them)."""
        calls = self.parse(text)
        if not calls or any(c.error is not None for c in calls):
            return {"role": "assistant", "content": text}
        tool_calls = []
        for i, call in enumerate(calls):
            entry: dict[str, Any] = {
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            if i < len(call_ids):
                entry["id"] = call_ids[i]
            tool_calls.append(entry)
        return {
            "role": "assistant",
            "content": self.content_without_calls(text),
            "tool_calls": tool_calls,
        }


class HermesFormat(ToolFormat):
    name: ClassVar[ToolFormatName] = "hermes"
    markers: ClassVar[tuple[str, ...]] = ("<tool_call>", "</tool_call>")
    expected = '{"name": ..., "arguments": {...}}'
    call_syntax = (
        '<tool_call>\n{"name": "<tool name>", "arguments": {<arguments as JSON>}}\n</tool_call>'
    )
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        """Every `<tool_call>` block, in order. An unterminated last block is parsed too (the turn may
        have stopped on a stop string or the token limit)."""
        calls = []
        for match in self._block.finditer(self._call_region(text)):
            payload, error = _load_json(match.group(1).strip())
            calls.append(
                ToolCall("", {}, error) if error else _call_from_payload(payload, self.expected)
            )
        return calls

    def _call_region(self, text: str) -> str:
        return text

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        return "\n".join(
            '<tool_call>\n{"name": "'
            + call.name
            + '", "arguments": '
            + _dumps(call.arguments)
            + "}\n</tool_call>"
            for call in calls
        )

    def instructions(self, schemas: Sequence[dict[str, Any]]) -> str:
        return HERMES_INSTRUCTIONS.format(schemas="\n".join(json.dumps(s) for s in schemas))

    def content_without_calls(self, text: str) -> str:
        return self._block.sub("", text).strip()


class Qwen3Format(HermesFormat):
    """Hermes calls outside the thinking: Qwen3's template takes the text after the last `</think>`
    as the answer (and so do we); an unclosed `<think>` hides everything after it."""

    name = "qwen3"
    markers = ("<tool_call>", "</tool_call>", "<think>", "</think>")
    call_syntax = HermesFormat.call_syntax + "  (after </think>; calls while thinking are ignored)"

    def _call_region(self, text: str) -> str:
        return text[_after_thinking(text) :].split("<think>", 1)[0]

    def content_without_calls(self, text: str) -> str:
        # Qwen3's template renders content, then "\n", then the calls: the content is everything
        # before the first call outside the thinking, the think block included.
        start = _after_thinking(text)
        first_call = text[start:].split("<think>", 1)[0].find("<tool_call>")
        return text[: start + first_call].rstrip("\n") if first_call >= 0 else text


def _after_thinking(text: str) -> int:
    """Where the answer starts: after the last `</think>` (0 when there is none)."""
    end = text.rfind("</think>")
    return end + len("</think>") if end >= 0 else 0


class Llama3JsonFormat(ToolFormat):
    """Llama 3.x custom tools: the turn *is* the call, a JSON object (vLLM's llama3_json parser reads
    the same). A turn that starts with `{` or `<|python_tag|>` is a call; any other turn is an
    answer. Built-in tools' `<|python_tag|>brave_search.call(...)` syntax is not read (malformed)."""

    name = "llama3_json"
    markers = ("<|python_tag|>",)
    turn_ends = ("<|eot_id|>", "<|eom_id|>")
    expected = '{"name": ..., "parameters": {...}}'
    call_syntax = '{"name": "<tool name>", "parameters": {<arguments as JSON>}}  (the whole turn)'

    def parse(self, text: str) -> list[ToolCall]:
        body = text.strip()
        tagged = body.startswith("<|python_tag|>")
        if tagged:
            body = body[len("<|python_tag|>") :].lstrip()
        elif not body.startswith("{"):
            return []
        values, error, _rest = _json_values(body)
        calls = [_call_from_payload(v, self.expected) for v in values]
        if error is not None:
            calls.append(ToolCall("", {}, error))
        if not calls:  # a python_tag followed by code, not JSON
            calls.append(ToolCall("", {}, f"malformed: expected {self.expected}"))
        return calls

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        return "; ".join(
            '{"name": "' + c.name + '", "parameters": ' + _dumps(c.arguments) + "}" for c in calls
        )

    def content_without_calls(self, text: str) -> str:
        return ""


class MistralFormat(ToolFormat):
    """`[TOOL_CALLS]` then a JSON list of calls (Mistral 7B v0.3, Nemo), or one call per marker as
    `name[CALL_ID]id[ARGS]{arguments}` / `name[ARGS]{arguments}` (Small 3.2, Devstral)."""

    name = "mistral"
    markers = ("[TOOL_CALLS]", "[CALL_ID]", "[ARGS]")
    needs_call_ids = True
    expected = '[{"name": ..., "arguments": {...}}]'
    call_syntax = '[TOOL_CALLS][{"name": "<tool name>", "arguments": {<arguments as JSON>}}]'

    def parse(self, text: str) -> list[ToolCall]:
        calls: list[ToolCall] = []
        for segment in text.split("[TOOL_CALLS]")[1:]:
            segment = segment.strip()
            if segment.startswith("["):
                values, error, _rest = _json_values(segment)
                if error is not None:
                    calls.append(ToolCall("", {}, error))
                    continue
                items = values[0] if isinstance(values[0], list) else [values[0]]
                calls += [_call_from_payload(item, self.expected) for item in items]
                if not items:
                    calls.append(ToolCall("", {}, "malformed: an empty list of tool calls"))
            elif "[ARGS]" in segment:
                head, arguments = segment.split("[ARGS]", 1)
                name, _, call_id = head.partition("[CALL_ID]")
                values, error, _rest = _json_values(arguments)
                if error is not None or not values:
                    calls.append(
                        ToolCall(name.strip(), {}, error or "malformed: no JSON after [ARGS]")
                    )
                    continue
                payload = {"name": name.strip(), "arguments": values[0], "id": call_id.strip()}
                calls.append(_call_from_payload(payload, self.expected))
            else:
                calls.append(ToolCall("", {}, f"malformed: expected [TOOL_CALLS]{self.expected}"))
        return calls

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        """The Nemo / 7B v0.3 list form (Nemo's spacing); `id` written when the call has one."""
        items = []
        for c in calls:
            item = '{"name": "' + c.name + '", "arguments": ' + _dumps(c.arguments)
            items.append(item + (f', "id": "{c.id}"' if c.id else "") + "}")
        return "[TOOL_CALLS][" + ", ".join(items) + "]"

    def content_without_calls(self, text: str) -> str:
        return text.split("[TOOL_CALLS]", 1)[0].strip()


TOOL_FORMATS: dict[str, ToolFormat] = {
    f.name: f for f in (HermesFormat(), Qwen3Format(), Llama3JsonFormat(), MistralFormat())
}
HERMES = TOOL_FORMATS["hermes"]


def template_text(tokenizer: Any) -> str:
    """The chat template's source: a tokenizer may hold several named ones (the tool-use one wins)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return str(template.get("tool_use") or "\n".join(str(t) for t in template.values()))
    return str(template or "")


def detect_tool_format(template: str) -> ToolFormatName:
    """The format a chat template's text speaks, by the markers it writes; hermes when none match
    (templates that ignore tools get the Hermes instructions in the system message)."""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "qwen3" if "<think>" in template else "hermes"
    if "<|python_tag|>" in template or ("ipython" in template and "<|eot_id|>" in template):
        return "llama3_json"
    return "hermes"


def resolve_tool_format(choice: str, tokenizer: Any) -> ToolFormat:
    """`rollout.tool_format`: a format by name, or "auto" (detected from the tokenizer's template)."""
    if choice == "auto":
        choice = detect_tool_format(template_text(tokenizer))
    if choice not in TOOL_FORMATS:
        raise ValueError(f"unknown tool format {choice!r}; known: auto, {', '.join(TOOL_FORMATS)}")
    return TOOL_FORMATS[choice]


def openai_messages(messages: Sequence[Message], fmt: ToolFormat) -> list[Message]:
    """A trajectory's messages (assistant turns as the text sampled) with each assistant turn that
    holds well-formed calls turned into a `tool_calls` message, its ids taken from the `tool_call_id`
    of the results that follow it (the form OpenAI clients and Mistral's templates expect)."""
    out: list[Message] = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant" or "tool_calls" in message:
            out.append(dict(message))
            continue
        following = []
        for later in messages[i + 1 :]:
            if later.get("role") != "tool":
                break
            following.append(str(later.get("tool_call_id", "")))
        out.append(fmt.assistant_message(str(message.get("content", "")), following))
    return out


def from_hermes(text: str, fmt: ToolFormat) -> str:
    """`text` with its well-formed Hermes `<tool_call>` blocks rewritten in `fmt` (the text outside
    the calls kept before them where the format has room for it: Mistral's). Scripted solvers and
    demonstrations are written once, in Hermes; this shows them to each family in its own format."""
    calls = HERMES.parse(text)
    if fmt.name in ("hermes", "qwen3") or not calls or any(c.error for c in calls):
        return text
    content = HERMES.content_without_calls(text)
    rendered = fmt.render_calls(calls)
    return f"{content}{rendered}" if content and fmt.name == "mistral" else rendered


def demonstration_messages(messages: Sequence[Message], fmt: ToolFormat) -> list[Message]:
    """Opening messages whose assistant turns show Hermes `<tool_call>` blocks (a worked example in
    the prompt) as `tool_calls` messages, the results after them given ids (`demo00001`...), so a
    template that renders calls itself shows the example in its own format: Llama's JSON turn,
    Mistral's `[TOOL_CALLS]` with the ids its template insists on. Hermes and Qwen3 templates would
    render the same text as written, so their messages are left alone."""
    if fmt.name in ("hermes", "qwen3"):
        return [dict(m) for m in messages]
    out: list[Message] = []
    pending: list[str] = []
    number = 0
    for message in messages:
        message = dict(message)
        if message.get("role") == "assistant" and "tool_calls" not in message:
            calls = HERMES.parse(str(message.get("content") or ""))
            if calls and all(c.error is None for c in calls):
                pending = [f"demo{number + i + 1:05d}" for i in range(len(calls))]
                number += len(calls)
                message = HERMES.assistant_message(str(message["content"]), pending)
        elif message.get("role") == "tool" and pending:
            message.setdefault("tool_call_id", pending.pop(0))
        out.append(message)
    return out
