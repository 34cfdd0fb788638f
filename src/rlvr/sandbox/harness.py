"""Runs INSIDE the sandbox: load candidate code, call its function on each test input, report outputs.

Started by rlvr.sandbox.runner as `python -I harness.py RESULT_FD` with the job as JSON on stdin.
Trust model: nothing this process writes is trusted. It only reports what the candidate's function
*returned* for each input, as canonical JSON; the expected values never enter this process, and the
parent compares. So forging "PASSED", patching json, exiting early or an always-equal object cannot
earn a pass: the worst the candidate can do is report wrong outputs, which score 0.

Order matters: everything that needs privileges (a private /tmp, dropping to an unprivileged user)
happens before the candidate's code is compiled.
"""

from __future__ import annotations

import json
import os
import sys


def _private_tmp() -> bool:
    """In the sandbox's own mount namespace (when the runner made one): a fresh tmpfs on /tmp, so the
    candidate's only writable place is empty and vanishes with the namespace. False if not allowed."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        ms_rec, ms_private = 0x4000, 0x40000
        if libc.mount(b"none", b"/", None, ms_rec | ms_private, None) != 0:
            return False
        return bool(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, b"size=64m,mode=1777") == 0)
    except Exception:
        return False


# Imported while still privileged: after the drop to an unprivileged user the interpreter's own
# install may be unreadable (e.g. under /root), so candidate code can import these and nothing else
# that was not importable by that user. Common needs of function-writing tasks, plus what the
# adversarial tests reach for.
PRELOAD = [
    "abc",
    "array",
    "bisect",
    "collections",
    "contextlib",
    "copy",
    "dataclasses",
    "datetime",
    "decimal",
    "enum",
    "fractions",
    "functools",
    "hashlib",
    "heapq",
    "io",
    "itertools",
    "math",
    "operator",
    "queue",
    "random",
    "re",
    "signal",
    "socket",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "textwrap",
    "threading",
    "time",
    "typing",
    "unicodedata",
    "unittest",
    "glob",
    "encodings.idna",
]


def _drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def main() -> None:
    result_fd = int(sys.argv[1])
    job = json.loads(sys.stdin.read())
    write = os.write
    dumps = json.dumps
    workdir = job["workdir"]
    if job.get("private_tmp") and _private_tmp():
        workdir = "/tmp/work"  # inside the fresh tmpfs: the host's /tmp is out of sight
        os.makedirs(workdir, exist_ok=True)
    if job.get("uid") is not None:
        import importlib

        for name in PRELOAD:
            importlib.import_module(name)
        os.chown(workdir, job["uid"], job["gid"])
        os.chmod(workdir, 0o700)
        _drop_privileges(job["uid"], job["gid"])
    os.chdir(workdir)
    inputs = job["inputs"]
    entry = job["entry"]
    code = job["code"]
    del job

    def report(record: dict[str, object]) -> None:
        try:
            line = dumps(record, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError):
            line = dumps({"i": record.get("i"), "error": "unserializable output"})
        write(result_fd, (line + "\n").encode())

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
    main()
