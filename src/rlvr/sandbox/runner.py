"""Run model-written code against tests in a sandbox; the verdict is computed here, never there.

Isolation, layer by layer (what is available is detected once and reported by `capabilities()`):
- namespaces (`unshare --net --pid --mount --fork --kill-child`): no network (a fresh network
  namespace has only a down loopback), a PID namespace whose init is the harness, so when the runner
  kills it the kernel kills every descendant, grandchildren in new sessions included; a private
  tmpfs on /tmp;
- an unprivileged user (nobody) when the runner is root, so RLIMIT_NPROC binds and root-owned files
  (/proc/1/environ, secrets) are unreadable;
- rlimits: CPU seconds, address space, processes, file size, open files;
- a scrubbed environment (no variable of the host is inherited), a fresh working directory;
- a wall-clock deadline enforced from outside: SIGKILL to the whole process group (and namespace);
- stdout/stderr read in threads and capped (1 MiB each); a flood is drained, not stored.
The harness only reports what the candidate's function returned, as canonical JSON; expected values
stay in this process and are compared here with strict types.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from rlvr.sandbox.results import parse_records

HARNESS = Path(__file__).with_name("harness.py")
MAX_OUTPUT_BYTES = 1 << 20
MAX_WALL_SECONDS = 60.0  # whatever a task or tool call asks for, never more


UNISOLATED_ENV = "RLVR_SANDBOX_UNISOLATED"


class SandboxUnavailable(RuntimeError):
    """This host cannot isolate candidate code (no namespaces) and running unisolated was not asked."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_bytes: int = 1 << 30
    max_processes: int = 64
    max_file_bytes: int = 16 << 20
    max_open_files: int = 64

    def clamped(self) -> SandboxLimits:
        wall = min(max(self.wall_seconds, 0.1), MAX_WALL_SECONDS)
        return SandboxLimits(
            wall_seconds=wall,
            cpu_seconds=max(1, min(self.cpu_seconds, int(wall) + 1)),
            memory_bytes=self.memory_bytes,
            max_processes=self.max_processes,
            max_file_bytes=self.max_file_bytes,
            max_open_files=self.max_open_files,
        )


@dataclass(frozen=True)
class TestCase:
    """Call `entry(*args)`; pass iff it returns exactly `expected` (canonical JSON, strict types)."""

    args: tuple[Any, ...]
    expected: Any
    hidden: bool = False


@dataclass
class SandboxResult:
    passed: int
    total: int
    outcomes: list[str]  # per test: "pass", "fail", "error: ...", "missing"
    timed_out: bool = False
    load_error: str | None = None
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    isolation: dict[str, bool] = field(default_factory=dict)

    @property
    def score(self) -> float:
        """Fraction of tests passed; 0 when there are no tests (nothing was verified)."""
        return self.passed / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        """The reward code RL uses: every test, visible and hidden, passed (and there were tests)."""
        return self.total > 0 and self.passed == self.total


@cache
def capabilities() -> dict[str, bool]:
    """Which isolation layers this host allows (probed once)."""
    namespaces = False
    unshare = shutil.which("unshare")
    if unshare:
        probe = subprocess.run(
            [unshare, "--net", "--pid", "--mount", "--fork", "--kill-child", "true"],
            capture_output=True,
            timeout=10,
        )
        namespaces = probe.returncode == 0
    return {"namespaces": namespaces, "drop_user": os.geteuid() == 0}


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, allow_nan=False)


def _reader(stream: Any, sink: bytearray) -> None:
    while chunk := stream.read(65536):
        room = MAX_OUTPUT_BYTES - len(sink)
        if room > 0:
            sink.extend(chunk[:room])


