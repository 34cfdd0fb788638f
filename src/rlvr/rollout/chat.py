"""Chat-template plumbing for token-exact multi-turn rollouts.

The conversation's tokens are never re-rendered. After an assistant turn the rollout appends:
the template's closing of the assistant message (minus the EOS the policy already sampled), the new
observation messages as the template renders them, and the opening of the next assistant turn. That
glue is found by rendering a tiny conversation with and without the observation and taking the text
difference, then tokenized on its own (`add_special_tokens=False`), so earlier tokens never move
(TRL #5144: re-tokenizing the decoded conversation made the tool mask longer than the completion).

Templates that ignore `tools=` (SmolLM2's, plain ChatML) get the tool schemas and the call format
(Hermes unless `rollout.tool_format` says otherwise) written into the system message instead, so
every model sees its tools.

A sampled turn is decoded without special tokens, except the tool-call format's markers
(`decode_turn`): Mistral's `[TOOL_CALLS]` and Llama's `<|python_tag|>` are special tokens in their
tokenizers, and the env must see them to find the calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from rlvr.envs.tool_formats import (
    HERMES,
    HERMES_INSTRUCTIONS,
    ToolFormat,
    demonstration_messages,
)

_PLACEHOLDER = "\u2063RLVR_ASSISTANT\u2063"

TOOL_SYSTEM_PROMPT = HERMES_INSTRUCTIONS  # `{schemas}`: one JSON schema a line

Truncation = Literal["left", "right", "middle"]


def _render(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Any, gen: bool) -> str:
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": gen}
    if tools:
        kwargs["tools"] = list(tools)
    text = tokenizer.apply_chat_template([dict(m) for m in messages], **kwargs)
    return str(text)


def template_renders_tools(tokenizer: Any) -> bool:
    """True when the chat template writes `tools=` into the prompt (Qwen, Llama 3.1, Hermes...)."""
    cached = getattr(tokenizer, "_rlvr_renders_tools", None)
    if cached is not None:
        return bool(cached)
    probe = [{"role": "user", "content": "hi"}]
    schema = {
        "type": "function",
        "function": {
            "name": "rlvr_probe_tool",
            "description": "probe",
            "parameters": {"type": "object", "properties": {}},
        },
    }
    try:
        renders = "rlvr_probe_tool" in _render(tokenizer, probe, [schema], True)
    except Exception:  # a template that chokes on tools= cannot render them either
        renders = False
    tokenizer._rlvr_renders_tools = renders
    return renders


def with_tool_instructions(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]],
    tool_format: ToolFormat = HERMES,
) -> list[dict[str, Any]]:
    """`messages` with the tool schemas and `tool_format`'s call syntax in the system message when
    the template would drop the tools."""
    messages = [dict(m) for m in messages]
    if not tools or template_renders_tools(tokenizer):
        return messages
    block = tool_format.instructions(tools)
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{block}"
    else:
        messages.insert(0, {"role": "system", "content": block})
    return messages


def render_prompt_ids(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] = (),
    tool_format: ToolFormat = HERMES,
) -> list[int]:
    """Token ids of the opening conversation, ready for the first assistant turn."""
    text = prompt_text(tokenizer, messages, tools, tool_format)
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def prompt_text(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] = (),
    tool_format: ToolFormat = HERMES,
) -> str:
    messages = with_tool_instructions(tokenizer, messages, tools, tool_format)
    native_tools = tools if template_renders_tools(tokenizer) else ()
    if native_tools:  # a worked example written in Hermes, shown in the template's own format
        messages = demonstration_messages(messages, tool_format)
    return _render(tokenizer, messages, native_tools, True)


def observation_glue_text(
    tokenizer: Any,
    observation: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] = (),
    *,
    sampled_eos_text: str = "",
    turn_ends: Sequence[str] = (),
) -> str:
    """The text that follows an assistant turn's sampled tokens: closing, observation, next opening.

    `sampled_eos_text` is the decoded end-of-turn token the policy sampled (e.g. "<|im_end|>"), which
    the template's closing starts with and which must not be added twice; "" when the turn was cut
    (length limit, stop string) and the closing must be supplied whole. `turn_ends` are tokens that
    stand for one another as a turn's end (Llama's `<|eom_id|>` and `<|eot_id|>`): a turn that
    sampled one of them gets none of the others from the template either.
    """
    native_tools = tools if template_renders_tools(tokenizer) else ()
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PLACEHOLDER}]
    # Everything after the assistant content in the rendering *with* the observation: templates that
    # render a final assistant turn differently (Qwen3 adds an empty think block only there) still
    # give the glue they would write between turns.
    after = _render(tokenizer, [*base, *observation], native_tools, True)
    if after.count(_PLACEHOLDER) != 1:
        raise ValueError("the chat template dropped or repeated the assistant turn")
    glue = after[after.index(_PLACEHOLDER) + len(_PLACEHOLDER) :]
    if sampled_eos_text and glue.startswith(sampled_eos_text):
        return glue[len(sampled_eos_text) :]
    if sampled_eos_text in turn_ends:
        for end in turn_ends:
            if glue.startswith(end):
                return glue[len(end) :]
    return glue


def decode_turn(tokenizer: Any, token_ids: Sequence[int], markers: Sequence[str] = ()) -> str:
    """A sampled turn's text without special tokens, except `markers` (the tool-call format's, e.g.
    `[TOOL_CALLS]`), which stay where they were sampled. The ids are decoded in runs between the
    kept markers, so a byte-level BPE gives the same text as one decode would."""
    keep = _special_marker_ids(tokenizer, markers)
    if not keep or not keep.keys() & set(token_ids):
        return str(tokenizer.decode(list(token_ids), skip_special_tokens=True))
    pieces: list[str] = []
    run: list[int] = []
    for token in token_ids:
        if token in keep:
            pieces += [str(tokenizer.decode(run, skip_special_tokens=True)), keep[token]]
            run = []
        else:
            run.append(int(token))
    pieces.append(str(tokenizer.decode(run, skip_special_tokens=True)))
    return "".join(pieces)


def is_skipped_special(tokenizer: Any, token_id: int) -> bool:
    """True when `token_id` is a special token: listed as one, or dropped by `skip_special_tokens`."""
    if token_id in getattr(tokenizer, "all_special_ids", ()):
        return True
    dropped = str(tokenizer.decode([token_id], skip_special_tokens=True)) == ""
    return dropped and str(tokenizer.decode([token_id])) != ""


def _special_marker_ids(tokenizer: Any, markers: Sequence[str]) -> dict[int, str]:
    """{id: text} of the `markers` that are single tokens `skip_special_tokens` drops (cached on the
    tokenizer). Asked of the decoder itself: tokenizer.json may mark a token special without the
    tokenizer's config listing it among `all_special_ids`."""
    cache: dict[tuple[str, ...], dict[int, str]] = (
        getattr(tokenizer, "_rlvr_marker_ids", None) or {}
    )
    key = tuple(markers)
    if key not in cache:
        found = {}
        for marker in markers:
            ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
            if len(ids) == 1 and is_skipped_special(tokenizer, int(ids[0])):
                found[int(ids[0])] = marker
        cache[key] = found
        tokenizer._rlvr_marker_ids = cache
    return cache[key]


def truncate_text(tokenizer: Any, text: str, max_tokens: int, side: Truncation) -> str:
    """`text` cut to at most `max_tokens` tokens (plus a marker), dropping from `side`."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    marker = " ...[truncated]... "
    if side == "right":
        return str(tokenizer.decode(ids[:max_tokens])) + marker
    if side == "left":
        return marker + str(tokenizer.decode(ids[-max_tokens:]))
    head = max_tokens // 2
    return (
        str(tokenizer.decode(ids[:head]))
        + marker
        + str(tokenizer.decode(ids[len(ids) - (max_tokens - head) :]))
    )
