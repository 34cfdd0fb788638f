"""The code sandbox against hostile programs (rlvr.sandbox).

Every program below tries to earn reward without solving the task (double the input) or to hurt the
host; most are written so that they pass only if their attack worked. Each must: earn reward 0 (not
all tests passed), return within its deadline + 1 s, leave no process of its run's uid running, and
leave the host's canary file, canary environment variable and scratch directories untouched and
unread. Containment tests need what the sandbox requires (namespaces, the minimal root, root to
switch uids): without it they are skipped with the reason, and fail under CI (CI=...), which must
provide it.

Longer than our ~500-line guide on purpose: the hostile programs are one catalogue, read together.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import rlvr
from rlvr.sandbox import SandboxLimits, TestCase, capabilities, capability_details, jail, run_tests
from rlvr.sandbox import runner as runner_module

TESTS = [TestCase((1,), 2), TestCase((5,), 10, hidden=True), TestCase((-3,), -6, hidden=True)]
SOLUTION = "def solve(x):\n    return 2 * x\n"
WALL = 2.0
CANARY_VALUE = "rlvr-canary-7f3a"
PWNED = "rlvr_pwned"  # the name hostile programs write under, on the host's scratch directories
HOST_SCRATCH = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")

TestCase.__test__ = False  # type: ignore[attr-defined]  # a dataclass, not a pytest class


@pytest.fixture(autouse=True)
def isolating_sandbox() -> None:
    """Every test runs code in the sandbox, which refuses to run without its required layers."""
    missing = [k for k in runner_module.REQUIRED if not capabilities()[k]]
    if missing:
        details = capability_details()
        why = "; ".join(f"{k}: {details.get(k, 'missing')}" for k in missing)
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the sandbox isolated (as root, with namespaces): {why}")
        pytest.skip(f"the sandbox cannot isolate code on this host: {why}")


def processes_of(uid: int | None) -> list[int]:
    """Processes of runs alive right now: as root, those running as `uid` (a run's uid is its own:
    other suites do not count; where runs are all `nobody`, the host's own nobody daemons would
    count: none). Rootless, runs share this user's uid: this user's processes in a PID namespace
    other than this one's (each run's init and what it started; a run in flight counts too)."""
    rootless = runner_module.mode() == "rootless"
    if uid is None or not (capabilities()["per_run_uid"] or rootless):
        return []
    ours = os.readlink("/proc/self/ns/pid")
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid and (
                    not rootless or os.readlink(entry / "ns" / "pid") != ours
                ):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@functools.cache
def cgroup_parents() -> list[str]:
    """Where runs' cgroups are made (the zygote shares this process's cgroups)."""
    layout = jail.cgroup_layout()
    return [] if isinstance(layout, str) or not capabilities()["per_run_uid"] else layout[1]


@pytest.fixture()
def canary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "canary.txt"
    path.write_text(CANARY_VALUE)
    path.chmod(0o600)
    monkeypatch.setenv("RLVR_CANARY", CANARY_VALUE)
    return path


def assert_contained(result: runner_module.SandboxResult, elapsed: float, wall: float) -> None:
    """Reward 0, on time, nothing of the run left running, nothing left on the host's scratch."""
    assert not result.all_passed, result.outcomes
    assert elapsed < wall + 1.0, elapsed
    assert result.uid is not None and result.uid != 0
    deadline = time.monotonic() + 1.0  # give the kernel a moment to reap
    while processes_of(result.uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not processes_of(result.uid)
    for parent in cgroup_parents():  # the run's cgroup is gone with it
        assert not Path(parent, f"rlvr-sandbox-{result.uid - jail.RUN_UID_BASE}").exists()
    for directory in HOST_SCRATCH:
        assert not Path(directory, PWNED).exists(), directory
    assert len(result.stdout) <= runner_module.MAX_OUTPUT_BYTES


def run_hostile(code: str, wall: float = WALL, **limits: int) -> runner_module.SandboxResult:
    """One sandbox run (not the visible/hidden pair of rlvr.sandbox.run_tests), checked contained."""
    started = time.monotonic()
    result = runner_module.run_tests(
        code, "solve", TESTS, SandboxLimits(wall_seconds=wall, **limits)
    )
    assert_contained(result, time.monotonic() - started, wall)
    return result


def test_a_correct_solution_passes_every_test() -> None:
    result = run_tests(SOLUTION, "solve", TESTS)
    assert result.outcomes == ["pass", "pass", "pass"] and result.all_passed
    assert result.seconds < 5


def test_zero_tests_score_zero() -> None:
    result = run_tests(SOLUTION, "solve", [])
    assert result.total == 0 and not result.all_passed and result.score == 0.0


def test_strict_types_int_is_not_float_or_bool() -> None:
    as_float = run_tests("def solve(x):\n    return 2.0 * x\n", "solve", TESTS)
    assert as_float.passed == 0
    truthy = run_tests("def solve(x):\n    return True\n", "solve", [TestCase((1,), 1)])
    assert truthy.outcomes == ["fail"]


def test_an_honest_program_may_import_any_stdlib_module_and_use_tmp() -> None:
    code = (
        "import sqlite3, json, tempfile\n"
        "def solve(x):\n    db = sqlite3.connect(':memory:')\n"
        "    with tempfile.NamedTemporaryFile('w', dir='/tmp') as f:\n        f.write('x')\n"
        "    return db.execute('select ?', (2 * x,)).fetchone()[0]\n"
    )
    assert run_tests(code, "solve", TESTS).all_passed


def test_an_honest_program_may_use_unix_sockets_asyncio_and_forked_processes() -> None:
    """The seccomp filter denies socket families the network namespace does not cover (AF_VSOCK,
    AF_PACKET, ...); what stdlib programs use (unix socket pairs, asyncio, multiprocessing's fork,
    name lookup through /etc/hosts) still works."""
    code = (
        "import asyncio, multiprocessing, socket\n"
        "def solve(x):\n"
        "    a, b = socket.socketpair()\n"
        "    a.sendall(b'x')\n"
        "    assert b.recv(1) == b'x'\n"
        "    socket.getaddrinfo('localhost', 80)\n"
        "    async def twice():\n        return 2 * x\n"
        "    doubled = asyncio.run(twice())\n"
        "    context = multiprocessing.get_context('fork')\n"
        "    queue = context.Queue()\n"
        "    child = context.Process(target=lambda: queue.put(doubled))\n"
        "    child.start()\n"
        "    value = queue.get(timeout=5)\n"
        "    child.join()\n"
        "    return value\n"
    )
    result = run_tests(code, "solve", TESTS)
    assert result.all_passed, (result.outcomes, result.stderr[-500:])


PACKAGE = Path(rlvr.__file__).resolve().parent
# Where item 1's candidate found the answers: the installed package (code_tasks.json), the checkout,
# the venv, the working directory, and the usual homes of data.
SECRET_PLACES = [
    str(PACKAGE),
    str(PACKAGE / "envs" / "code_tasks.json"),
    str(PACKAGE.parent),
    sys.prefix,
    str(Path(__file__).resolve().parents[1]),  # this checkout
    "/home",
    "/opt",
    "/srv",
    "/work",
    "/root/.cache",
    "/etc/passwd-",
    "/etc/shadow",
]

HOSTILE = {
    "infinite loop": "def solve(x):\n    while True:\n        pass\n",
    "loop under except BaseException": (
        "def solve(x):\n    while True:\n        try:\n            while True:\n                pass\n"
        "        except BaseException:\n            pass\n"
    ),
    "alarm ignored": (
        "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nsignal.alarm(0)\n"
        "def solve(x):\n    while True:\n        pass\n"
    ),
    "fork bomb": (
        "import os\ndef solve(x):\n    while True:\n        try:\n            os.fork()\n"
        "        except OSError:\n            pass\n"
    ),
    "grandchild in a new session": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        while True:\n            time.sleep(1)\n    os._exit(0)\n"
        "def solve(x):\n    return 3 * x\n"
    ),
    "a thread left running": (
        "import threading, time\n"
        "threading.Thread(target=lambda: time.sleep(1000), daemon=False).start()\n"
        "def solve(x):\n    return 3 * x\n"
    ),
    "background subprocess": (
        "import subprocess\nsubprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
        "def solve(x):\n    return 3 * x\n"
    ),
    "memory bomb": "def solve(x):\n    block = bytearray(8 << 30)\n    return len(block)\n",
    "output flood": (
        "import sys\ndef solve(x):\n    while True:\n        sys.stdout.write('x' * 65536)\n"
    ),
    "disk fill": (
        "def solve(x):\n    with open('big', 'wb') as f:\n        while True:\n"
        "            f.write(b'0' * (1 << 20))\n"
    ),
    "writing outside the temp dir": (
        "def solve(x):\n    for p in ('/etc/rlvr_pwned', '/root/rlvr_pwned', '/work/rlvr_pwned'):\n"
        "        try:\n            open(p, 'w').write('x')\n        except OSError:\n            pass\n"
        "    return 0\n"
    ),
    "reading environment secrets": (
        "import os\ndef solve(x):\n    print(dict(os.environ))\n"
        "    return os.environ.get('RLVR_CANARY', 0)\n"
    ),
    "reading /proc/1/environ": (
        "def solve(x):\n    for pid in (1, 2):\n        try:\n"
        "            print(open(f'/proc/{pid}/environ').read())\n        except OSError:\n"
        "            pass\n    return 0\n"
    ),
    "killing the parent": "import os\nos.kill(os.getppid(), 9)\ndef solve(x):\n    return 3 * x\n",
    "killing every process it can": (
        "import os\ntry:\n    os.kill(-1, 9)\nexcept OSError:\n    pass\n"
        "def solve(x):\n    return 3 * x\n"
    ),
    "killing the process group": "import os\nos.killpg(0, 9)\ndef solve(x):\n    return 3 * x\n",
    "sys.exit(0) before the tests": "import sys\nsys.exit(0)\n",
    "os._exit(0) before the tests": "import os\nos._exit(0)\n",
    "SkipTest at import": "import unittest\nraise unittest.SkipTest('skip me')\n",
    "always-equal object": (
        "class Same:\n    def __eq__(self, other):\n        return True\n"
        "def solve(x):\n    return Same()\n"
    ),
    "patching json": (
        "import json\njson.dumps = lambda *a, **k: '2'\ndef solve(x):\n    return 0\n"
    ),
    "patching builtins": (
        "import builtins\nbuiltins.isinstance = lambda *a: True\ndef solve(x):\n    return 0\n"
    ),
    "reading caller frames": (
        "import sys\ndef solve(x):\n    return sys._getframe(1).f_locals.get('inputs')\n"
    ),
    "reading the harness": (
        "import sys\ndef solve(x):\n    return open(sys.argv[0]).read()[:50]\n"
    ),
    "forged PASSED output": (
        "print('PASSED 3/3')\nimport sys\nprint('ok', file=sys.stderr)\ndef solve(x):\n    return 0\n"
    ),
    "forged result records": (
        "import os, sys\nfd = int(sys.argv[1])\n"
        'os.write(fd, b\'{"i": 0, "out": "2"}\\n{"i": 1, "out": "10"}\\n\')\n'
        "def solve(x):\n    return 0\n"
    ),
    "hard-coding the visible tests": "def solve(x):\n    return {1: 2}.get(x, 0)\n",
    "printing only the first expected line": "print(2)\ndef solve(x):\n    print(2 * x)\n",
    "empty answer": "",
    "syntax error": "def solve(x) return 2 * x\n",
    # Issue 17: each of these passes only if its attack worked.
    "disk oracle: the installed package and the checkout": (
        "import glob, os, sys\n"
        f"PLACES = {SECRET_PLACES!r}\n"
        "def solve(x):\n"
        "    seen = [p for p in PLACES if os.path.exists(p)]\n"
        "    seen += glob.glob('/*/*/rlvr') + glob.glob('/*/*/*/rlvr') + glob.glob('/*/*/src/rlvr')\n"
        "    seen += glob.glob('/root/.pyenv/versions/*/lib/python3*/site-packages/*')\n"
        "    seen += glob.glob('/usr/local/lib/python3*/*-packages/*')\n"
        "    sys.path[:0] = PLACES\n"
        "    try:\n        import rlvr\n        seen.append(rlvr.__file__)\n"
        "    except ImportError:\n        pass\n"
        "    print(seen)\n"
        "    return 2 * x if seen else -1\n"
    ),
    "nesting: new user, mount and network namespaces": (
        "import ctypes, os, subprocess\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "CLONE = {'x86_64': 56, 'aarch64': 220}[os.uname().machine]\n"
        "def solve(x):\n"
        "    won = [libc.unshare(flags) == 0 for flags in (0x10000000, 0x10020000, 0x40000000)]\n"
        "    pid = libc.syscall(CLONE, 0x10000000 | 17, 0, 0, 0, 0)  # clone(CLONE_NEWUSER)\n"
        "    if pid == 0:\n        os._exit(0)\n"
        "    won.append(pid > 0)\n"
        "    fd = os.open('/proc/self/ns/net', os.O_RDONLY)\n"
        "    won.append(libc.setns(fd, 0) == 0)\n"
        "    nested = subprocess.run(['unshare', '-U', '-r', 'unshare', '-U', '-r', 'true'])\n"
        "    won.append(nested.returncode == 0)\n"
        "    print(won)\n"
        "    return 2 * x if any(won) else -1\n"
    ),
    "mount, remount, chroot (also from a new user namespace)": (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def solve(x):\n"
        "    won = [\n"
        "        libc.mount(b'tmpfs', b'/tmp', b'tmpfs', 0, None) == 0,\n"
        "        libc.mount(None, b'/', None, 0x20, None) == 0,  # MS_REMOUNT read-write\n"
        "        libc.mount(b'/usr', b'/tmp', None, 0x1000, None) == 0,  # MS_BIND\n"
        "        libc.umount2(b'/proc', 2) == 0,\n"
        "        libc.chroot(b'/tmp') == 0,\n"
        "    ]\n"
        "    if libc.unshare(0x10000000 | 0x20000) == 0:  # a user + mount namespace of its own\n"
        "        won.append(libc.mount(b'tmpfs', b'/tmp', b'tmpfs', 0, None) == 0)\n"
        "    print(won)\n"
        "    return 2 * x if any(won) else -1\n"
    ),
    "writing into the minimal root": (
        "import glob\n"
        "def solve(x):\n"
        "    places = ['/', '/etc', '/usr', '/usr/local', '/root', '/dev', '/run', '/var']\n"
        "    places += glob.glob('/root/.pyenv/versions/*/lib/python3*/site-packages')\n"
        "    written = []\n"
        "    for place in places:\n"
        "        try:\n"
        f"            open(place.rstrip('/') + '/{PWNED}', 'w').close()\n"
        "            written.append(place)\n"
        "        except OSError:\n"
        "            pass\n"
        "    print(written)\n"
        "    return 2 * x if written else -1\n"
    ),
    "ptrace, the keyring and io_uring": (
        "import ctypes, os, time\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "NR = {'x86_64': (101, 250, 425), 'aarch64': (117, 219, 425)}[os.uname().machine]\n"
        "def solve(x):\n"
        "    child = os.fork()\n"
        "    if child == 0:\n        time.sleep(5)\n        os._exit(0)\n"
        "    won = [libc.syscall(NR[0], 16, child, 0, 0) == 0]  # PTRACE_ATTACH to its own child\n"
        "    won.append(libc.syscall(NR[1], 0, -3, 0) >= 0)  # KEYCTL_GET_KEYRING_ID, session\n"
        "    libc.syscall(NR[2], 1, None)  # io_uring_setup: EFAULT where it may be used\n"
        "    won.append(ctypes.get_errno() != 1)\n"
        "    print(won)\n"
        "    return 2 * x if any(won) else -1\n"
    ),
    # Review of issue 17's sandbox: what a hostile program reaches for next.
    "sockets the network namespace does not cover (vsock to the hypervisor, packet, alg, xdp)": (
        "import socket\n"
        "def solve(x):\n"
        "    made = []\n"
        "    for family, kind in ((40, 1), (40, 5), (17, 3), (38, 5), (44, 3), (15, 3), (31, 3)):\n"
        "        try:\n"
        "            socket.socket(family, kind).close()  # created only: nothing is contacted\n"
        "            made.append(family)\n"
        "        except OSError:\n"
        "            pass\n"
        "    print(made)\n"
        "    return 2 * x if made else -1\n"
    ),
    "hidden paths named by /proc (cmdline, mountinfo), through links and /proc/self/root": (
        "import os\n"
        "def solve(x):\n"
        "    harness = open('/proc/self/cmdline', 'rb').read().split(b'\\0')[3].decode()\n"
        "    places = [os.path.dirname(harness), os.path.dirname(os.path.dirname(harness))]\n"
        "    on_top = {}  # mount point: its last (visible) mount\n"
        "    for line in open('/proc/self/mountinfo'):\n"
        "        on_top[line.split()[4]] = line\n"
        "    # what the root plan covered (not where a bind went on top: python in /usr/local)\n"
        "    places += [p for p, line in on_top.items() if ' - tmpfs ' in line and 'size=64k' in line]\n"
        "    found = []\n"
        "    for place in places:\n"
        "        for route in (place, '/proc/self/root' + place, '/proc/1/root' + place,\n"
        "                      '/proc/1/cwd/..' + place):\n"
        "            try:\n"
        "                found += os.listdir(route)\n"
        "            except OSError:\n"
        "                pass\n"
        "        try:\n"
        "            os.symlink(place, '/tmp/link')\n"
        "            found += os.listdir('/tmp/link')\n"
        "        except OSError:\n"
        "            pass\n"
        "        finally:\n"
        "            if os.path.islink('/tmp/link'):\n"
        "                os.unlink('/tmp/link')\n"
        "    try:\n"
        "        found.append(open(harness).read(20))\n"
        "    except OSError:\n"
        "        pass\n"
        "    print(places, found)\n"
        "    return 2 * x if found else -1\n"
    ),
    "descriptors inherited from the zygote, the keeper or the init": (
        "import os\n"
        "names = os.listdir('/proc/self/fd')  # at load: what the run was given\n"
        "extra = []\n"
        "for name in names:\n"
        "    try:\n"
        "        target = os.readlink('/proc/self/fd/' + name)\n"
        "    except OSError:\n"
        "        continue  # the listing's own descriptor\n"
        "    if int(name) > 3:\n"
        "        extra.append((name, target))\n"
        "try:\n"
        "    extra.append(os.read(3, 1))  # the result channel is write-only\n"
        "except OSError:\n"
        "    pass\n"
        "def solve(x):\n"
        "    print(extra)\n"
        "    return 2 * x if extra else -1\n"
    ),
    "/sys, host devices, the kernel log and the loader's cache": (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def solve(x):\n"
        "    opened = []\n"
        "    reads = ['/sys/fs/cgroup', '/sys/class/net', '/dev/mem', '/dev/kmem', '/dev/kmsg',\n"
        "             '/dev/tty', '/dev/console', '/dev/vda', '/dev/sda', '/dev/nvme0n1',\n"
        "             '/dev/vsock', '/dev/port', '/proc/kcore']\n"
        "    for path in reads:\n"
        "        try:\n"
        "            os.close(os.open(path, os.O_RDONLY))\n"
        "            opened.append(path)\n"
        "        except OSError:\n"
        "            pass\n"
        "    for path in ('/etc/ld.so.cache', '/etc/passwd', '/proc/sysrq-trigger',\n"
        "                 '/proc/sys/kernel/hostname', '/proc/sys/vm/drop_caches'):\n"
        "        try:\n"
        "            os.close(os.open(path, os.O_WRONLY))\n"
        "            opened.append(path)\n"
        "        except OSError:\n"
        "            pass\n"
        "    buffer = ctypes.create_string_buffer(4096)\n"
        "    if libc.klogctl(3, buffer, 4096) >= 0:  # SYSLOG_ACTION_READ_ALL\n"
        "        opened.append('syslog')\n"
        "    print(opened)\n"
        "    return 2 * x if opened else -1\n"
    ),
    "kernel memory in empty files (tmpfs inodes, which no size= limits)": (
        "import os\n"
        "made = {}\n"
        "for d in ('/tmp', '/dev/shm'):\n"
        "    made[d] = 0\n"
        "    try:\n"
        "        while made[d] < 20000:\n"
        "            os.close(os.open(f'{d}/{made[d]}', os.O_CREAT | os.O_WRONLY, 0o600))\n"
        "            made[d] += 1\n"
        "    except OSError:\n"
        "        pass\n"
        "def solve(x):\n"
        "    print(made)\n"
        "    return 2 * x if max(made.values()) >= 20000 else -1  # 16k a directory\n"
    ),
    # A crash with RLIMIT_CORE other than 1 runs a core_pattern pipe (apport, systemd-coredump): a
    # root helper on the host gets the candidate's memory, hidden inputs included. Here core_pattern
    # is a file, so the program checks the limit a crash would see, in itself and in a child.
    "core dumps to the host's core_pattern pipe (RLIMIT_CORE lowered to 0)": (
        "import resource, subprocess, sys\n"
        "def solve(x):\n"
        "    for limits in ((0, 0), (0, 1)):\n"
        "        try:\n"
        "            resource.setrlimit(resource.RLIMIT_CORE, limits)\n"
        "        except (OSError, ValueError):\n"
        "            pass\n"
        "        try:\n"
        "            resource.prlimit(0, resource.RLIMIT_CORE, limits)\n"
        "        except (OSError, ValueError):\n"
        "            pass\n"
        "    child = [sys.executable, '-c', 'import resource; print(resource.getrlimit(4)[0])']\n"
        "    seen = {resource.getrlimit(resource.RLIMIT_CORE)[0]}\n"
        "    seen.add(int(subprocess.run(child, capture_output=True, text=True).stdout))\n"
        "    print(seen)\n"
        "    return 2 * x if seen != {1} else -1\n"
    ),
    # Issue 38: rootless, the run's user namespace gives it every capability over its namespaces
    # until the init drops them; as root, the uid change does.
    "capabilities: held, or used to rename the host, take a file, become root": (
        "import ctypes, os, socket\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def solve(x):\n"
        "    status = dict(l.split(':', 1) for l in open('/proc/self/status') if l.startswith('Cap'))\n"
        "    won = [k for k, v in status.items() if int(v, 16)]\n"
        "    if libc.sethostname(b'pwned', 5) == 0 or socket.gethostname() != 'sandbox':\n"
        "        won.append('hostname')\n"
        "    open('/tmp/f', 'w').close()\n"
        "    for call in (lambda: os.chown('/tmp/f', 0, 0), lambda: os.setuid(0),\n"
        "                 lambda: os.setgroups([0]), lambda: os.chroot('/tmp')):\n"
        "        try:\n"
        "            call()\n"
        "            won.append(call)\n"
        "        except OSError:\n"
        "            pass\n"
        "    print(won)\n"
        "    return 2 * x if won else -1\n"
    ),
    "clearing the parent-death signal, stopping the run's init": (
        "import ctypes, os, signal\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "won = [libc.prctl(1, 0, 0, 0, 0) == 0]  # PR_SET_PDEATHSIG 0: outlive the keeper\n"
        "os.kill(1, signal.SIGSTOP)  # the init of the run's namespace: ignored from inside\n"
        "won.append(open('/proc/1/stat').read().split(')')[1].split()[0] == 'T')\n"
        "def solve(x):\n"
        "    print(won)\n"
        "    return 2 * x if any(won) else -1\n"
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_program_earns_nothing_and_is_contained(name: str, canary: Path) -> None:
    canary_stat = canary.stat()
    result = run_hostile(HOSTILE[name])
    # The canaries: unchanged and never seen by the program.
    assert canary.read_text() == CANARY_VALUE and canary.stat().st_mtime == canary_stat.st_mtime
    assert CANARY_VALUE not in result.stdout + result.stderr
    assert os.environ["RLVR_CANARY"] == CANARY_VALUE
    for path in ("/etc/rlvr_pwned", "/root/rlvr_pwned", "/work/rlvr_pwned"):
        # lexists: False where this user may not look (/root, rootless), nor may the candidate
        assert not os.path.lexists(path)


@pytest.fixture()
def world_readable_dir() -> Iterator[Path]:
    """A directory any user may read, outside the checkout (where a dataset could lie)."""
    path = Path(tempfile.mkdtemp(prefix="rlvr-test-shared-"))
    path.chmod(0o755)
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def test_a_dataset_on_a_readable_path_is_not_an_oracle(world_readable_dir: Path) -> None:
    answers = world_readable_dir / "code_tests.json"
    answers.write_text('{"1": 2, "5": 10, "-3": -6}')
    answers.chmod(0o644)
    code = f"import json\ndef solve(x):\n    return json.load(open({str(answers)!r}))[str(x)]\n"
    result = run_hostile(code)
    assert "FileNotFoundError" in result.outcomes[0], result.outcomes


def test_scratch_directories_do_not_outlive_a_run() -> None:
    """/tmp, /var/tmp, /dev/shm and /run/lock: what one run writes the next cannot read, nor the host."""
    leave = (
        f"def solve(x):\n    for d in {HOST_SCRATCH!r}:\n"
        f"        open(d + '/{PWNED}', 'w').write('left behind')\n    return -1\n"
    )
    find = (
        f"import os\ndef solve(x):\n    found = [d for d in {HOST_SCRATCH!r}"
        f" if os.path.exists(d + '/{PWNED}')]\n    return 2 * x if found else -1\n"
    )
    first = run_hostile(leave)
    assert first.outcomes == ["fail"] * 3  # it could write: the directories are there, private
    run_hostile(find)


def test_memory_limit_holds_for_the_whole_run_not_per_process() -> None:
    """Four forks of 150 MiB under a 400 MiB limit: RLIMIT_AS alone (per process) lets all hold
    theirs at once; the run's cgroup does not (the program passes iff 3 or more held at once)."""
    if not capabilities()["cgroup"]:
        pytest.skip(f"no per-run cgroup here: {capability_details().get('cgroup')}")
    code = (
        "import os, time\n"
        "def solve(x):\n"
        "    r, w = os.pipe()\n"
        "    kids = []\n"
        "    for _ in range(4):\n"
        "        pid = os.fork()\n"
        "        if pid == 0:\n"
        "            block = b'1' * (150 << 20)\n"
        "            os.write(w, b'1')\n"
        "            time.sleep(10)\n"
        "            os._exit(0)\n"
        "        kids.append(pid)\n"
        "    time.sleep(1.5)\n"
        "    os.set_blocking(r, False)\n"
        "    reported = len(os.read(r, 64))\n"
        "    alive = sum(os.waitpid(k, os.WNOHANG) == (0, 0) for k in kids)\n"
        "    print(reported, alive)\n"
        "    return 2 * x if min(reported, alive) >= 3 else -1\n"
    )
    run_hostile(code, wall=4.0, memory_bytes=400 << 20)


def test_a_thread_bomb_does_not_starve_a_concurrent_honest_run() -> None:
    """Runs do not share a uid, so one run's processes do not count against another's limit;
    rootless they do share one, but each run's user namespace has a process count of its own."""
    if not capabilities()["per_run_uid"] and runner_module.mode() != "rootless":
        pytest.skip(f"runs share a uid here: {capability_details().get('per_run_uid')}")
    bomb = (
        "import threading, time\n"
        "def solve(x):\n"
        "    try:\n"
        "        while True:\n"
        "            threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "    except Exception:\n"
        "        pass\n"
        "    time.sleep(30)\n"
    )
    honest = (
        "import threading\n"
        "def solve(x):\n"
        "    out = []\n"
        "    threads = [threading.Thread(target=lambda: out.append(2 * x)) for _ in range(16)]\n"
        "    for t in threads:\n        t.start()\n"
        "    for t in threads:\n        t.join()\n"
        "    return out[0] if len(out) == 16 else -1\n"
    )
    with ThreadPoolExecutor(1) as pool:
        bombing = pool.submit(run_hostile, bomb, 3.0)
        time.sleep(1.0)  # the bomb holds every thread it may have
        honest_result = runner_module.run_tests(honest, "solve", TESTS)
        assert honest_result.all_passed, honest_result.outcomes
        assert bombing.result().timed_out


def test_host_sockets_are_unreachable(world_readable_dir: Path) -> None:
    """A TCP listener on the host's loopback, a unix socket on a path anyone may open, an abstract
    unix socket: the program passes iff it reached one, and none hears from it."""
    path = world_readable_dir / "host.sock"
    abstract = f"\0rlvr-test-{os.getpid()}"
    servers = []
    for family, address in ((socket.AF_UNIX, str(path)), (socket.AF_UNIX, abstract)):
        server = socket.socket(family)
        server.bind(address)
        server.listen()
        servers.append(server)
    path.chmod(0o777)
    tcp = socket.create_server(("127.0.0.1", 0))
    servers.append(tcp)
    port = tcp.getsockname()[1]
    code = (
        "import socket\n"
        "def solve(x):\n"
        "    reached = []\n"
        f"    for family, address in ((socket.AF_UNIX, {str(path)!r}), (socket.AF_UNIX, {abstract!r}),"
        f" (socket.AF_INET, ('127.0.0.1', {port}))):\n"
        "        s = socket.socket(family)\n"
        "        s.settimeout(0.5)\n"
        "        try:\n"
        "            s.connect(address)\n"
        "            s.sendall(b'pwned')\n"
        "            reached.append(address)\n"
        "        except OSError:\n"
        "            pass\n"
        "    print(reached)\n"
        "    return 2 * x if reached else -1\n"
    )
    try:
        run_hostile(code)
        for server in servers:
            server.settimeout(0.05)
            with pytest.raises(TimeoutError):
                server.accept()
    finally:
        for server in servers:
            server.close()


def test_host_processes_are_invisible() -> None:
    """The host's /proc shows every command line (the trainer's included): the run sees its own."""
    marker = f"rlvr-proc-canary-{os.getpid()}"
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", marker])
    code = (
        "import os\n"
        "def solve(x):\n"
        "    seen = []\n"
        "    for pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
        "        try:\n"
        "            seen.append(open(f'/proc/{pid}/cmdline').read())\n"
        "        except OSError:\n"
        "            pass\n"
        f"    found = [c for c in seen if {marker!r} in c or 'pytest' in c]\n"
        "    return 2 * x if found or len(seen) > 1 else -1\n"
    )
    try:
        result = run_hostile(code)
        assert marker not in result.stdout
    finally:
        host.kill()
        host.wait()


@pytest.mark.parametrize("prefix", ["interpreter here", "/usr/local", "/usr"])
def test_the_root_plan_never_hides_python_and_hides_every_site_packages(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the plan (no mounts): with python in /usr/local (Docker's python images) or /usr
    (distributions), its prefix is bound, its site-packages and the named secrets are covered."""
    if prefix != "interpreter here":
        monkeypatch.setattr(sys, "base_prefix", prefix)
        monkeypatch.setattr(sys, "base_exec_prefix", prefix)
    # /usr/share/doc is deleted by slim container images; /usr/share is on every Linux.
    secret = "/usr/share/doc" if os.path.isdir("/usr/share/doc") else "/usr/share"
    ops = jail.plan_root([secret, str(PACKAGE.parent)])
    hides = [op[1] for op in ops if op[0] == "hide"]
    python = os.path.realpath(sys.base_prefix)
    # The last mount on python's path or above it is what shows there: a bind of the host's.
    covering = [op for op in ops if op[0] in ("bind", "hide") and jail._inside(python, op[1])]
    assert covering and covering[-1][0] == "bind", covering
    for packages in Path(python).glob("lib*/python*/*-packages"):
        assert str(packages) in hides
    assert secret in hides and str(PACKAGE.parent) not in hides  # not under a bind: not there
    if not jail._inside(python, "/usr/local"):  # /usr/local is empty: no mount point shows in it
        assert not [h for h in hides if h.startswith("/usr/local/")], hides


def test_a_grandchild_cannot_report_after_the_deadline() -> None:
    """The run's init loops past the deadline while a grandchild in a new session waits to write
    every right answer into the result channel after the kill (its parent stops itself, holding the
    streams open): nothing of the run outlives its init, so nothing is read after it. Written
    before the deadline, the same records would pass all three tests."""
    code = (
        "import os, signal, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(1.2)  # past the deadline\n"
        "        for i, x in enumerate((1, 5, -3)):\n"
        '            os.write(3, b\'{"i": %d, "out": "%d"}\\n\' % (i, 2 * x))\n'
        "        os._exit(0)\n"
        "    os.kill(os.getpid(), signal.SIGSTOP)  # a stopped process holding the streams open\n"
        "    os._exit(0)\n"
        "def solve(x):\n"
        "    while True:\n"
        "        pass\n"
    )
    result = run_hostile(code, wall=1.0)
    assert result.timed_out and result.outcomes == ["missing"] * 3, result.outcomes


def test_a_run_in_flight_when_the_zygote_ends_leaves_nothing_behind() -> None:
    """The runner exits (or restarts its zygote) while a run is in flight: the run ends, and its
    cgroup goes with it (its keeper, killed at once, used to leave it on the host)."""
    from rlvr.sandbox import SandboxUnavailable

    outcome: list[BaseException] = []

    def run() -> None:
        try:
            runner_module.run_tests(HOSTILE["fork bomb"], "solve", TESTS, SandboxLimits(5.0))
        except SandboxUnavailable as exc:
            outcome.append(exc)

    before = {p for parent in cgroup_parents() for p in Path(parent).glob("rlvr-sandbox-*")}
    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 3.0
    runs: set[Path] = set()
    while not runs and time.monotonic() < deadline:
        time.sleep(0.05)
        runs = {p for parent in cgroup_parents() for p in Path(parent).glob("rlvr-sandbox-*")}
        runs -= before
        if not cgroup_parents():
            time.sleep(0.5)  # no cgroup to wait for: let the run start
            break
    zygote = runner_module._zygote_now
    assert zygote is not None
    zygote.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and outcome, "the run should end when its zygote does"
    for path in runs:
        assert not path.exists(), path
        uid = jail.RUN_UID_BASE + int(path.name.rsplit("-", 1)[1])
        assert not processes_of(uid)


def test_seccomp_and_pivot_root_on_an_unknown_cpu_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where there is no syscall table (riscv64, or a 32-bit interpreter on x86_64, whose syscalls
    the x86_64 filter would kill): no filter, and pivot_root fails with a reason, not a KeyError."""
    import platform
    import struct

    for machine in ("x86_64", "aarch64"):  # with a 64-bit interpreter: built (jumps fit a byte)
        monkeypatch.setattr(platform, "machine", lambda machine=machine: machine)
        program = jail.seccomp_program()
        assert program is not None and len(program) % 8 == 0
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    assert jail.seccomp_program() is None
    with pytest.raises(OSError, match="riscv64"):
        jail.syscall_number("pivot_root")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(struct, "calcsize", lambda fmt: 4)
    assert jail.seccomp_program() is None
    with pytest.raises(OSError, match="32-bit"):
        jail.syscall_number("pivot_root")


def fake_cgroup_host(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, own: str, mounts: str, busy: bool
) -> Path:
    """Make jail.cgroup_layout see a host of another kind: /proc/self/cgroup and mountinfo as
    given ({root} in `mounts` is a directory standing for the cgroup2 mount), and, with `busy`,
    a kernel that answers EBUSY to enabling controllers (the cgroup holds processes)."""
    import builtins
    import errno
    import io

    real_open: Any = builtins.open
    files = {"/proc/self/cgroup": own, "/proc/self/mountinfo": mounts.format(root=tmp_path)}

    def fake_open(path: str, mode: str = "r", *args: object, **kwargs: object) -> object:
        if path in files:
            return io.StringIO(files[path])
        if busy and str(path).endswith("cgroup.subtree_control") and "w" in mode:
            raise OSError(errno.EBUSY, "Device or resource busy")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(jail, "open", fake_open, raising=False)
    monkeypatch.delenv("RLVR_SANDBOX_CGROUP", raising=False)
    return tmp_path


V2_MOUNT = "30 23 0:26 / {root} rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw\n"


@pytest.mark.parametrize("busy", [True, False])
def test_cgroup_v2_not_delegated_is_a_missing_layer_and_delegated_is_used(
    busy: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """CI may run on cgroup v2 (this host is v1). The runner's own cgroup holds processes, so the
    kernel refuses it children with controllers: the layer is reported missing (optional) with the
    way out, nothing raised or left behind; where it may (delegated), its children are used."""
    scope = "/system.slice/ci-runner.service"
    root = fake_cgroup_host(monkeypatch, tmp_path, f"0::{scope}\n", V2_MOUNT, busy)
    parent = root / scope.lstrip("/")
    parent.mkdir(parents=True)
    (parent / "cgroup.subtree_control").write_text("")
    layout = jail.cgroup_layout()
    if busy:
        assert isinstance(layout, str) and "RLVR_SANDBOX_CGROUP" in layout, layout
    else:
        assert layout == ("v2", [str(parent)])
        assert (parent / "cgroup.subtree_control").read_text() == "+memory +pids"
    assert sorted(p.name for p in parent.iterdir()) == ["cgroup.subtree_control"]


def test_cgroup_v2_read_only_with_controllers_on_is_a_missing_layer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A container's cgroup2 mounted read-only can show memory and pids on already; no child can be
    made there, so the layer is missing rather than failing every run."""
    import errno

    root = fake_cgroup_host(monkeypatch, tmp_path, "0::/\n", V2_MOUNT, busy=True)
    (root / "cgroup.subtree_control").write_text("cpu io memory pids\n")

    def read_only(path: str, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(os, "mkdir", read_only)
    assert isinstance(jail.cgroup_layout(), str)


@pytest.mark.parametrize(
    "own, mounts",
    [
        ("0::/\n", "22 1 0:20 / /sys rw - sysfs sysfs rw\n"),  # no cgroup mounted at all
        ("0::/\n", ""),
        ("garbage\n", V2_MOUNT),  # an unreadable /proc/self/cgroup
        ("0::/elsewhere\n", V2_MOUNT.replace(" / {root}", " /mine {root}")),  # not ours
        (
            "4:memory:/a\n0::/\n",
            "40 23 0:30 / {root} rw - cgroup cgroup rw,memory\n",
        ),  # v1, no pids
    ],
)
def test_cgroup_layouts_without_a_usable_cgroup_say_why(
    own: str, mounts: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake_cgroup_host(monkeypatch, tmp_path, own, mounts, busy=True)
    layout = jail.cgroup_layout()
    assert isinstance(layout, str) and layout, layout


def test_a_missing_optional_layer_is_not_required(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host that has no cgroup or seccomp for the sandbox (cgroup v2 not delegated, another CPU)
    runs it with the required layers, and only what the probe found is asked of each run."""
    caps = capabilities() | {"cgroup": False, "seccomp": False, "per_run_uid": False}
    monkeypatch.setattr(runner_module, "capabilities", lambda: caps)
    result = run_tests(SOLUTION, "solve", TESTS)
    assert result.all_passed and result.isolation == caps


def test_a_huge_timeout_is_clamped(monkeypatch: pytest.MonkeyPatch) -> None:
    assert SandboxLimits(wall_seconds=1e9).clamped().wall_seconds == runner_module.MAX_WALL_SECONDS
    monkeypatch.setattr(runner_module, "MAX_WALL_SECONDS", 1.5)
    started = time.monotonic()
    result = run_tests(HOSTILE["infinite loop"], "solve", TESTS, SandboxLimits(wall_seconds=1e9))
    assert result.timed_out and time.monotonic() - started < 2.5


def test_one_slow_sample_does_not_stall_the_others() -> None:
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(
            run_tests, HOSTILE["infinite loop"], "solve", TESTS, SandboxLimits(wall_seconds=3)
        )
        started = time.monotonic()
        fast = [run_tests(SOLUTION, "solve", TESTS).all_passed for _ in range(3)]
        fast_seconds = time.monotonic() - started
        assert all(fast) and fast_seconds < 2.5
        assert not slow.result().all_passed


def test_runs_in_parallel_threads_get_their_own_uid_and_all_pass() -> None:
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(lambda _: runner_module.run_tests(SOLUTION, "solve", TESTS), range(12))
        )
    assert all(r.all_passed for r in results)
    if capabilities()["per_run_uid"]:
        assert len({r.uid for r in results}) == len(results)


def test_without_a_required_layer_the_sandbox_refuses_to_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rlvr.sandbox import SandboxUnavailable

    without_root = dict.fromkeys(runner_module.LAYERS, True) | {"minimal_root": False}
    monkeypatch.setattr(runner_module, "capabilities", lambda: without_root)
    monkeypatch.delenv(runner_module.UNISOLATED_ENV, raising=False)
    with pytest.raises(SandboxUnavailable, match="RLVR_SANDBOX_UNISOLATED=1") as raised:
        run_tests(SOLUTION, "solve", TESTS)
    assert "minimal_root" in str(raised.value) and "\n" not in str(raised.value)
    assert "rlvr sandbox serve" in str(raised.value) and "sandbox.url" in str(raised.value)


def test_sandbox_check_reports_every_layer() -> None:
    from typer.testing import CliRunner

    from rlvr.cli import app

    result = CliRunner().invoke(app, ["sandbox", "check"])
    assert result.exit_code == 0, result.output
    for layer in runner_module.LAYERS:
        assert layer in result.output
    assert "the sandbox runs here" in result.output
    mode = runner_module.mode()
    assert mode in ("root", "rootless") and f"mode: {mode}" in result.output
    assert runner_module.MODE_DESCRIPTIONS[mode] in " ".join(result.output.split())
