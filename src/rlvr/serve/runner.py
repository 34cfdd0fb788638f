"""Running the app: `serve_state` over a loaded policy, and `BackgroundServer`, uvicorn in a thread
(the trainer's in-run endpoint for `rollout: external`, and the tests' loopback server)."""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from rlvr.models import Policy, eos_token_ids
from rlvr.rollout.endpoints import free_port
from rlvr.rollout.hf import HFGenerator
from rlvr.serve.state import ServeState


def serve_state(
    policy: Policy,
    model_name: str,
    *,
    seed: int = 0,
    autocast_bf16: bool = False,
    generator: HFGenerator | None = None,
) -> ServeState:
    """State serving `policy`; pass the run's own `generator` to share its random stream."""
    if generator is None:
        generator = HFGenerator(
            policy.model,
            policy.tokenizer,
            eos_token_ids(policy.model, policy.tokenizer),
            seed=seed,
            autocast_bf16=autocast_bf16,
        )
    return ServeState(
        model=policy.model, tokenizer=policy.tokenizer, generator=generator, model_name=model_name
    )


class BackgroundServer:
    """uvicorn serving `app` on host:port in a daemon thread; `base_url` ends in /v1."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port or free_port(host)
        config = uvicorn.Config(
            app, host=host, port=self.port, log_level="warning", access_log=False
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="rlvr-serve", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"rlvr serve could not start on {self.host}:{self.port}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"rlvr serve did not start within {timeout_s:g} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
