"""The code sandbox behind HTTP (`rlvr sandbox serve`): a trainer without root, or on a GPU node,
sends code to a CPU host where the sandbox runs (issue 38).

Endpoints (every one needs `Authorization: Bearer KEY` when the service has a key, else 401):
- POST /v1/run_tests: {code, entry, tests: [{args, expected, hidden}], wall_seconds,
  skip_hidden_after_visible_failure} -> the fields of rlvr.sandbox.SuiteResult. The hidden tests
  run in a sandbox of their own and come back reduced (suites.py), exactly as in-process: the
  service is where the reduction happens, so no candidate text that held a hidden input leaves it.
- POST /run_code: SandboxFusion's API (language "python"): a whole program, its stdout, stderr and
  exit code; what rlvr's client sends to a SandboxFusion server, served here too.
- GET /v1/health: the mode, the layers, the workers and the queue.

Why worker processes and a bounded queue: each worker (worker.py) runs one request at a time with
a sandbox of its own, so `--workers N` is N runs at once and a worker killed mid-run fails only
its own request, answered as an error (HTTP 500 / SandboxFusion's "SandboxError"), never a
verdict; a fresh worker takes its place. Requests beyond the workers wait in a queue of at most
`--queue`; one more is answered 503 with Retry-After at once, so a flood costs the service
nothing and the client knows to back off or try another URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from rlvr.sandbox.runner import MAX_WALL_SECONDS

MAX_CODE_CHARS = 1 << 20
MAX_TESTS = 1000
# Past a run's own deadline, how long a worker may take to answer before it counts as hung.
WORKER_GRACE_SECONDS = 15.0
WORKER_START_SECONDS = 60.0


class ServiceFull(Exception):
    """Every worker is busy and the queue holds as many requests as it may."""


class WorkerFailed(Exception):
    """The worker running a request died, hung or answered nonsense: no verdict for it."""


class _Worker:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            await self.process.stdin.drain()
            line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        except TimeoutError as exc:
            raise WorkerFailed(f"the sandbox worker did not answer within {timeout:.0f} s") from exc
        except (ConnectionError, ValueError) as exc:  # ValueError: a line past the reader's limit
            raise WorkerFailed(f"the sandbox worker is gone or garbled: {exc}") from exc
        if not line:
            code = await self.process.wait()
            raise WorkerFailed(f"the sandbox worker died mid-run (exit status {code})")
        try:
            answer = json.loads(line)
        except ValueError as exc:
            raise WorkerFailed(f"the sandbox worker answered nonsense: {line[:100]!r}") from exc
        if not isinstance(answer, dict):
            raise WorkerFailed(f"the sandbox worker answered nonsense: {line[:100]!r}")
        return answer

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()


class WorkerPool:
    """`workers` worker processes, at most `queue` requests waiting for one (else ServiceFull)."""

    def __init__(self, workers: int, queue: int) -> None:
        self.size, self.queue = workers, queue
        self.idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self.all: list[_Worker] = []
        self.waiting = 0
        self.served = self.failed = self.rejected = 0
        self.info: dict[str, Any] = {}

    async def start(self) -> None:
        workers = await asyncio.gather(*(self._spawn() for _ in range(self.size)))
        for worker in workers:
            self.idle.put_nowait(worker)

    async def _spawn(self) -> _Worker:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "rlvr.sandbox.worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=16 << 20,  # an answer holds up to 1 MiB of output per stream, JSON-escaped
        )
        worker = _Worker(process)
        assert process.stdout is not None
        try:
            line = await asyncio.wait_for(process.stdout.readline(), WORKER_START_SECONDS)
            self.info = json.loads(line)
        except (TimeoutError, ValueError) as exc:
            worker.kill()
            raise RuntimeError(f"a sandbox worker did not start: {exc}") from exc
        self.all.append(worker)
        return worker

    async def _replace(self, worker: _Worker) -> None:
        worker.kill()
        with contextlib.suppress(ProcessLookupError):
            await worker.process.wait()
        self.all.remove(worker)
        for attempt in range(5):  # a host that cannot start one is out of order: keep trying
            try:
                self.idle.put_nowait(await self._spawn())
                return
            except (OSError, RuntimeError):
                await asyncio.sleep(0.5 * 2**attempt)

    async def call(self, request: dict[str, Any], wall_seconds: float) -> dict[str, Any]:
        if self.idle.empty() and self.waiting >= self.queue:
            self.rejected += 1
            raise ServiceFull(
                f"the sandbox service is full: {self.size} runs in flight and {self.waiting} "
                f"requests queued (--queue {self.queue}); retry later or elsewhere"
            )
        self.waiting += 1
        try:
            worker = await self.idle.get()
        finally:
            self.waiting -= 1
        try:
            # Visible and hidden runs share the wall budget; the rest is start-up and transfer.
            answer = await worker.ask(request, 2 * wall_seconds + WORKER_GRACE_SECONDS)
        except WorkerFailed:
            self.failed += 1
            asyncio.get_running_loop().create_task(self._replace(worker))
            raise
        self.idle.put_nowait(worker)
        self.served += 1
        return answer

    async def close(self) -> None:
        for worker in self.all:
            worker.kill()
        for worker in self.all:
            with contextlib.suppress(ProcessLookupError):
                await worker.process.wait()

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.all]


class TestSpec(BaseModel):
    args: list[Any]
    expected: Any
    hidden: bool = False


class RunTestsRequest(BaseModel):
    code: str = Field(max_length=MAX_CODE_CHARS)
    entry: str = Field(min_length=1, max_length=200)
    tests: list[TestSpec] = Field(max_length=MAX_TESTS)
    wall_seconds: float = Field(5.0, gt=0, le=MAX_WALL_SECONDS)
    skip_hidden_after_visible_failure: bool = False


class RunCodeRequest(BaseModel):
    """SandboxFusion's request; only Python without stdin or files is served here."""

    code: str = Field(max_length=MAX_CODE_CHARS)
    language: str = "python"
    run_timeout: float = Field(10.0, gt=0)
    compile_timeout: float = 10.0
    memory_limit_MB: int = -1
    stdin: str | None = None
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


