"""Run model-written code against tests in a sandbox; the verdict is computed here, never there.

Over the 500-line guide by a few lines: the zygote protocol and the verdict it computes are kept in
one reading; split when it grows.

Isolation, layer by layer (harness.py and jail.py build it; `capabilities()` probes once what this
host allows, and every later run must get all of it or is refused):
- namespaces: each run is PID 1 of its own PID namespace (when it exits the kernel kills every
  descendant, grandchildren in new sessions included) with its own network (only a down loopback:
  no TCP/UDP, no abstract unix sockets of the host), mount, IPC, UTS and cgroup namespaces;
- a minimal root (pivot_root into a read-only tmpfs): /usr without /usr/local, the interpreter's
  prefix, no site-packages, no checkout, venv, /home, /root, /opt, /srv or datasets; a private
  /proc of the run's own PID namespace; private tmpfs on /tmp, /var/tmp, /dev/shm and /run/lock;
- its own uid (from a range, when the runner is root), so RLIMIT_NPROC is not shared between
  concurrent runs, and root-owned files and processes are out of reach; no capability, in any set;
- rootless (the runner is not root, issue 38): the same namespaces and minimal root, built in a
  user namespace of each run's own that maps only the runner's uid (privileges.py); the candidate
  runs as that user without capabilities, and the kernel counts its processes per namespace;
- Landlock, where the kernel has it: no file access beyond the paths the minimal root is made of;
- a cgroup per run (v2, or v1 memory + pids) whose memory and process limits hold for the whole run;
- seccomp: no new namespaces, mount, ptrace, bpf, keyctl, io_uring, perf, modules, and no socket
  family the network namespace does not cover (AF_VSOCK reaches a VM's hypervisor);
- rlimits, a scrubbed environment, a wall-clock deadline enforced from outside (SIGKILL), output
  capped at 1 MiB per stream (a flood is drained, not stored).
A pre-forked zygote with the stdlib already imported makes each run a fork, not an interpreter start.
The harness only reports what the candidate's function returned, as canonical JSON; expected values
stay in this process and are compared here with strict types.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import shutil
import socket
import struct
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
KEEPER_GRACE_SECONDS = 10.0  # after a kill, how long the keeper may take to answer "done"

UNISOLATED_ENV = "RLVR_SANDBOX_UNISOLATED"

# Without these the sandbox refuses to run (the candidate could read the answers on disk, reach
# the network or other processes); the others are reported and, when present, required too.
REQUIRED = ("namespaces", "minimal_root", "private_proc", "private_tmp", "unprivileged_user")
LAYERS = (*REQUIRED, "per_run_uid", "cgroup", "seccomp", "landlock")
LAYER_DESCRIPTIONS = {
    "namespaces": "own PID, network, mount, IPC, UTS and cgroup namespaces",
    "minimal_root": "read-only minimal root: interpreter and stdlib only",
    "private_proc": "/proc of the run's own PID namespace",
    "private_tmp": "private tmpfs on /tmp, /var/tmp, /dev/shm, /run/lock",
    "unprivileged_user": "the candidate is not root and holds no capability",
    "per_run_uid": "a uid of its own per run (RLIMIT_NPROC not shared)",
    "cgroup": "a cgroup per run: memory and process limits for the whole run",
    "seccomp": "seccomp: no namespaces, mount, ptrace, bpf, keyctl, io_uring, vsock",
    "landlock": "Landlock: no file access beyond the minimal root's paths",
}
# What each mode is (`rlvr sandbox check` prints it). Rootless: privileges.py.
MODE_DESCRIPTIONS = {
    "root": "root: the layers are built as root; each run's candidate gets a uid of its own",
    "rootless": (
        "rootless: the layers are built in a user namespace of each run's own that maps only this "
        "user's uid; the candidate runs as this user, without capabilities"
    ),
}
SERVICE_HINT = (
    "or send code to a sandbox service on a host where it runs: `rlvr sandbox serve` there and "
    "sandbox.url (or RLVR_SANDBOX_URL) here"
)
FRAME = struct.Struct("!Q")


class SandboxUnavailable(RuntimeError):
    """This host cannot isolate candidate code and running unisolated was not asked."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_bytes: int = 1 << 30  # per process (RLIMIT_AS) and, with a cgroup, for the whole run
    max_processes: int = 64  # processes and threads of the run
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
    uid: int | None = None  # the uid the candidate ran as (no process of it outlives the run)

    @property
    def score(self) -> float:
        """Fraction of tests passed; 0 when there are no tests (nothing was verified)."""
        return self.passed / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        """The reward code RL uses: every test, visible and hidden, passed (and there were tests)."""
        return self.total > 0 and self.passed == self.total


