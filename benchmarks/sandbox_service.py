"""Checks per second in this process's sandbox vs through `rlvr sandbox serve` on loopback
(docs/performance.md, "The sandbox as a service"). One check is rlvr.sandbox.run_tests of a
trivial passing program with a visible and a hidden test (two sandbox runs), as code_tests makes.

    python benchmarks/sandbox_service.py [--n 200] [--clients 16] [--workers 2]

Rows: local with `--workers` threads (the sandbox's own concurrency), then the service with
`--workers` worker processes and `--clients` concurrent client threads, through rlvr's API and
through SandboxFusion's run_code API (served by the same service). Everything runs on this host:
the service adds HTTP, JSON and a process hop per check, not a network. The service listens on
127.0.0.1 only and stops when the script does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import uvicorn

from rlvr.sandbox import TestCase, client, run_tests
from rlvr.sandbox.runner import mode
from rlvr.sandbox.service import create_app

PROGRAM = "def solve(x):\n    return 2 * x\n"
TESTS = [TestCase((1,), 2), TestCase((5,), 10, hidden=True)]


def check() -> None:
    result = run_tests(PROGRAM, "solve", TESTS)
    if not result.all_passed:
        raise RuntimeError(f"the trivial program did not pass: {result.outcomes} {result.stderr}")


def rate(fn: Callable[[], None], n: int, threads: int) -> float:
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: fn(), range(n)))
    return n / (time.perf_counter() - started)


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    for name in (client.URL_ENV, client.API_ENV, client.KEY_ENV):
        os.environ.pop(name, None)
    print(f"{cpu_model()}, {os.cpu_count()} CPUs; sandbox mode: {mode()}; {args.n} checks each")
    check()  # starts this process's zygote and probes the host: not part of the rate
    rows = [(f"local, {args.workers} threads", rate(check, args.n, args.workers))]
    app = create_app(workers=args.workers, queue=4 * args.clients, api_key="bench")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        for api in ("rlvr", "sandboxfusion"):
            client.configure(f"http://127.0.0.1:{port}", api=api, api_key="bench")
            check()  # the connection pool's first connections
            label = f"service, {args.workers} workers, {args.clients} clients, api {api}"
            rows.append((label, rate(check, args.n, args.clients)))
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    print("| where | checks/s |\n|---|---|")
    for label, value in rows:
        print(f"| {label} | {value:.1f} |")


if __name__ == "__main__":
    main()