def create_app(workers: int = 2, queue: int = 64, api_key: str | None = None) -> FastAPI:
    """The service; its workers start with the app (the lifespan) and end with it."""
    pool = WorkerPool(workers, queue)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        try:
            yield
        finally:
            await pool.close()

    # No /docs or /openapi.json: every path, known or not, answers 401 without the key.
    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.pool = pool

    @app.middleware("http")
    async def authorized(request: Request, call_next: Any) -> Any:
        if api_key is not None:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            right = hmac.compare_digest(given.strip().encode(), api_key.encode())
            if scheme.lower() != "bearer" or not right:
                return JSONResponse(
                    {"error": "a valid API key is required: 'Authorization: Bearer KEY'"},
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return await call_next(request)

    async def call(request: dict[str, Any], wall: float) -> dict[str, Any] | JSONResponse:
        try:
            return await pool.call(request, wall)
        except ServiceFull as exc:
            return JSONResponse({"error": str(exc)}, status_code=503, headers={"Retry-After": "1"})

    @app.post("/v1/run_tests")
    async def run_tests(body: RunTestsRequest) -> Any:
        request = {"op": "run_tests", **body.model_dump()}
        try:
            answer = await call(request, body.wall_seconds)
        except WorkerFailed as exc:
            return JSONResponse({"error": str(exc), "kind": "worker"}, status_code=500)
        if isinstance(answer, dict) and "error" in answer:
            status = 400 if answer.get("kind") == "bad_request" else 500
            return JSONResponse(answer, status_code=status)
        return answer

    @app.post("/run_code")
    async def run_code(body: RunCodeRequest) -> Any:
        if body.language not in ("python", "python3") or body.stdin or body.files:
            return _fusion_error("only language 'python', without stdin or files, is served here")
        wall = min(body.run_timeout, MAX_WALL_SECONDS)
        try:
            answer = await call(
                {"op": "run_program", "code": body.code, "wall_seconds": wall}, wall
            )
        except WorkerFailed as exc:
            return _fusion_error(str(exc))
        if isinstance(answer, JSONResponse):
            return answer
        if "error" in answer:
            return _fusion_error(str(answer["error"]))
        timed_out, code = bool(answer["timed_out"]), answer["exit_code"]
        run = {
            "status": "TimeLimitExceeded" if timed_out else "Finished",
            "execution_time": answer["seconds"],
            "return_code": code,
            "stdout": answer["stdout"],
            "stderr": answer["stderr"],
        }
        ok = not timed_out and code == 0
        return {
            "status": "Success" if ok else "Failed",
            "message": "",
            "compile_result": None,
            "run_result": run,
            "executor_pod_name": None,
            "files": {},
        }

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        return {
            "mode": pool.info.get("mode"),
            "capabilities": pool.info.get("capabilities"),
            "workers": pool.size,
            "worker_pids": pool.pids(),
            "idle": pool.idle.qsize(),
            "queued": pool.waiting,
            "queue": pool.queue,
            "served": pool.served,
            "failed": pool.failed,
            "rejected": pool.rejected,
            "time": time.time(),
        }

    return app


def _fusion_error(message: str) -> dict[str, Any]:
    """SandboxFusion's answer for a run the sandbox itself failed: HTTP 200, status SandboxError."""
    return {
        "status": "SandboxError",
        "message": message,
        "compile_result": None,
        "run_result": None,
        "executor_pod_name": None,
        "files": {},
    }
