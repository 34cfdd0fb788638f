"""The sandbox as a service (issue 38): `rlvr sandbox serve` and the client behind `sandbox.url`,
on loopback only (127.0.0.1), in whichever mode the sandbox runs here (root, or rootless in CI's
non-root pass).

- the same verdicts as in-process, hidden tests reduced on the service's side; the client also
  speaks SandboxFusion's run_code API (tested against this service's own /run_code), where the
  hidden inputs' exfiltration programs leak nothing either;
- faults: no key or a wrong one is a 401; past the queue a 503 at once; a worker killed mid-run
  answers its request as an error, never a verdict, and is replaced; every such failure reaches
  the trainer as a reward error (rubric) or env error (code env), never a 0;
- load: 500 requests from 16 concurrent clients on 2 workers, all answered correctly, none lost,
  bounded in time (test_sandbox_load.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from rlvr.envs.code import CodeEnv, make_task
from rlvr.records import Task, Trajectory
from rlvr.sandbox import SandboxServiceError, TestCase, capabilities, client, run_tests
from rlvr.sandbox.runner import REQUIRED
from rlvr.sandbox.service import create_app
from rlvr.verifiers.code import code_tests
from rlvr.verifiers.rubric import RewardFunction, Rubric
from test_sandbox_feedback import LEAKING, SPEC, assert_no_canary, cases

TestCase.__test__ = False  # type: ignore[attr-defined]  # a dataclass, not a pytest class
SOLUTION = "def solve(x):\n    return 2 * x\n"
WRONG = "def solve(x):\n    return 3 * x\n"
TESTS = [TestCase((1,), 2), TestCase((5,), 10, hidden=True), TestCase((-3,), -6, hidden=True)]
KEY = "test-key-0123"


@pytest.fixture(autouse=True)
def _needs_the_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    needs_the_sandbox(monkeypatch)


def needs_the_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    """The service runs the sandbox; CI must have one. No service is configured unless a test
    configures one (configure() writes the environment: monkeypatch undoes it)."""
    for name in (client.URL_ENV, client.API_ENV, client.KEY_ENV, client.TIMEOUT_ENV):
        monkeypatch.setenv(name, "")  # recorded, so that the test's end removes it, set or not
        monkeypatch.delenv(name)
    missing = [k for k in REQUIRED if not capabilities()[k]]
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the sandbox isolated; missing: {', '.join(missing)}")
        pytest.skip(f"the sandbox cannot isolate code on this host; missing: {', '.join(missing)}")


@contextmanager
def serving(workers: int = 2, queue: int = 64, api_key: str | None = KEY) -> Iterator[Any]:
    """The service on 127.0.0.1 (a free port), in a thread of this process; its workers are
    processes. Yields the app (app.state.url, app.state.pool)."""
    app = create_app(workers=workers, queue=queue, api_key=api_key)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the service did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    app.state.url = f"http://127.0.0.1:{port}"
    try:
        yield app
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def use(
    monkeypatch: pytest.MonkeyPatch, *urls: str, api: str = "rlvr", key: str | None = KEY
) -> None:
    monkeypatch.setenv(client.URL_ENV, " ".join(urls))
    monkeypatch.setenv(client.API_ENV, api)
    monkeypatch.setenv(client.TIMEOUT_ENV, "60")
    if key is not None:
        monkeypatch.setenv(client.KEY_ENV, key)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("api", ["rlvr", "sandboxfusion"])
def test_verdicts_through_the_service_are_those_of_in_process(
    api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    code_error = "def solve(x):\n    raise ValueError(f'no {x}')\n"
    local = [run_tests(code, "solve", TESTS).outcomes for code in (SOLUTION, WRONG, code_error)]
    with serving() as app:
        use(monkeypatch, app.state.url, api=api)
        remote = [run_tests(code, "solve", TESTS) for code in (SOLUTION, WRONG, code_error)]
    assert [r.outcomes for r in remote] == local
    assert remote[0].all_passed and not remote[1].all_passed
    assert remote[2].outcomes[2] == "error: ValueError"  # a hidden error: its built-in name only


@pytest.mark.parametrize("api", ["rlvr", "sandboxfusion"])
def test_hidden_inputs_never_reach_feedback_through_the_service(
    api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """test_sandbox_feedback's exfiltration programs, through each API: no canary comes back."""
    with serving() as app:
        use(monkeypatch, app.state.url, api=api)
        for name, code in LEAKING.items():
            result = run_tests(code, "solve", cases())
            assert not result.all_passed, name
            assert_no_canary(
                *result.outcomes, result.load_error or "", result.stdout, result.stderr
            )
            env = CodeEnv(make_task(SPEC, wall_seconds=3.0))
            _, solved, feedback = env.check(f"```python\n{code}```")
            assert not solved
            assert_no_canary(feedback)


