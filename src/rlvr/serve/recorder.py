"""Token-exact trajectories of chat exchanges, kept per client rollout id.

An agent loop sends its whole conversation on every request. Re-rendering that conversation with the
chat template would re-tokenize the model's earlier replies, and a re-tokenization is not always the
token sequence that was sampled (the trainer would then score tokens the policy never produced). So
when a request continues the rollout's last exchange (its messages are the previous request's
messages, then the reply we sent, then new messages: tool results, a user turn) the prompt is the
previous prompt + the sampled tokens exactly + the template glue for the new messages, tokenized on
its own (rollout/chat.py, the same rule the built-in multi-turn engine follows). A request that
rewrites the history instead (an agent that summarises or drops turns) starts a new segment of the
rollout, rendered afresh; each segment is one trainable sequence.

Per segment the recording is what `Trajectory` holds: token ids, a policy mask (1 on sampled
tokens), the behaviour log-probs of the sampled tokens, the prompt length and one span per turn.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

from rlvr.records import Span
from rlvr.rollout.chat import observation_glue_text, render_prompt_ids


def _text(content: Any) -> str:
    """A message's content as text: OpenAI content parts ([{type: text, text}]) are joined."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def _call_key(call: Any) -> tuple[str, Any]:
    function = call.get("function", {}) if isinstance(call, dict) else {}
    arguments = function.get("arguments", "")
    with suppress(json.JSONDecodeError):
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    return str(function.get("name", "")), json.dumps(arguments, sort_keys=True)


def message_key(message: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two messages the same turn: role, text, tool calls (name + parsed arguments),
    tool_call_id. Fields the client adds on echo (refusal: None, annotations, ids) do not count."""
    calls = tuple(_call_key(c) for c in message.get("tool_calls") or ())
    return (
        message.get("role"),
        _text(message.get("content")).strip(),
        calls,
        message.get("tool_call_id") or "",
    )


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the chat template renders them: text content, and an assistant turn's tool calls
    written back in the Hermes format the model produced them in (templates without tool-call
    support would drop them)."""
    out = []
    for m in messages:
        content = _text(m.get("content"))
        calls = m.get("tool_calls") or ()
        if m.get("role") == "assistant" and calls:
            blocks = []
            for call in calls:
                name, arguments = _call_key(call)
                blocks.append(
                    f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'
                )
            content = "\n".join([content, *blocks] if content else blocks)
        message: dict[str, Any] = {"role": m.get("role", "user"), "content": content}
        if m.get("role") == "tool" and m.get("name"):
            message["name"] = m["name"]
        out.append(message)
    return out


@dataclass
class Segment:
    """One trainable token sequence of a rollout (see the module docstring)."""

    token_ids: list[int]
    prompt_length: int
    policy_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[Span] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    # The conversation after the prompt: assistant replies (as sent) and the messages that followed.
    messages: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.policy_mask:
            self.policy_mask = [0] * len(self.token_ids)
            self.logprobs = [0.0] * len(self.token_ids)


@dataclass
class RecordedRollout:
    """Everything one rollout id sent and received; `segments[-1]` is the live one."""

    rollout_id: str
    segments: list[Segment] = field(default_factory=list)
    requests: int = 0
    # The last request's messages + the reply sent: a continuation starts with exactly these.
    seen: list[tuple[Any, ...]] = field(default_factory=list)
    tools_key: str = ""
    last_eos_text: str = ""


class Recorder:
    """Rollouts by id. `exchange(rollout_id)` serialises one rollout's requests (a reply must be
    recorded before the next request of that rollout is tokenized); different rollouts run freely."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rollouts: dict[str, RecordedRollout] = {}
        self._locks: dict[str, threading.Lock] = {}

    @contextmanager
    def exchange(self, rollout_id: str) -> Iterator[RecordedRollout]:
        with self._lock:
            lock = self._locks.setdefault(rollout_id, threading.Lock())
        with lock:
            with self._lock:
                rollout = self._rollouts.setdefault(rollout_id, RecordedRollout(rollout_id))
            yield rollout

    def prompt_ids(
        self,
        rollout: RecordedRollout,
        tokenizer: Any,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]],
    ) -> list[int]:
        """The prompt for this request: a continuation of the live segment when the messages extend
        what was seen, else a new segment rendered from the messages."""
        keys = [message_key(dict(m)) for m in messages]
        tools_key = json.dumps(list(tools), sort_keys=True)
        live = rollout.segments[-1] if rollout.segments else None
        n = len(rollout.seen)
        continues = (
            live is not None
            and len(keys) > n
            and keys[:n] == rollout.seen
            and tools_key == rollout.tools_key
        )
        if continues and live is not None:
            new = template_messages(messages[n:])
            glue = observation_glue_text(
                tokenizer, new, tools, sampled_eos_text=rollout.last_eos_text
            )
            ids = [int(i) for i in tokenizer(glue, add_special_tokens=False)["input_ids"]]
            live.token_ids.extend(ids)
            live.policy_mask.extend([0] * len(ids))
            live.logprobs.extend([0.0] * len(ids))
            live.messages.extend(dict(m) for m in messages[n:])
            return list(live.token_ids)
        ids = render_prompt_ids(tokenizer, template_messages(messages), tools)
        rollout.segments.append(Segment(token_ids=list(ids), prompt_length=len(ids)))
        rollout.tools_key = tools_key
        return list(ids)

    def record(
        self,
        rollout: RecordedRollout,
        messages: Sequence[dict[str, Any]],
        sampled_ids: Sequence[int],
        logprobs: Sequence[float],
        finish_reason: str,
        reply: dict[str, Any],
        eos_text: str,
    ) -> None:
        """Append the sampled tokens to the live segment (after `prompt_ids` for this request)."""
        live = rollout.segments[-1]
        start = len(live.token_ids)
        live.token_ids.extend(int(i) for i in sampled_ids)
        live.policy_mask.extend([1] * len(sampled_ids))
        live.logprobs.extend(float(x) for x in logprobs)
        live.turns.append(Span(start, len(live.token_ids)))
        live.finish_reasons.append(finish_reason)
        live.messages.append(reply)
        rollout.requests += 1
        rollout.seen = [*(message_key(dict(m)) for m in messages), message_key(reply)]
        rollout.last_eos_text = eos_text

    def get(self, rollout_id: str) -> RecordedRollout | None:
        with self._lock:
            return self._rollouts.get(rollout_id)

    def pop(self, rollout_id: str) -> RecordedRollout | None:
        with self._lock:
            self._locks.pop(rollout_id, None)
            return self._rollouts.pop(rollout_id, None)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._rollouts)
