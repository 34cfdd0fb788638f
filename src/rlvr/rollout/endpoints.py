"""What the HTTP clients of rollout/ and the servers of serve/ share, with the standard library
alone: the trainer's server client and the colocated vLLM import this on machines without the
serving stack (fastapi, starlette, uvicorn: the GPU image lacks them, benchmarks/gpu_image.py), and
serve/ imports it from here, never the other way round."""

from __future__ import annotations

import socket

# The environment variable holding `rlvr serve`'s API key (serve/auth.py enforces it; the trainer
# hands servers it launches a key of their own through it).
API_KEY_ENV = "RLVR_API_KEY"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS picks it; another process may still take it later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
