"""The code sandbox against hostile programs (rlvr.sandbox).

Every program below tries to earn reward without solving the task (double the input) or to hurt the
host. Each must: earn reward 0 (not all tests passed), return within its deadline + 1 s, leave no
process running, and leave the host's canary file and canary environment variable untouched and
unread. Containment tests need namespaces (unshare); without them they are skipped with the reason.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rlvr.sandbox import SandboxLimits, TestCase, capabilities, run_tests
from rlvr.sandbox import runner as runner_module

TESTS = [TestCase((1,), 2), TestCase((5,), 10, hidden=True), TestCase((-3,), -6, hidden=True)]
SOLUTION = "def solve(x):\n    return 2 * x\n"
WALL = 2.0
CANARY_VALUE = "rlvr-canary-7f3a"

# Every test runs code in the sandbox, which refuses to run without namespaces (no network block).
pytestmark = pytest.mark.skipif(
    not capabilities()["namespaces"], reason="no pid/net/mount namespaces on this host (unshare)"
)


def nobody_processes() -> list[int]:
    """Processes running as the sandbox user (nobody) right now."""
    if not capabilities()["drop_user"]:
        return []
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == 65534:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


TestCase.__test__ = False  # type: ignore[attr-defined]  # a dataclass, not a pytest class


@pytest.fixture()
def canary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "canary.txt"
    path.write_text(CANARY_VALUE)
    path.chmod(0o600)
    monkeypatch.setenv("RLVR_CANARY", CANARY_VALUE)
    return path


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
    "network connect": (
        "import socket\ndef solve(x):\n    s = socket.socket()\n    s.settimeout(1)\n"
        "    s.connect(('127.0.0.1', 22))\n    return 2 * x\n"
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
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_program_earns_nothing_and_is_contained(name: str, canary: Path) -> None:
    before = set(nobody_processes())
    canary_stat = canary.stat()
    started = time.monotonic()
    result = run_tests(HOSTILE[name], "solve", TESTS, SandboxLimits(wall_seconds=WALL))
    elapsed = time.monotonic() - started
    assert not result.all_passed, result.outcomes
    assert elapsed < WALL + 1.0, elapsed
    # Nothing left running: every process the program started is gone (give the kernel a moment).
    deadline = time.monotonic() + 1.0
    while set(nobody_processes()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(nobody_processes()) - before
    # The canaries: unchanged and never seen by the program.
    assert canary.read_text() == CANARY_VALUE and canary.stat().st_mtime == canary_stat.st_mtime
    assert CANARY_VALUE not in result.stdout + result.stderr
    assert os.environ["RLVR_CANARY"] == CANARY_VALUE
    assert len(result.stdout) <= runner_module.MAX_OUTPUT_BYTES
    for path in ("/etc/rlvr_pwned", "/root/rlvr_pwned", "/work/rlvr_pwned"):
        assert not Path(path).exists()


def test_a_huge_timeout_is_clamped(monkeypatch: pytest.MonkeyPatch) -> None:
    assert SandboxLimits(wall_seconds=1e9).clamped().wall_seconds == runner_module.MAX_WALL_SECONDS
    monkeypatch.setattr(runner_module, "MAX_WALL_SECONDS", 1.5)
    started = time.monotonic()
    result = run_tests(HOSTILE["infinite loop"], "solve", TESTS, SandboxLimits(wall_seconds=1e9))
    assert result.timed_out and time.monotonic() - started < 2.5


def test_one_slow_sample_does_not_stall_the_others() -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(
            run_tests, HOSTILE["infinite loop"], "solve", TESTS, SandboxLimits(wall_seconds=3)
        )
        started = time.monotonic()
        fast = [run_tests(SOLUTION, "solve", TESTS).all_passed for _ in range(3)]
        fast_seconds = time.monotonic() - started
        assert all(fast) and fast_seconds < 2.5
        assert not slow.result().all_passed


def test_without_namespaces_the_sandbox_refuses_to_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlvr.sandbox import SandboxUnavailable

    monkeypatch.setattr(
        runner_module, "capabilities", lambda: {"namespaces": False, "drop_user": True}
    )
    monkeypatch.delenv(runner_module.UNISOLATED_ENV, raising=False)
    with pytest.raises(SandboxUnavailable, match="RLVR_SANDBOX_UNISOLATED=1"):
        run_tests(SOLUTION, "solve", TESTS)
