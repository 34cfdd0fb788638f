"""Sending code to a sandbox service instead of running it here (issue 38): `sandbox.url`.

`rlvr.sandbox.run_tests` (what `code_tests` and the code env call) runs code in this process's
sandbox unless a service is configured, by the run config's `sandbox` section (`configure`, called
where a run builds its task sources) or by the environment (RLVR_SANDBOX_URL, _API, _API_KEY,
_TIMEOUT; `configure` sets them, so Ray workers and other child processes inherit them). Then:
- api "rlvr" (`rlvr sandbox serve`): one POST /v1/run_tests per check; the service runs the visible
  and hidden tests in separate sandboxes and reduces the hidden outcomes, as in-process.
- api "sandboxfusion": a SandboxFusion server's /run_code, one call for the visible tests and one
  for the hidden ones (suites.py's split, done here). The program sent is the candidate's code and a
  driver that prints what its function returned for each input, one JSON record a line behind a
  random marker; expected values never leave this process and are compared here (runner._judge).
  A candidate can print such lines too, but a record is only a claimed output: it earns a hidden
  test only with the right output for an input it was not shown, i.e. by solving it.

Several URLs: each request starts at the next one (round robin); a URL that refuses the
connection or answers 503 (its queue is full) is skipped for the next, and when all are full the
client backs off and tries again until `timeout_seconds`. Anything else that is not a verdict (a
401, a worker that died, a timeout, a malformed answer) raises SandboxServiceError: the rubric and
the rollout engine record it as a reward error, never as a 0.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

import rlvr.sandbox.runner as runner
import rlvr.sandbox.suites as suites
from rlvr.sandbox.runner import SandboxLimits, SandboxResult, SandboxUnavailable, TestCase
from rlvr.sandbox.suites import SuiteResult

URL_ENV, API_ENV, KEY_ENV, TIMEOUT_ENV = (
    "RLVR_SANDBOX_URL",
    "RLVR_SANDBOX_API",
    "RLVR_SANDBOX_API_KEY",
    "RLVR_SANDBOX_TIMEOUT",
)
APIS = ("rlvr", "sandboxfusion")


class SandboxServiceError(SandboxUnavailable):
    """The service gave no verdict (refused, failed, unreachable): a reward error, never a 0."""


@dataclasses.dataclass(frozen=True)
class ServiceSettings:
    urls: tuple[str, ...]
    api: str = "rlvr"
    api_key: str | None = None
    timeout_seconds: float = 300.0


def configure(
    url: str | Sequence[str] | None,
    api: str = "rlvr",
    api_key: str | None = None,
    timeout_seconds: float = 300.0,
) -> None:
    """Send this process's (and its children's) sandbox runs to `url`; None leaves the environment
    as it is (RLVR_SANDBOX_URL if set, else runs here)."""
    if url is None:
        return
    urls = [url] if isinstance(url, str) else list(url)
    if api not in APIS:
        raise ValueError(f"sandbox api {api!r} is not one of {', '.join(APIS)}")
    os.environ[URL_ENV] = " ".join(urls)
    os.environ[API_ENV] = api
    os.environ[TIMEOUT_ENV] = str(timeout_seconds)
    if api_key is not None:
        os.environ[KEY_ENV] = api_key


def settings() -> ServiceSettings | None:
    """The service this process sends code to, or None (run here)."""
    urls = tuple(u.rstrip("/") for u in os.environ.get(URL_ENV, "").replace(",", " ").split())
    if not urls:
        return None
    return ServiceSettings(
        urls=urls,
        api=os.environ.get(API_ENV) or "rlvr",
        api_key=os.environ.get(KEY_ENV) or None,
        timeout_seconds=float(os.environ.get(TIMEOUT_ENV) or 300.0),
    )


def run_tests(
    code: str,
    entry: str,
    tests: Sequence[TestCase],
    limits: SandboxLimits | None = None,
    *,
    skip_hidden_after_visible_failure: bool = False,
) -> SuiteResult:
    """suites.run_tests here, or the same through the configured service."""
    service = settings()
    if service is None:
        return suites.run_tests(
            code,
            entry,
            tests,
            limits,
            skip_hidden_after_visible_failure=skip_hidden_after_visible_failure,
        )
    return client_for(service).run_tests(
        code,
        entry,
        tests,
        limits,
        skip_hidden_after_visible_failure=skip_hidden_after_visible_failure,
    )


_clients: dict[ServiceSettings, SandboxClient] = {}
_clients_lock = threading.Lock()


def client_for(service: ServiceSettings) -> SandboxClient:
    with _clients_lock:
        if service not in _clients:
            _clients[service] = SandboxClient(service)
        return _clients[service]


class SandboxClient:
    """Thread-safe: the rollout engine checks a step's samples from several threads at once."""

    def __init__(self, service: ServiceSettings) -> None:
        import httpx

        if service.api not in APIS:
            raise SandboxServiceError(
                f"sandbox api {service.api!r} is not one of {', '.join(APIS)}"
            )
        self.service = service
        headers = {"Authorization": f"Bearer {service.api_key}"} if service.api_key else {}
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self.http = httpx.Client(headers=headers, timeout=service.timeout_seconds, limits=limits)
        self.turn = itertools.count()
        self.lock = threading.Lock()

    def run_tests(
        self,
        code: str,
        entry: str,
        tests: Sequence[TestCase],
        limits: SandboxLimits | None = None,
        *,
        skip_hidden_after_visible_failure: bool = False,
    ) -> SuiteResult:
        limits = limits or SandboxLimits()
        if self.service.api == "sandboxfusion":
            return suites.run_tests(
                code,
                entry,
                tests,
                limits,
                skip_hidden_after_visible_failure=skip_hidden_after_visible_failure,
                one_run=self._fusion_run,
            )
        body = {
            "code": code,
            "entry": entry,
            "tests": [
                {"args": list(t.args), "expected": t.expected, "hidden": t.hidden} for t in tests
            ],
            "wall_seconds": limits.clamped().wall_seconds,
            "skip_hidden_after_visible_failure": skip_hidden_after_visible_failure,
        }
        return _suite_result(self.post("/v1/run_tests", body), len(tests))

    def _fusion_run(
        self, code: str, entry: str, tests: Sequence[TestCase], limits: SandboxLimits | None
    ) -> SandboxResult:
        """One sandbox run on a SandboxFusion server: the driver's records, judged here."""
        limits = (limits or SandboxLimits()).clamped()
        started = time.monotonic()
        marker = f"@rlvr-{secrets.token_hex(8)}@"
        program = fusion_program(code, entry, [list(t.args) for t in tests], marker)
        body = {"code": program, "language": "python", "run_timeout": limits.wall_seconds}
        answer = self.post("/run_code", body)
        run = answer.get("run_result")
        if answer.get("status") == "SandboxError" or not isinstance(run, dict):
            raise SandboxServiceError(
                f"the sandbox service failed the run: {answer.get('message')!r:.300}"
            )
        stdout, stderr = str(run.get("stdout") or ""), str(run.get("stderr") or "")
        lines = stdout.splitlines()
        records = "\n".join(line[len(marker) :] for line in lines if line.startswith(marker))
        shown = "\n".join(line for line in lines if not line.startswith(marker))
        timed_out = run.get("status") == "TimeLimitExceeded"
        isolation = {"service": True}
        return runner._judge(
            records.encode(), tests, timed_out, shown.encode(), stderr.encode(), started, isolation
        )

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to the next URL; past refusals and full queues to the others, with back-off."""
        import httpx

        urls = self.service.urls
        with self.lock:
            first = next(self.turn) % len(urls)
        deadline = time.monotonic() + self.service.timeout_seconds
        why: list[str] = []
        for attempt in itertools.count():
            for url in urls[first:] + urls[:first]:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    response = self.http.post(url + path, json=body, timeout=left)
                except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
                    why.append(f"{url}: {type(exc).__name__}: {exc}")
                    continue
                except httpx.TimeoutException as exc:
                    raise SandboxServiceError(f"{url}{path}: no answer in time ({exc})") from exc
                if response.status_code == 503:
                    why.append(f"{url}: full (503)")
                    continue
                return _answer(url + path, response)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(0.05 * 2**attempt, 2.0, left))
        raise SandboxServiceError(
            f"no sandbox service took the request within {self.service.timeout_seconds:g} s: "
            + "; ".join(why[-len(urls) :])
        )


def _answer(where: str, response: Any) -> dict[str, Any]:
    try:
        answer = response.json()
    except ValueError:
        answer = None
    if response.status_code == 401:
        raise SandboxServiceError(f"{where}: the API key was refused (401; sandbox.api_key)")
    if response.status_code != 200 or not isinstance(answer, dict):
        detail = answer.get("error") if isinstance(answer, dict) else response.text[:300]
        raise SandboxServiceError(f"{where}: HTTP {response.status_code}: {detail}")
    return answer


def _suite_result(answer: dict[str, Any], n_tests: int) -> SuiteResult:
    """The service's SuiteResult, checked: a malformed one is an error, never a verdict."""
    names = {f.name for f in dataclasses.fields(SuiteResult)}
    outcomes = answer.get("outcomes")
    if not isinstance(outcomes, list) or len(outcomes) != n_tests or not names >= set(answer):
        raise SandboxServiceError(
            f"the sandbox service answered a malformed result: {answer!r:.300}"
        )
    result = SuiteResult(**{k: v for k, v in answer.items() if k in names})
    result.outcomes = [str(o) for o in outcomes]
    result.passed = sum(o == "pass" for o in result.outcomes)  # from the outcomes, not the count
    result.total = n_tests
    return result


