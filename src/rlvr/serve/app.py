"""The OpenAI-compatible app: /v1/models, /v1/chat/completions (tools, log-probs), recorded rollouts.

A client names its rollout with `metadata={"rollout_id": ...}` (the plain `openai` client's own
argument), `extra_body={"rollout_id": ...}` or an `X-Rollout-Id` header; every exchange under that id
is recorded token-exactly (recorder.py) and can be read back at GET /v1/rollouts/{id}. Requests
without an id are answered and not recorded. Access: serve/auth.py (with an API key set, the key is
what the Authorization header carries, so the id goes in the body or the header).

Tool calls: the request's `tools` reach the model through the chat template (or, for templates that
ignore `tools=`, written into the system message: rollout/chat.py); a reply holding Hermes
`<tool_call>{...}</tool_call>` blocks is returned as OpenAI `tool_calls` with finish_reason
"tool_calls". Log-probs are those of the temperature-scaled distribution, the ones the trainer uses.
`stream: true` is answered in OpenAI's chunk format once the reply is sampled (not token by token).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from rlvr.envs.tools import parse_tool_calls
from rlvr.rollout.chat import render_prompt_ids
from rlvr.rollout.engine import special_token_text
from rlvr.rollout.generator import Completion, SamplingParams
from rlvr.serve.auth import key_middleware
from rlvr.serve.batcher import GenerationBatcher
from rlvr.serve.completions import completions_router, use_model
from rlvr.serve.recorder import RecordedRollout, Recorder, template_messages
from rlvr.serve.shared import BadInput, error_response, top_logprobs, training_limits
from rlvr.serve.state import ServeState

DEFAULT_MAX_TOKENS = 256


class ChatRequest(BaseModel):
    """The fields of OpenAI's chat completion request that rlvr serves (others are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    rollout_id: str | None = None
    return_token_ids: bool = False


ROLLOUT_KEY_PREFIX = "rlvr-rollout-"


def rollout_id_of(request: ChatRequest, headers: Any) -> str | None:
    """The client's rollout id: body `rollout_id`, `metadata.rollout_id`, an X-Rollout-Id header, or
    an API key `rlvr-rollout-<id>` (so an agent that only reads OPENAI_API_KEY is recorded too)."""
    rid = request.rollout_id or (request.metadata or {}).get("rollout_id")
    rid = rid or headers.get("x-rollout-id")
    auth = str(headers.get("authorization") or "")
    if not rid and auth.startswith(f"Bearer {ROLLOUT_KEY_PREFIX}"):
        rid = auth[len(f"Bearer {ROLLOUT_KEY_PREFIX}") :]
    return str(rid or "") or None


def sampling_of(request: ChatRequest, state: ServeState) -> SamplingParams:
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    requested = request.max_completion_tokens or request.max_tokens
    temperature, max_tokens = training_limits(
        state, request.temperature, requested or state.max_tokens_cap or DEFAULT_MAX_TOKENS
    )
    try:
        return SamplingParams(
            n=request.n,
            temperature=temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            max_new_tokens=max_tokens,
            stop=stop,
        )
    except ValueError as err:
        raise BadInput(str(err)) from None


def reply_message(
    text: str, stops: tuple[str, ...], parse_tools: bool
) -> tuple[dict[str, Any], bool]:
    """The assistant message for sampled `text` (cut at the first stop string, as OpenAI does) and
    whether it holds tool calls. A malformed call leaves the text as content for the agent to see."""
    cut = min((text.index(s) for s in stops if s and s in text), default=len(text))
    text = text[:cut]
    calls = parse_tool_calls(text) if parse_tools and "<tool_call>" in text else []
    if calls and all(c.error is None for c in calls):
        content = text[: text.index("<tool_call>")].strip()
        tool_calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in calls
        ]
        return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}, True
    return {"role": "assistant", "content": text}, False


def _token_entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = str(tokenizer.decode([token_id]))
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _choice(
    state: ServeState,
    request: ChatRequest,
    index: int,
    prompt_ids: list[int],
    completion: Completion,
    sampling: SamplingParams,
) -> tuple[dict[str, Any], dict[str, Any]]:
    tokenizer = state.tokenizer
    text = str(tokenizer.decode(list(completion.token_ids), skip_special_tokens=True))
    parse_tools = bool(request.tools) and request.tool_choice != "none"
    message, has_calls = reply_message(text, sampling.stop, parse_tools)
    choice: dict[str, Any] = {
        "index": index,
        "message": message,
        "finish_reason": "tool_calls" if has_calls else completion.finish_reason,
    }
    if request.logprobs:
        tops: list[list[tuple[int, float]]] = []
        if request.top_logprobs:
            with state.lock, use_model(state, request.model):
                tops = top_logprobs(
                    state,
                    prompt_ids,
                    completion.token_ids,
                    sampling.temperature,
                    request.top_logprobs,
                )
        choice["logprobs"] = {
            "content": [
                {
                    **_token_entry(tokenizer, t, lp),
                    "top_logprobs": [_token_entry(tokenizer, i, v) for i, v in tops[j]]
                    if tops
                    else [],
                }
                for j, (t, lp) in enumerate(
                    zip(completion.token_ids, completion.logprobs, strict=True)
                )
            ]
        }
    if request.return_token_ids:
        choice["token_ids"] = list(completion.token_ids)
    return choice, message


