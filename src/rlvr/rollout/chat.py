"""Chat-template plumbing for token-exact multi-turn rollouts.

The conversation's tokens are never re-rendered. After an assistant turn the rollout appends:
the template's closing of the assistant message (minus the EOS the policy already sampled), the new
observation messages as the template renders them, and the opening of the next assistant turn. That
glue is found by rendering a tiny conversation with and without the observation and taking the text
difference, then tokenized on its own (`add_special_tokens=False`), so earlier tokens never move
(TRL #5144: re-tokenizing the decoded conversation made the tool mask longer than the completion).

Templates that ignore `tools=` (SmolLM2's, plain ChatML) get the tool schemas and the Hermes call
format written into the system message instead, so every model sees its tools.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

_PLACEHOLDER = "\u2063RLVR_ASSISTANT\u2063"

TOOL_SYSTEM_PROMPT = (
    "You can call these tools:\n<tools>\n{schemas}\n</tools>\n"
    "To call a tool, reply with only\n<tool_call>\n"
    '{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>\n'
    "and the result comes back in the next message."
)

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
    tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """`messages` with the tool schemas in the system message when the template would drop them."""
    messages = [dict(m) for m in messages]
    if not tools or template_renders_tools(tokenizer):
        return messages
    schemas = "\n".join(json.dumps(t) for t in tools)
    block = TOOL_SYSTEM_PROMPT.format(schemas=schemas)
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{block}"
    else:
        messages.insert(0, {"role": "system", "content": block})
    return messages


def render_prompt_ids(
    tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] = ()
) -> list[int]:
    """Token ids of the opening conversation, ready for the first assistant turn."""
    text = prompt_text(tokenizer, messages, tools)
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def prompt_text(
    tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] = ()
) -> str:
    messages = with_tool_instructions(tokenizer, messages, tools)
    native_tools = tools if template_renders_tools(tokenizer) else ()
    return _render(tokenizer, messages, native_tools, True)


def observation_glue_text(
    tokenizer: Any,
    observation: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] = (),
    *,
    sampled_eos_text: str = "",
) -> str:
    """The text that follows an assistant turn's sampled tokens: closing, observation, next opening.

    `sampled_eos_text` is the decoded end-of-turn token the policy sampled (e.g. "<|im_end|>"), which
    the template's closing starts with and which must not be added twice; "" when the turn was cut
    (length limit, stop string) and the closing must be supplied whole.
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
        glue = glue[len(sampled_eos_text) :]
    return glue


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