class _Zygote:
    """The harness process runs are forked from: started once per process, restarted if it dies."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The base interpreter, not the venv: nothing of the venv is visible in the sandbox.
        python = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
        self.process = subprocess.Popen(
            [python, "-I", "-S", str(HARNESS), str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.PIPE,  # the paths to hide; not in argv, which /proc/1/cmdline shows
            stdout=subprocess.DEVNULL,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"},
            start_new_session=True,  # a Ctrl-C to the trainer is not a Ctrl-C to its sandboxes
        )
        theirs.close()
        assert self.process.stdin is not None
        with self.process.stdin:
            self.process.stdin.write(json.dumps(_secrets()).encode())
        self.socket = ours
        self.owner = os.getpid()
        self.lock = threading.Lock()

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.process.poll() is None

    def request(self, fds: list[int]) -> None:
        with self.lock:
            socket.send_fds(self.socket, [b"run"], fds)

    def close(self) -> None:
        """Closing the socket ends the zygote; killing it ends every run in flight (parent-death
        signals: zygote -> keepers -> inits)."""
        self.socket.close()
        if self.owner == os.getpid():
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=2)
            self.process.kill()
            self.process.wait()


_zygote_lock = threading.Lock()
_zygote_now: _Zygote | None = None


def _zygote(restart: bool = False) -> _Zygote:
    global _zygote_now
    with _zygote_lock:
        current = _zygote_now
        if current is not None and (restart or not current.alive()):
            if current.owner == os.getpid():
                current.close()
            current = None
        if current is None:
            current = _zygote_now = _Zygote()
        return current


@atexit.register
def _stop_zygote() -> None:
    if _zygote_now is not None and _zygote_now.owner == os.getpid():
        _zygote_now.close()


def _secrets() -> list[str]:
    """Paths that must not be visible even where they lie inside what the minimal root binds (a
    checkout under /usr/src, a venv under /usr): this checkout, the venv, the working directory,
    and what RLVR_SANDBOX_HIDE names (os.pathsep-separated, e.g. dataset directories)."""
    package = Path(__file__).resolve().parents[1]
    paths = {package.parent, Path(sys.prefix).resolve()}
    with contextlib.suppress(OSError):  # a working directory that was deleted
        paths.add(Path.cwd().resolve())
    if package.parent.name == "src":
        paths.add(package.parent.parent)
    extra = os.environ.get("RLVR_SANDBOX_HIDE", "")
    paths |= {Path(p).resolve() for p in extra.split(os.pathsep) if p}
    return sorted(str(p) for p in paths)


@dataclass
class _Run:
    results: bytes
    stdout: bytes
    stderr: bytes
    timed_out: bool
    done: dict[str, Any]


def _execute(job: dict[str, Any], wall_seconds: float) -> _Run:
    """Hand `job` to a keeper forked from the zygote, collect its streams, kill it at the deadline."""
    ctrl, theirs = socket.socketpair()
    pipes = [os.pipe() for _ in range(3)]  # stdout, stderr, results
    try:
        try:
            _zygote().request([theirs.fileno()] + [w for _, w in pipes])
        except OSError:
            _zygote(restart=True).request([theirs.fileno()] + [w for _, w in pipes])
    finally:
        theirs.close()
        for _, w in pipes:
            os.close(w)
    started = time.monotonic()
    payload = json.dumps(job).encode()
    sinks = {r: bytearray() for r, _ in pipes}
    try:
        ctrl.settimeout(KEEPER_GRACE_SECONDS)
        try:
            ctrl.sendall(FRAME.pack(len(payload)) + payload)
        except OSError as exc:
            _zygote(restart=True)
            raise SandboxUnavailable(f"the sandbox did not take the job: {exc}") from exc
        ctrl.setblocking(False)
        selector = selectors.DefaultSelector()
        for fd in sinks:
            selector.register(fd, selectors.EVENT_READ)
        selector.register(ctrl, selectors.EVENT_READ)
        answer, done, open_streams = bytearray(), None, len(sinks)
        deadline, kill_sent, timed_out, done_at = started + wall_seconds, None, False, 0.0
        while done is None or (open_streams and time.monotonic() < done_at + 0.5):
            now = time.monotonic()
            if done is None and kill_sent is None and now >= deadline:
                timed_out, kill_sent = True, now
                with contextlib.suppress(OSError):
                    ctrl.send(b"kill")
            if kill_sent is not None and done is None and now > kill_sent + KEEPER_GRACE_SECONDS:
                _zygote(restart=True)  # a keeper that does not answer: start over
                raise SandboxUnavailable("the sandbox did not end a run it was told to kill")
            wait = (deadline if kill_sent is None else kill_sent + KEEPER_GRACE_SECONDS) - now
            if done is not None:
                wait = done_at + 0.5 - now
            for key, _ in selector.select(max(wait, 0.0)):
                if key.fileobj is ctrl:
                    chunk = ctrl.recv(65536)
                    answer += chunk
                    if b"\n" in answer or not chunk:
                        line = bytes(answer).split(b"\n")[0]
                        done = json.loads(line) if line else {"setup": {"error": "keeper died"}}
                        done_at = time.monotonic()
                        selector.unregister(ctrl)
                    continue
                fd = int(key.fd)
                chunk = os.read(fd, 65536)
                if not chunk:
                    selector.unregister(fd)
                    open_streams -= 1
                    continue
                room = MAX_OUTPUT_BYTES - len(sinks[fd])
                if room > 0:
                    sinks[fd].extend(chunk[:room])
        selector.close()
        assert done is not None
    finally:
        ctrl.close()
        for fd in sinks:
            os.close(fd)
    out, err, results = sinks.values()
    return _Run(bytes(results), bytes(out), bytes(err), timed_out, done)


def _job(
    code: str,
    entry: str,
    inputs: list[list[Any]],
    limits: SandboxLimits,
    isolate: bool,
    require: Sequence[str],
    workdir: str | None = None,
) -> dict[str, Any]:
    # RLIMIT_NPROC counts every process of the (real) user: a root runner gives each run a uid of
    # its own, so the budget is the run's alone; an unprivileged runner running unisolated allows
    # its current count plus the budget.
    # Isolated without root, the run has a user namespace of its own, where the kernel counts its
    # processes apart from the user's others (privileges.py).
    shared = os.geteuid() != 0 and not isolate
    nproc = limits.max_processes + (_user_process_count() if shared else 0)
    return {
        "code": code,
        "entry": entry,
        "inputs": inputs,
        "isolate": isolate,
        "require": list(require),
        "workdir": workdir,
        "memory": limits.memory_bytes,
        "pids": limits.max_processes,
        "rlimits": {
            "RLIMIT_CPU": limits.cpu_seconds,
            "RLIMIT_AS": limits.memory_bytes,
            "RLIMIT_FSIZE": limits.max_file_bytes,
            "RLIMIT_NOFILE": limits.max_open_files,
            "RLIMIT_NPROC": nproc,
            "RLIMIT_CORE": 1,  # not 0: 1 is what stops a core_pattern pipe (jail.RLIMIT_CORE)
        },
    }


@cache
def _probe() -> tuple[dict[str, bool], dict[str, str]]:
    """Run a trivial program with every layer attempted and none required: what it got is what
    this host allows."""
    workdir = tempfile.mkdtemp(prefix="rlvr-sandbox-probe-")
    job = _job("def f():\n    return 1\n", "f", [[]], SandboxLimits(), True, [], workdir)
    try:
        run = _execute(job, 10.0)
    except (OSError, SandboxUnavailable) as exc:
        return dict.fromkeys(LAYERS, False), {"namespaces": f"the sandbox did not start: {exc}"}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    setup = run.done.get("setup", {})
    if "error" in setup:
        return dict.fromkeys(LAYERS, False), {"namespaces": str(setup["error"])}
    have = {k: bool(setup.get("have", {}).get(k)) for k in LAYERS}
    why = {k: str(v) for k, v in setup.get("why", {}).items() if not have.get(k) or k == "landlock"}
    if run.done.get("cgroup"):
        why["cgroup"] = f"cgroup {run.done['cgroup']}"
    if run.results.strip() != b'{"i": 0, "out": "1"}':
        have = dict.fromkeys(LAYERS, False)
        why = {"namespaces": f"the probe program did not run: {run.stderr[-300:]!r}"}
    return have, why


def capabilities() -> dict[str, bool]:
    """Which isolation layers this host allows (probed once, by running a trivial program)."""
    return dict(_probe()[0])


def capability_details() -> dict[str, str]:
    """Per layer: why it is missing, or (cgroup) which kind is used."""
    return dict(_probe()[1])


def mode() -> str:
    """ "root" or "rootless" where the sandbox runs here (MODE_DESCRIPTIONS), "unisolated" where it
    cannot isolate and RLVR_SANDBOX_UNISOLATED=1 says to run anyway, else "refused"."""
    if all(capabilities()[k] for k in REQUIRED):
        return "root" if os.geteuid() == 0 else "rootless"
    return "unisolated" if os.environ.get(UNISOLATED_ENV) == "1" else "refused"


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, allow_nan=False)


def _layers() -> tuple[dict[str, bool], list[str]]:
    """(what this host gives, the required layers it lacks); refuses where it lacks any."""
    caps = capabilities()
    missing = [k for k in REQUIRED if not caps.get(k)]
    if missing and os.environ.get(UNISOLATED_ENV) != "1":
        # Without these the candidate can read the answers on disk or reach the network: refuse
        # rather than run model-written code that way.
        raise SandboxUnavailable(
            f"the code sandbox cannot isolate code on this host, as root nor rootless (missing: "
            f"{', '.join(missing)}; see `rlvr sandbox check`); {SERVICE_HINT}; or set "
            f"{UNISOLATED_ENV}=1 to run without isolation (unsafe)"
        )
    return caps, missing


@dataclass
class ProgramResult:
    """One whole program's run (SandboxFusion's run_code): no tests, no verdict."""

    exit_code: int | None  # None: killed at the deadline; negative: killed by that signal
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float


def run_program(code: str, limits: SandboxLimits | None = None) -> ProgramResult:
    """Run `code` as a program (__main__) in the sandbox, with the same layers as run_tests."""
    limits = (limits or SandboxLimits()).clamped()
    caps, missing = _layers()
    started = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="rlvr-sandbox-") if missing else None
    require = [k for k in LAYERS if caps.get(k)]
    job = _job(code, "", [], limits, not missing, require, workdir) | {"program": True}
    try:
        run = _execute(job, limits.wall_seconds)
    finally:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    setup = run.done.get("setup", {})
    if "error" in setup and not run.timed_out:
        raise SandboxUnavailable(f"the sandbox could not set up a run: {setup['error']}")
    return ProgramResult(
        exit_code=None if run.timed_out else run.done.get("exit"),
        stdout=run.stdout.decode("utf-8", "replace"),
        stderr=run.stderr.decode("utf-8", "replace"),
        timed_out=run.timed_out,
        seconds=time.monotonic() - started,
    )


def run_tests(
    code: str, entry: str, tests: Sequence[TestCase], limits: SandboxLimits | None = None
) -> SandboxResult:
    """Run `code`, call `entry` on every test's args in the sandbox, and judge the outputs here."""
    limits = (limits or SandboxLimits()).clamped()
    caps, missing = _layers()
    started = time.monotonic()
    if not tests:
        return SandboxResult(0, 0, [], isolation=caps)
    workdir = tempfile.mkdtemp(prefix="rlvr-sandbox-") if missing else None
    require = [k for k in LAYERS if caps.get(k)]
    inputs = [list(t.args) for t in tests]
    job = _job(code, entry, inputs, limits, not missing, require, workdir)
    try:
        run = _execute(job, limits.wall_seconds)
    finally:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    setup = run.done.get("setup", {})
    if "error" in setup and not run.timed_out:  # killed at the deadline mid-setup: a timeout
        raise SandboxUnavailable(f"the sandbox could not set up a run: {setup['error']}")
    result = _judge(run.results, tests, run.timed_out, run.stdout, run.stderr, started, caps)
    result.uid = run.done.get("uid")
    return result


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


def _judge(
    raw: bytes,
    tests: Sequence[TestCase],
    timed_out: bool,
    out: bytes,
    err: bytes,
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
