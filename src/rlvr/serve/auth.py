"""Who may call `rlvr serve`: an API key on every endpoint when one is set, and admin endpoints
(which change the served weights) only for a holder of the key.

- With a key (`rlvr serve --api-key`, or RLVR_API_KEY): every request must carry
  `Authorization: Bearer <key>`, OpenAI's and vLLM's scheme, so the `openai` client's `api_key=` works
  as is; anything else is a 401. /health included: the trainer's readiness poll sends the key.
- Without a key: inference is open (a loopback server for one's own agent), but the admin endpoints
  are a 403. They load files named by the caller into the served model (an adapter, a weight folder):
  whoever reaches the port could swap the weights a run samples from, or, in `rollout: external`,
  the weights it trains. An in-process app whose only client is the same program may open them
  (`open_admin`); servers the trainer launches get a random key instead (rollout/server.py).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import Request, Response

from rlvr.rollout.endpoints import API_KEY_ENV
from rlvr.serve.shared import error_response

# vLLM's runtime-LoRA and dev-mode endpoints, served by completions.py.
ADMIN_PATHS = frozenset(
    {"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/collective_rpc", "/reset_prefix_cache"}
)

Handler = Callable[[Request], Awaitable[Response]]


def _route(path: str) -> str:
    """The path as routing sees it, for comparing with ADMIN_PATHS ('//x/' and '/x' alike)."""
    return "/" + "/".join(part for part in path.split("/") if part)


def key_middleware(
    api_key: str | None, open_admin: bool = False
) -> Callable[[Request, Handler], Awaitable[Response]]:
    """An HTTP middleware enforcing the rules of the module docstring."""
    if api_key is not None and not api_key.strip():
        raise ValueError("the API key is empty: give a non-empty --api-key or unset it")
    expected = f"Bearer {api_key}".encode() if api_key is not None else b""

    async def check(request: Request, call_next: Handler) -> Response:
        if api_key is not None:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):  # constant time: no key by timing
                return error_response(
                    "invalid or missing API key: send `Authorization: Bearer <key>`", status=401
                )
        elif not open_admin and _route(request.url.path) in ADMIN_PATHS:
            return error_response(
                f"{_route(request.url.path)} changes the served weights and needs an API key: "
                f"start rlvr serve with --api-key (or {API_KEY_ENV})",
                status=403,
            )
        return await call_next(request)

    return check
