"""An agent loop written with the plain `openai` client: nothing in it knows about rlvr.

It answers an arithmetic question with a calculator tool: the model may call `calculator`, the agent
runs it and sends the result back, until the model answers (or runs out of turns). The only line
that concerns training is `metadata={"rollout_id": rollout_id}`: under that id the endpoint records
the conversation token for token, and `rollout: external` (train.yaml) trains on it.

    rlvr serve smollm2-135m-instruct --port 8000 &
    python examples/byo_agent/agent.py --base-url http://127.0.0.1:8000/v1 --model smollm2-135m-instruct
    rlvr train examples/byo_agent/train.yaml        # the same function, under the trainer
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
from functools import cache
from typing import Any

from openai import OpenAI

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
            "required": ["expression"],
        },
    },
}
SYSTEM = "Solve the problem. You may use the calculator tool. End with the final number."
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def calculator(expression: str) -> str:
    """A safe evaluator: numbers and + - * / only (no eval of arbitrary code)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"unsupported expression: {expression!r}")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as err:
        return f"Error: {err}"
    return str(int(result)) if result == int(result) else f"{result:.6g}"


@cache
def client_for(base_url: str) -> OpenAI:
    """One client per endpoint, shared by the agent's threads (building one costs ~50 ms)."""
    return OpenAI(base_url=base_url, api_key="not-needed")


def run_episode(
    base_url: str, model: str, question: str, rollout_id: str | None = None, max_turns: int = 4
) -> list[dict[str, Any]]:
    """Play one episode; returns the conversation (the final answer is the last message)."""
    client = client_for(base_url)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
    ]
    for _ in range(max_turns):
        response = client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            tools=[CALCULATOR],  # type: ignore[list-item]
            max_tokens=64,
            metadata={"rollout_id": rollout_id} if rollout_id else None,
        )
        reply = response.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            arguments = json.loads(call.function.arguments or "{}")
            result = calculator(str(arguments.get("expression", "")))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return messages


def agent(base_url: str, model: str, task: Any, rollout_id: str) -> None:
    """The entry point `rollout: external` calls (external.agent in train.yaml); the run's rubric
    (numeric_match on the last reply) scores it, so it returns nothing."""
    question = next(m["content"] for m in task.messages if m["role"] == "user")
    run_episode(base_url, model, question, rollout_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--question", default="What is 17 * 23?")
    parser.add_argument("--rollout-id", default="demo-1")
    args = parser.parse_args()
    for message in run_episode(args.base_url, args.model, args.question, args.rollout_id):
        print(f"{message['role']:>9}: {message.get('content') or message.get('tool_calls')}")
    print(f"recorded: GET {args.base_url}/rollouts/{args.rollout_id}")


if __name__ == "__main__":
    main()
