"""A two-turn agent for the tiny random model (tests and a quick look): it asks, then asks again for
digits only, and scores the last reply itself (the share of digits), as an ART-style agent does.

    rlvr train examples/byo_agent/tiny.yaml
"""

from __future__ import annotations

from functools import cache
from typing import Any

from openai import OpenAI


@cache
def client_for(base_url: str) -> OpenAI:
    """One client per endpoint, shared by the agent's threads (building one costs ~50 ms)."""
    return OpenAI(base_url=base_url, api_key="not-needed", max_retries=0)


def digit_share(text: str) -> float:
    text = text.strip()
    return sum(ch.isdigit() for ch in text) / len(text) if text else 0.0


def agent(base_url: str, model: str, task: Any, rollout_id: str) -> float:
    client = client_for(base_url)
    messages: list[dict[str, Any]] = [dict(m) for m in task.messages]
    reply = ""
    for follow_up in ("Digits only, please.", None):
        response = client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            logprobs=True,
            metadata={"rollout_id": rollout_id},
        )
        reply = response.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": reply})
        if follow_up is not None:
            messages.append({"role": "user", "content": follow_up})
    return digit_share(reply)
