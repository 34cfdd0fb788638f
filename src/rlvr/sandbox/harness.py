"""The sandbox's side: a zygote forks a keeper per run; the keeper forks the run's init, which builds
the isolation (jail.py), becomes the run's own uid and calls the candidate's function on each input.

    python -I -S harness.py SOCKET_FD < SECRETS_JSON      (started once per process by runner.py)

- zygote: imports, once, the stdlib modules candidates use and computes the mount plan and the
  seccomp filter; for each request (a control socket and three pipes, passed as descriptors) it forks
  a keeper and waits for the next. Forking a warm interpreter is what makes a run cheap.
- keeper (host namespaces, root when the runner is): reads the job from the control socket,
  unshares a PID namespace, forks the init, puts it in the run's cgroup, tells it its uid, waits for
  it to exit or for the runner's "kill" (the deadline is kept by the runner), then answers "done"
  with the exit status and what the init managed to set up. Rootless (the runner is not root), it
  first enters a user namespace of the run's own that maps only the runner's uid (privileges.py),
  which then owns the PID namespace and everything the init builds.
- init (PID 1 of the run's namespace): new mount, network, IPC, UTS and cgroup namespaces, the
  minimal root, Landlock, rlimits, the run's uid (rootless: the runner's) and no capability,
  seccomp; then the candidate. When the init exits the kernel kills every process left in the
  namespace, and the keeper's wait returns only after that.

Trust model: nothing the init writes is trusted. It only reports what the candidate's function
*returned* for each input, as canonical JSON; the expected values never enter these processes, and
the runner compares. So forging "PASSED", patching json, exiting early or an always-equal object
cannot earn a pass: the worst the candidate can do is report wrong outputs, which score 0.
Everything that needs privileges happens before the candidate's code is compiled.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import signal
import socket
import struct
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlvr.sandbox import jail, privileges
else:  # run as a script with -I: rlvr is not importable; the modules are loaded from beside it

    def _load(name: str) -> Any:
        import importlib.util

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
        spec = importlib.util.spec_from_file_location(f"rlvr_sandbox_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    jail, privileges = _load("jail"), _load("privileges")

# Imported once in the zygote, so a run pays nothing for them. Common needs of function-writing
# tasks, plus what the adversarial tests reach for; any other stdlib module is importable too (the
# minimal root holds the whole stdlib), only slower.
PRELOAD = [
    "abc",
    "array",
    "bisect",
    "collections",
    "contextlib",
    "copy",
    "ctypes",
    "dataclasses",
    "datetime",
    "decimal",
    "enum",
    "fractions",
    "functools",
    "glob",
    "hashlib",
    "heapq",
    "io",
    "itertools",
    "math",
    "operator",
    "queue",
    "random",
    "re",
    "statistics",
    "string",
    "subprocess",
    "tempfile",
    "textwrap",
    "threading",
    "time",
    "typing",
    "unicodedata",
    "unittest",
    "encodings.idna",
]

RESULT_FD = 3  # where the init reports; the candidate sees the same number (forging is harmless)
FRAME = struct.Struct("!Q")


def zygote(socket_fd: int, secrets: list[str]) -> None:
    import importlib
    import tempfile

    for name in PRELOAD:
        importlib.import_module(name)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd in (1, 2):  # so that no descriptor received later lands on a standard stream's number
        try:
            os.fstat(fd)
        except OSError:
            os.dup2(0, fd)
    root = os.geteuid() == 0
    context: dict[str, Any] = {
        "zygote": os.getpid(),
        "socket_fd": socket_fd,
        "rootless": not root,  # the run's namespaces are owned by a user namespace of its own
        "plan": jail.plan_root(secrets),
        "seccomp": jail.seccomp_program(),
        "landlock": privileges.landlock_abi(),
        "cgroups": jail.cgroup_layout() if root else "the runner is not root (rootless mode)",
        "uid_range": root and jail.uid_range_is_mapped(),
        # Only mounted on inside each run's private mount namespace; empty on the host.
        "staging": tempfile.mkdtemp(prefix="rlvr-sandbox-root-"),
    }
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # keepers are reaped by the kernel
    requests = socket.socket(fileno=socket_fd)
    try:
        while True:
            message, fds, _, _ = socket.recv_fds(requests, 16, 4)
            if not message:  # the runner is gone: so are we (keepers die with us)
                break
            if len(fds) == 4 and os.fork() == 0:
                try:
                    keeper(fds, context)
                finally:
                    os._exit(0)
            for fd in fds:
                os.close(fd)
    finally:
        os.rmdir(context["staging"])


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise EOFError("the runner closed the control socket")
        data += chunk
    return bytes(data)


def keeper(fds: list[int], context: dict[str, Any]) -> None:
    ctrl_fd, out_fd, err_fd, res_fd = fds
    jail.set_parent_death_signal(signal.SIGKILL)  # the zygote dies: so does every run in flight
    if os.getppid() != context["zygote"]:
        return
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.close(context["socket_fd"])
    ctrl = socket.socket(fileno=ctrl_fd)
    (size,) = FRAME.unpack(_read_exactly(ctrl, FRAME.size))
    job = json.loads(_read_exactly(ctrl, size))
    why: dict[str, str] = {}
    pid_namespace = False
    if job["isolate"]:
        try:
            if context["rootless"]:  # the PID namespace, and all the init makes, are owned by it
                privileges.enter_user_namespace(os.getuid(), os.getgid())
            jail.unshare(jail.CLONE_NEWPID)
            pid_namespace = True
        except OSError as exc:
            why["namespaces"] = str(exc)
    status_r, status_w = os.pipe()
    release_r, release_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(status_r)
        os.close(release_w)
        ctrl.detach()
        init(job, context, pid_namespace, status_w, release_r, (out_fd, err_fd, res_fd))
    for fd in (out_fd, err_fd, res_fd, status_w, release_r):
        os.close(fd)

    def kill() -> None:
        for send in (os.kill, os.killpg):  # the namespace's init; or, without one, its group
            with contextlib.suppress(OSError):
                send(pid, signal.SIGKILL)

    cgroup: list[str] = []

    def end_with_the_zygote(signum: int, frame: Any) -> None:
        """The zygote is gone (the runner exited or restarted it) while this run is in flight: end
        the run and remove its cgroup, which dying at once by SIGKILL left on the host."""
        kill()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)  # returns once every process of the run is gone
        jail.remove_cgroup(cgroup)
        os._exit(0)

    signal.signal(signal.SIGTERM, end_with_the_zygote)
    jail.set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != context["zygote"]:  # it died before this signal was set
        end_with_the_zygote(signal.SIGTERM, None)

    uid = None
    if context["rootless"]:
        if pid_namespace:  # in its user namespace: the runner's uid, without capabilities
            uid = os.getuid()
        why["per_run_uid"] = (
            "rootless: one uid is mapped, the runner's (each run still has a process count of its "
            "own: RLIMIT_NPROC is counted per user namespace)"
        )
    elif os.geteuid() == 0:
        uid = jail.RUN_UID_BASE + pid if context["uid_range"] else jail.NOBODY
        if not context["uid_range"]:
            why["per_run_uid"] = "uids above the run range are not mapped here; all runs are nobody"
    layout = context["cgroups"]
    if isinstance(layout, str):
        why["cgroup"] = layout
    elif job["isolate"]:
        try:
            cgroup = jail.create_cgroup(layout, f"rlvr-sandbox-{pid}", job["memory"], job["pids"])
            jail.join_cgroup(cgroup, pid)
        except OSError as exc:
            why["cgroup"] = f"{exc}"
            jail.remove_cgroup(cgroup)
            cgroup = []
    release = {"uid": uid, "cgroup": bool(cgroup), "why": why}  # the init waits for this
    os.write(release_w, json.dumps(release).encode())
    os.close(release_w)

    try:
        exited: Any = os.pidfd_open(pid)  # readable once the init (and its namespace) is gone
    except OSError:  # kernels before 5.3: poll
        exited = None
    watching: list[Any] = [ctrl]
    status = None
    while status is None:
        waitables = watching if exited is None else [*watching, exited]
        readable, _, _ = select.select(waitables, [], [], 0.01 if exited is None else None)
        if ctrl in readable:
            ctrl.recv(64)  # "kill", or the runner is gone: either way, end the run now
            kill()
            watching = []
        if exited is not None and exited in readable:
            _, status = os.waitpid(pid, 0)
        elif exited is None:
            finished, raw_status = os.waitpid(pid, os.WNOHANG)
            status = raw_status if finished else None
    if not pid_namespace:
        kill()  # what the init started in its session (a new session's grandchild escapes)
    jail.remove_cgroup(cgroup)
    with os.fdopen(status_r, "rb") as f:
        raw = f.read()
    setup = json.loads(raw) if raw else {"error": "the run's init died before reporting its setup"}
    done = {
        "exit": os.waitstatus_to_exitcode(status),
        "setup": setup,
        "uid": uid,
        "cgroup": layout[0] if cgroup else None,
    }
    with contextlib.suppress(OSError):  # the runner gave up on this run
        ctrl.sendall(json.dumps(done).encode() + b"\n")


def init(
    job: dict[str, Any],
    context: dict[str, Any],
    pid_namespace: bool,
    status_w: int,
    release_r: int,
    streams: tuple[int, int, int],
) -> None:
    have: dict[str, bool] = {}
    try:
        jail.set_parent_death_signal(signal.SIGKILL)  # the keeper dies: so does the run
        os.setsid()
        with os.fdopen(release_r, "rb") as f:
            release = json.loads(f.read())
        why: dict[str, str] = release["why"]
        uid = release["uid"]
        have["cgroup"] = release["cgroup"]
        if job["isolate"] and pid_namespace:
            try:
                jail.unshare(
                    jail.CLONE_NEWNS
                    | jail.CLONE_NEWNET
                    | jail.CLONE_NEWIPC
                    | jail.CLONE_NEWUTS
                    | jail.CLONE_NEWCGROUP
                )
                have["namespaces"] = True
            except OSError as exc:
                why["namespaces"] = str(exc)
        if have.get("namespaces"):  # never mount anything outside a private mount namespace
            try:
                jail.build_root(context["staging"], context["plan"], uid or 0)
                have["minimal_root"] = have["private_proc"] = have["private_tmp"] = True
            except OSError as exc:
                why["minimal_root"] = str(exc)
        if have.get("minimal_root"):
            _landlock(context, have, why)
        workdir = "/tmp" if have.get("minimal_root") else job.get("workdir") or "/"
        if workdir != "/tmp" and uid is not None and not context["rootless"]:  # unisolated
            os.chown(workdir, uid, uid)  # the runner's temp dir, made the run's
            os.chmod(workdir, 0o700)
        os.chdir(workdir)
        for name, value in job["rlimits"].items():  # never above what the runner may set
            hard = resource.getrlimit(getattr(resource, name))[1]
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(getattr(resource, name), (value, value))
        if uid is not None:
            _drop_privileges(uid, context["rootless"], have)
        else:
            why["unprivileged_user"] = "the runner is not root: the candidate runs as its user"
        if context["seccomp"] is None:
            why["seccomp"] = "no syscall table for this CPU architecture"
        else:
            try:
                jail.install_seccomp(context["seccomp"])
                have["seccomp"] = True
            except OSError as exc:
                why["seccomp"] = str(exc)
        missing = [f"{k} ({why.get(k, 'not set up')})" for k in job["require"] if not have.get(k)]
        if missing:
            raise RuntimeError("could not set up " + "; ".join(missing))
    except BaseException as exc:
        os.write(status_w, json.dumps({"error": f"{exc}"[:500]}).encode())
        os._exit(1)
    os.write(status_w, json.dumps({"have": have, "why": why}).encode())
    out_fd, err_fd, res_fd = streams
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.dup2(res_fd, RESULT_FD)
    os.closerange(RESULT_FD + 1, 1 << 20)  # the zygote's socket, the control and status pipes
    status = 0
    if job.get("program"):
        status = run_program(job["code"])
    else:
        run_candidate(job["code"], job["entry"], job["inputs"])
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):  # whatever the candidate made of them
            stream.flush()
    os._exit(status)  # threads the candidate left running are not waited for: the kernel kills them


def run_program(code: str) -> int:
    """A whole program, run as __main__ (SandboxFusion's run_code, served by `rlvr sandbox serve`):
    its exit status is what it gave sys.exit, 1 for an uncaught exception (traceback on stderr)."""
    try:
        exec(compile(code, "<program>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return (exc.code or 0) & 0xFF
        with contextlib.suppress(BaseException):
            print(exc.code, file=sys.stderr)
        return 1
    except BaseException:
        import traceback

        with contextlib.suppress(BaseException):
            traceback.print_exc()
        return 1
    return 0


def _landlock(context: dict[str, Any], have: dict[str, bool], why: dict[str, str]) -> None:
    """File access limited to what the minimal root was built from (privileges.py)."""
    abi = context["landlock"]
    if isinstance(abi, str):
        why["landlock"] = abi
        return
    read_only = [op[1] for op in context["plan"] if op[0] == "bind"] + ["/etc", "/proc"]
    devices = [f"/dev/{name}" for name in jail.DEVICES]
    try:
        privileges.restrict_filesystem(abi, read_only, list(jail.SCRATCH_DIRS), devices)
        have["landlock"], why["landlock"] = True, f"ABI {abi}"
    except OSError as exc:
        why["landlock"] = str(exc)


def _drop_privileges(uid: int, rootless: bool, have: dict[str, bool]) -> None:
    """Root: become the run's uid (which clears the capabilities). Rootless: the uid is already the
    runner's; every capability the user namespace gave is dropped. Both: empty bounding set."""
    privileges.drop_bounding_set()
    if rootless:
        privileges.drop_capabilities()
    else:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        have["per_run_uid"] = uid != jail.NOBODY
    privileges.check_no_capabilities()
    have["unprivileged_user"] = True
    jail.set_parent_death_signal(signal.SIGKILL)  # a uid or capability change clears it


def run_candidate(code: str, entry: str, inputs: list[list[Any]]) -> None:
    write = os.write
    dumps = json.dumps
    sys.argv = [sys.argv[0], str(RESULT_FD)]

    def report(record: dict[str, object]) -> None:
        try:
            line = dumps(record, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError):
            line = dumps({"i": record.get("i"), "error": "unserializable output"})
        write(RESULT_FD, (line + "\n").encode())

    namespace: dict[str, object] = {"__name__": "__candidate__"}
    try:
        exec(compile(code, "<candidate>", "exec"), namespace)
        fn = namespace[entry]
    except BaseException as exc:
        report({"i": -1, "error": f"load: {type(exc).__name__}: {exc}"[:300]})
        return
    for i, args in enumerate(inputs):
        try:
            value = fn(*args)  # type: ignore[operator]
        except BaseException as exc:
            report({"i": i, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        try:
            # Strict canonical form: only JSON types; an object with a custom __eq__ cannot pass.
            out = dumps(value, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            report({"i": i, "error": f"unserializable output of type {type(value).__name__}"})
            continue
        report({"i": i, "out": out})


if __name__ == "__main__":
    zygote(int(sys.argv[1]), json.loads(sys.stdin.read()))
