"""The sandbox service under load, on loopback only (issue 38): 500 requests from 16 concurrent
clients on 2 workers, every one answered with the right verdict, none lost.

The queue holds 8, fewer than the 14 clients waiting at any moment, so the service also refuses
some requests with 503 on the way; the client (rlvr.sandbox.client) backs off and sends them
again, and the count of answers at the end is still exactly 500. Bounded: 500 requests, each
client stops at a deadline, every request has a timeout; nothing outlives the test.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlvr.sandbox import TestCase, run_tests
from test_sandbox_service import SOLUTION, TESTS, WRONG, needs_the_sandbox, serving, use

REQUESTS, CLIENTS, WORKERS, QUEUE = 500, 16, 2, 8
DEADLINE_SECONDS = 240.0

TestCase.__test__ = False  # type: ignore[attr-defined]  # a dataclass, not a pytest class


@pytest.fixture(autouse=True)
def _needs_the_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    needs_the_sandbox(monkeypatch)


def test_500_requests_from_16_clients_on_2_workers_are_all_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers: dict[int, bool] = {}
    errors: list[str] = []
    lock = threading.Lock()
    next_request = iter(range(REQUESTS))
    with serving(workers=WORKERS, queue=QUEUE) as app:
        use(monkeypatch, app.state.url)
        started = time.monotonic()

        def client() -> None:
            while time.monotonic() - started < DEADLINE_SECONDS:
                with lock:
                    i = next(next_request, None)
                if i is None:
                    return
                try:  # even requests are right, odd ones wrong: each answer is checked
                    passed = run_tests(SOLUTION if i % 2 == 0 else WRONG, "solve", TESTS).all_passed
                except Exception as exc:
                    with lock:
                        errors.append(f"{i}: {type(exc).__name__}: {exc}")
                    continue
                with lock:
                    answers[i] = passed

        with ThreadPoolExecutor(CLIENTS) as pool:
            for future in [pool.submit(client) for _ in range(CLIENTS)]:
                future.result()
        seconds = time.monotonic() - started
        stats = app.state.pool
        served, rejected, failed = stats.served, stats.rejected, stats.failed
    print(
        f"\n{REQUESTS} requests, {CLIENTS} clients, {WORKERS} workers, queue {QUEUE}: "
        f"{seconds:.1f} s ({REQUESTS / seconds:.1f} requests/s), {rejected} refused with 503 "
        "and sent again"
    )
    assert not errors, errors[:5]
    assert sorted(answers) == list(range(REQUESTS))  # every request answered, none lost
    assert all(answers[i] == (i % 2 == 0) for i in answers)  # and each with its own verdict
    assert served == REQUESTS and failed == 0
    assert rejected > 0  # the queue was full at times: 503s happened and were sent again