def test_forged_records_and_patched_json_earn_nothing_through_sandboxfusion(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The SandboxFusion driver reads records from stdout: a candidate that prints records for
    every test (the marker read from the driver's globals), or patches json, still fails."""
    forge = (
        "import sys\n"
        "mark = sys._getframe(1).f_globals.get('_MARK', '')\n"
        "for i, out in ((0, 2), (1, 10), (2, -6), (1, 10)):\n"
        '    print(mark + \'{"i": %d, "out": "%d"}\' % (i, out))\n'
        "def solve(x):\n    return 0\n"
    )
    patch = "import json\njson.dumps = lambda *a, **k: '2'\ndef solve(x):\n    return 0\n"
    with serving() as app:
        use(monkeypatch, app.state.url, api="sandboxfusion")
        forged = run_tests(forge, "solve", TESTS)
        patched = run_tests(patch, "solve", TESTS)
    # The marker names the visible run's records; the hidden run has its own, and its outputs
    # are what the function returned for inputs the program was not shown.
    assert forged.outcomes[0] == "pass" and not forged.all_passed
    assert patched.outcomes == ["fail", "fail", "fail"]


def test_requests_without_the_key_get_401(monkeypatch: pytest.MonkeyPatch) -> None:
    body = {"code": SOLUTION, "entry": "solve", "tests": [{"args": [1], "expected": 2}]}
    with serving() as app:
        url = app.state.url
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            for method, path, payload in (
                ("POST", "/v1/run_tests", body),
                ("POST", "/run_code", {"code": "print(1)", "language": "python"}),
                ("GET", "/v1/health", None),
                ("GET", "/docs", None),
                ("GET", "/openapi.json", None),
                ("GET", "/no/such/path", None),
            ):
                answer = httpx.request(method, url + path, json=payload, headers=headers)
                assert answer.status_code == 401, (headers, path, answer.text)
        ok = httpx.post(
            url + "/v1/run_tests", json=body, headers={"Authorization": f"Bearer {KEY}"}
        )
        assert ok.status_code == 200 and ok.json()["outcomes"] == ["pass"]
        use(monkeypatch, url, key="wrong")
        with pytest.raises(SandboxServiceError, match="401"):
            run_tests(SOLUTION, "solve", TESTS)


def test_past_the_queue_a_clear_503_at_once() -> None:
    """1 worker, a queue of 1: of three slow requests at once, one runs, one waits, one is
    refused at once (503, Retry-After), and the other two are answered."""
    slow = {
        "code": "import time\ndef solve(x):\n    time.sleep(1.0)\n    return 2 * x\n",
        "entry": "solve",
        "tests": [{"args": [1], "expected": 2}],
        "wall_seconds": 5,
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    with serving(workers=1, queue=1) as app:

        def post(delay: float) -> tuple[int, float, httpx.Response]:
            time.sleep(delay)
            started = time.monotonic()
            answer = httpx.post(
                app.state.url + "/v1/run_tests", json=slow, headers=headers, timeout=30
            )
            return answer.status_code, time.monotonic() - started, answer

        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(post, (0.0, 0.3, 0.6)))
    statuses = sorted(status for status, _, _ in answers)
    assert statuses == [200, 200, 503], statuses
    ((_, seconds, refused),) = [a for a in answers if a[0] == 503]
    assert seconds < 0.5 and refused.headers["Retry-After"] == "1"
    assert "full" in refused.json()["error"] and "--queue 1" in refused.json()["error"]


@pytest.mark.parametrize("api", ["rlvr", "sandboxfusion"])
def test_a_worker_killed_mid_run_is_an_error_and_is_replaced(
    api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run would pass (it sleeps, then answers right): its worker is killed while it sleeps.
    The request is answered as an error, never a verdict, and the next request passes."""
    slow = "import time\ndef solve(x):\n    time.sleep(1.5)\n    return 2 * x\n"
    with serving(workers=1) as app:
        use(monkeypatch, app.state.url, api=api)
        pool = app.state.pool
        (pid,) = pool.pids()
        with ThreadPoolExecutor(1) as executor:
            running = executor.submit(run_tests, slow, "solve", TESTS[:1])
            deadline = time.monotonic() + 10
            while pool.idle.qsize() and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.3)  # in the run
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(SandboxServiceError, match="died"):
                running.result(timeout=30)
        assert run_tests(SOLUTION, "solve", TESTS).all_passed  # a new worker took its place
        assert pool.failed == 1 and pool.pids() != [pid]


def test_service_errors_are_reward_errors_and_env_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """No service at the URL: the code_tests reward is an error in the rubric's score (the trainer
    leaves the trajectory out of the update and counts it against max_reward_error_fraction), and
    the code env raises, which the rollout engine records as an env error. Never a 0."""
    use(monkeypatch, f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv(client.TIMEOUT_ENV, "1")
    rubric = Rubric([RewardFunction("code_tests", code_tests)])
    task = Task(id="t", messages=(), fields={"tests": SPEC["tests"], "entry": "solve"})
    trajectory = Trajectory(
        task_id="t",
        token_ids=(1, 2),
        policy_mask=(0, 1),
        logprobs=(0.0, -0.5),
        prompt_length=1,
        completion_text=f"```python\n{SOLUTION}```",
        finish_reason="stop",
    )
    score = rubric.score(trajectory, task)
    assert "code_tests" in score.errors and "SandboxServiceError" in score.errors["code_tests"]
    assert "code_tests" not in score.rewards
    prefetched = rubric.prefetch([(trajectory, task)])  # the parallel path the engine takes
    assert "code_tests" in rubric.score(trajectory, task, prefetched).errors
    with pytest.raises(SandboxServiceError):
        CodeEnv(make_task(SPEC)).check(f"```python\n{SOLUTION}```")


def test_several_urls_share_the_load_and_a_dead_one_is_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with serving(workers=1) as first, serving(workers=1) as second:
        dead = f"http://127.0.0.1:{free_port()}"
        use(monkeypatch, first.state.url, dead, second.state.url)
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: run_tests(SOLUTION, "solve", TESTS), range(12)))
        assert all(r.all_passed for r in results)
        assert first.state.pool.served >= 3 and second.state.pool.served >= 3


def test_rlvr_sandbox_serve_runs_and_stops(tmp_path: Path) -> None:
    """The command itself: it starts, says its mode, answers with the key, ends on SIGTERM
    (uvicorn shuts down, then re-raises the signal) and its workers with it."""
    port = free_port()
    command = [sys.executable, "-m", "rlvr.cli", "sandbox", "serve", "--port", str(port)]
    command += ["--workers", "1", "--api-key", KEY]
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(
                    f"http://127.0.0.1:{port}/v1/health", headers={"Authorization": f"Bearer {KEY}"}
                )
                break
            except httpx.ConnectError:
                assert process.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        assert health.status_code == 200 and health.json()["workers"] == 1
        assert health.json()["mode"] in ("root", "rootless")
        workers = health.json()["worker_pids"]
    finally:
        process.terminate()
        assert process.wait(timeout=30) in (0, -signal.SIGTERM), log.read_text()
    assert f"{health.json()['mode']} mode" in log.read_text()
    time.sleep(0.5)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]


def test_a_run_config_sandbox_url_sends_the_code_env_to_the_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`sandbox.url` in a run's config: building its task sources points this process (and,
    through the environment, its Ray workers) at the service; the code env's checks go there."""
    from rlvr.config import RunConfig
    from rlvr.train.sources import Sources

    with serving(workers=1) as app:
        cfg = RunConfig.model_validate(
            {
                "task": {
                    "source": "env",
                    "env": {"name": "code", "num_train": 4, "num_heldout": 2},
                },
                "sandbox": {"url": app.state.url, "api_key": KEY, "timeout_seconds": 60},
            }
        )
        source = next(iter(Sources(cfg)))
        task = source.splits.train[0]
        env = source.make_env(task)
        env.reset()
        env.step("```python\ndef nothing():\n    pass\n```")
        assert os.environ[client.URL_ENV] == app.state.url
        assert app.state.pool.served == 1