DRIVER = """
import json as _json, sys as _sys
_dumps, _out = _json.dumps, _sys.stdout
_MARK = {marker!r}
def _report(record):
    try:
        line = _dumps(record, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        line = _dumps({{"i": record.get("i"), "error": "unserializable output"}})
    _out.write("\\n" + _MARK + line + "\\n")
    _out.flush()
_namespace = {{"__name__": "__candidate__"}}
try:
    exec(compile({code!r}, "<candidate>", "exec"), _namespace)
    _fn = _namespace[{entry!r}]
except BaseException as _exc:
    _report({{"i": -1, "error": ("load: %s: %s" % (type(_exc).__name__, _exc))[:300]}})
    _fn = None
for _i, _args in enumerate(_json.loads({inputs!r}) if _fn is not None else []):
    try:
        _value = _fn(*_args)
    except BaseException as _exc:
        _report({{"i": _i, "error": ("%s: %s" % (type(_exc).__name__, _exc))[:300]}})
        continue
    try:
        _text = _dumps(_value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        _report({{"i": _i, "error": "unserializable output of type %s" % type(_value).__name__}})
        continue
    _report({{"i": _i, "out": _text}})
"""


def fusion_program(code: str, entry: str, inputs: list[list[Any]], marker: str) -> str:
    """The program sent to SandboxFusion: the candidate's code run as in harness.run_candidate,
    each output reported as `marker` + a JSON record on a line of its own (json.dumps and stdout
    are taken before the candidate runs, so patching them changes nothing)."""
    return DRIVER.format(marker=marker, code=code, entry=entry, inputs=json.dumps(inputs))
