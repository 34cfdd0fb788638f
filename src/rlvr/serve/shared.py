"""What the chat endpoint (app.py) and the token-id completions endpoint (completions.py) share:
the client-error type and body, the training endpoint's limits, seeded sampling, top log-probs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from fastapi.responses import JSONResponse

from rlvr.devices import device_of
from rlvr.serve.state import ServeState


class BadInput(Exception):
    """A client error, answered with 400 and OpenAI's error body (one line)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_response(message: str, param: str | None = None, status: int = 400) -> JSONResponse:
    body = {"message": message, "type": "invalid_request_error", "param": param, "code": status}
    return JSONResponse({"error": body}, status_code=status)


@torch.no_grad()
def top_logprobs(
    state: ServeState,
    prompt_ids: list[int],
    completion_ids: tuple[int, ...],
    temperature: float,
    k: int,
) -> list[list[tuple[int, float]]]:
    """The k most likely tokens and their log-probs at each completion position (teacher-forced)."""
    if not completion_ids:
        return []
    ids = torch.tensor([[*prompt_ids, *completion_ids]], device=device_of(state.model))
    logits = state.model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    logp = torch.log_softmax(logits / max(temperature, 1e-6), dim=-1)
    values, indices = logp.topk(k, dim=-1)
    return [
        list(zip(row_i.tolist(), row_v.tolist(), strict=True))
        for row_i, row_v in zip(indices, values, strict=True)
    ]


@contextlib.contextmanager
def seeded(generator: Any, seed: int | None) -> Iterator[None]:
    """Sample from `generator`'s stream reseeded with `seed` inside the block, then put the server's
    own stream back, so a seeded request neither shifts nor depends on the others. No-op for None,
    or for a generator that seeds its requests itself (rollout/server.py has no `rng`)."""
    if seed is None or not hasattr(generator, "rng"):
        yield
        return
    saved = generator.get_state()
    generator.rng.manual_seed(seed)
    try:
        yield
    finally:
        generator.set_state(saved)


def training_limits(
    state: ServeState, temperature: float | None, max_tokens: int
) -> tuple[float, int]:
    """(temperature, max_tokens) a request samples with. An endpoint that trains (`rollout:
    external`) holds the run's temperature (the trainer recomputes log-probs at it; a request asking
    for another is refused) and caps replies at the run's token budget. A request naming no
    temperature gets `state.default_temperature` (1, as OpenAI's; 0 while an external run evaluates)."""
    if state.max_tokens_cap is not None:
        max_tokens = min(max_tokens, state.max_tokens_cap)
    required = state.required_temperature
    if required is None:
        return (state.default_temperature if temperature is None else temperature), max_tokens
    if temperature is not None and abs(temperature - required) > 1e-6:
        raise BadInput(
            f"temperature: this endpoint trains at temperature {required:g} (sampling.temperature); "
            f"got {temperature:g}",
            "temperature",
        )
    return required, max_tokens