def create_app(
    state: ServeState,
    record_dir: str | Path | None = None,
    *,
    api_key: str | None = None,
    open_admin: bool = False,
) -> FastAPI:
    """The app over `state`. With `record_dir`, each rollout is also written to
    RECORD_DIR/<rollout id>.json after every exchange (the whole recording, replaced in place).
    `api_key`: required on every request when set; the admin endpoints need it unless `open_admin`
    (serve/auth.py)."""
    app = FastAPI(title="rlvr serve", version="1")
    app.middleware("http")(key_middleware(api_key, open_admin))
    if state.recorder is None:
        state.recorder = Recorder()
    recorder: Recorder = state.recorder
    batcher = GenerationBatcher(state)
    app.state.batcher = batcher
    out_dir = Path(record_dir) if record_dir is not None else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)

    @app.exception_handler(BadInput)
    def _invalid(_: Request, exc: BadInput) -> JSONResponse:
        return error_response(str(exc), exc.param)

    @app.exception_handler(RequestValidationError)
    def _malformed(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(f"{where}: {first.get('msg')}", where)

    @app.on_event("shutdown")
    def _stop() -> None:
        batcher.close()

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        names = [state.model_name, *state.adapters]
        return {
            "object": "list",
            "data": [{"id": n, "object": "model", "created": 0, "owned_by": "rlvr"} for n in names],
        }

    @app.post("/v1/chat/completions")
    def chat_completions(request: ChatRequest, http: Request) -> Any:
        if request.model not in (state.model_name, *state.adapters):
            raise BadInput(
                f"model '{request.model}' is not served here (served: {state.model_name})", "model"
            )
        if not request.messages:
            raise BadInput("messages: at least one message is required", "messages")
        sampling = sampling_of(request, state)
        rollout_id = rollout_id_of(request, http.headers)
        if rollout_id is not None and request.n != 1:
            raise BadInput(
                "n: a recorded rollout takes one choice per request (n=1); use one rollout id per "
                "sample",
                "n",
            )
        tools = list(request.tools or [])
        if rollout_id is None:
            prompt_ids = render_prompt_ids(
                state.tokenizer, template_messages(request.messages), tools
            )
            completions = batcher.submit(prompt_ids, sampling, request.seed, request.model)
            choices = [
                _choice(state, request, i, prompt_ids, c, sampling)[0]
                for i, c in enumerate(completions)
            ]
        else:
            with recorder.exchange(rollout_id) as rollout:
                prompt_ids = recorder.prompt_ids(rollout, state.tokenizer, request.messages, tools)
                completions = batcher.submit(prompt_ids, sampling, request.seed, request.model)
                choice, message = _choice(state, request, 0, prompt_ids, completions[0], sampling)
                sampled = completions[0].token_ids
                eos = "" if not sampled else special_token_text(state.tokenizer, sampled[-1])
                recorder.record(
                    rollout,
                    request.messages,
                    sampled,
                    completions[0].logprobs,
                    choice["finish_reason"],
                    message,
                    eos if completions[0].finish_reason == "stop" else "",
                )
                choices = [choice]
                if out_dir is not None:
                    _write(out_dir, rollout)
        n_completion = sum(len(c.token_ids) for c in completions)
        response: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": n_completion,
                "total_tokens": len(prompt_ids) + n_completion,
            },
        }
        if request.return_token_ids:
            response["prompt_token_ids"] = prompt_ids
        if request.stream:
            return StreamingResponse(_sse_chunks(response, request), media_type="text/event-stream")
        return response

    @app.get("/v1/rollouts/{rollout_id}")
    def get_rollout(rollout_id: str) -> dict[str, Any]:
        rollout = recorder.get(rollout_id)
        if rollout is None:
            raise BadInput(f"no rollout recorded under id '{rollout_id}'", "rollout_id")
        return rollout_json(rollout)

    app.include_router(completions_router(state))  # vLLM's token-id protocol and weight sync
    return app


def _sse_chunks(response: dict[str, Any], request: ChatRequest) -> Iterator[str]:
    """`stream: true`, for clients and agent frameworks that always stream: the reply is sampled
    whole (recording needs the finished turn), then sent as OpenAI's chunk sequence: one delta per
    choice with the whole content (and tool calls), a closing chunk with the finish reason, the usage
    when `stream_options.include_usage`, then [DONE]."""
    head = {k: response[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    for choice in response["choices"]:
        message = choice["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
        first: dict[str, Any] = {"index": choice["index"], "delta": delta, "finish_reason": None}
        if "logprobs" in choice:
            first["logprobs"] = choice["logprobs"]
        yield f"data: {json.dumps({**head, 'choices': [first]})}\n\n"
        last = {"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}
        yield f"data: {json.dumps({**head, 'choices': [last]})}\n\n"
    options = getattr(request, "stream_options", None) or {}
    if isinstance(options, dict) and options.get("include_usage"):
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': response['usage']})}\n\n"
    yield "data: [DONE]\n\n"


def rollout_json(rollout: RecordedRollout) -> dict[str, Any]:
    return {
        "rollout_id": rollout.rollout_id,
        "requests": rollout.requests,
        "segments": [
            {
                "token_ids": s.token_ids,
                "prompt_length": s.prompt_length,
                "policy_mask": s.policy_mask,
                "logprobs": s.logprobs,
                "turns": [[t.start, t.end] for t in s.turns],
                "finish_reasons": s.finish_reasons,
                "messages": s.messages,
            }
            for s in rollout.segments
        ],
    }


def _write(out_dir: Path, rollout: RecordedRollout) -> None:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in rollout.rollout_id)
    path = out_dir / f"{safe}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(rollout_json(rollout)))
    tmp.replace(path)  # a reader never sees half a file