def run_tests(
    code: str, entry: str, tests: Sequence[TestCase], limits: SandboxLimits | None = None
) -> SandboxResult:
    """Run `code`, call `entry` on every test's args in the sandbox, and judge the outputs here."""
    limits = (limits or SandboxLimits()).clamped()
    caps = capabilities()
    if not caps["namespaces"] and os.environ.get(UNISOLATED_ENV) != "1":
        # Without a network namespace nothing stops a candidate's connect(): refuse rather than run
        # model-written code with the network open.
        raise SandboxUnavailable(
            "the code sandbox needs Linux namespaces (`unshare --net --pid --mount`), which this "
            f"host does not allow; set {UNISOLATED_ENV}=1 to run without network isolation (unsafe)"
        )
    started = time.monotonic()
    if not tests:
        return SandboxResult(0, 0, [], isolation=caps)
    workdir = tempfile.mkdtemp(prefix="rlvr-sandbox-")
    read_fd, write_fd = os.pipe()
    uid = gid = None
    if caps["drop_user"]:
        import pwd

        nobody = pwd.getpwnam("nobody")
        uid, gid = nobody.pw_uid, nobody.pw_gid
    job = {
        "code": code,
        "entry": entry,
        "inputs": [list(t.args) for t in tests],
        "workdir": workdir,
        "uid": uid,
        "gid": gid,
        "private_tmp": caps["namespaces"],
    }
    command = [sys.executable, "-I", "-S", str(HARNESS), str(write_fd)]
    if caps["namespaces"]:
        command = ["unshare", "--net", "--pid", "--mount", "--fork", "--kill-child", *command]

    # RLIMIT_NPROC counts every process of the (real) user: an unprivileged runner allows its current
    # count plus the budget; a root runner drops the candidate to nobody, whose count starts near 0.
    nproc = limits.max_processes + (0 if caps["drop_user"] else _user_process_count())

    def preexec() -> None:
        for kind, value in (
            (resource.RLIMIT_CPU, limits.cpu_seconds),
            (resource.RLIMIT_AS, limits.memory_bytes),
            (resource.RLIMIT_FSIZE, limits.max_file_bytes),
            (resource.RLIMIT_NOFILE, limits.max_open_files),
            (resource.RLIMIT_NPROC, nproc),
            (resource.RLIMIT_CORE, 0),
        ):
            resource.setrlimit(kind, (value, value))

    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    process = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=(write_fd,),
        env=env,
        cwd=workdir,
        start_new_session=True,
        preexec_fn=preexec,
    )
    os.close(write_fd)
    out, err, results = bytearray(), bytearray(), bytearray()
    threads = [
        threading.Thread(target=_reader, args=(process.stdout, out), daemon=True),
        threading.Thread(target=_reader, args=(process.stderr, err), daemon=True),
        threading.Thread(
            target=_reader, args=(os.fdopen(read_fd, "rb", buffering=0), results), daemon=True
        ),
    ]
    for t in threads:
        t.start()
    timed_out = False
    try:
        assert process.stdin is not None
        process.stdin.write(json.dumps(job).encode())
        process.stdin.close()
    except BrokenPipeError:
        pass
    try:
        process.wait(timeout=limits.wall_seconds)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        _kill_group(process, caps["namespaces"])
    for t in threads:
        t.join(timeout=1.0)
    shutil.rmtree(workdir, ignore_errors=True)
    return _judge(bytes(results), tests, timed_out, out, err, started, caps)


def _user_process_count() -> int:
    uid, count = os.getuid(), 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += 1
            except OSError:
                continue
    return count


def _kill_group(process: subprocess.Popen[bytes], namespaced: bool) -> None:
    """Kill everything the run started, and reap it.

    With namespaces the harness is the PID namespace's init: killing it makes the kernel kill every
    process in the namespace, and `unshare` (its parent) reaps it and exits, so no zombie is left
    for the host's init. Then SIGKILL the whole process group for anything else (no namespaces).
    """
    if namespaced:
        for child in _children(process.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=2)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _judge(
    raw: bytes,
    tests: Sequence[TestCase],
    timed_out: bool,
    out: bytearray,
    err: bytearray,
    started: float,
    caps: dict[str, bool],
) -> SandboxResult:
    seen, load_error = parse_records(raw)  # never raises, whatever the candidate wrote
    outcomes = []
    for i, test in enumerate(tests):
        record = seen.get(i)
        if record is None:
            outcomes.append("missing")
        elif "error" in record:
            outcomes.append(f"error: {str(record['error'])[:200]}")
        elif isinstance(record.get("out"), str) and record["out"] == _canonical(test.expected):
            outcomes.append("pass")
        else:
            outcomes.append("fail")
    return SandboxResult(
        passed=sum(o == "pass" for o in outcomes),
        total=len(tests),
        outcomes=outcomes,
        timed_out=timed_out,
        load_error=load_error,
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
        seconds=time.monotonic() - started,
        isolation=caps,
    )
