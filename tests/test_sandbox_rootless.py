"""The sandbox without root (issue 38): the pieces rootless mode is built from, tested directly in
a forked child, in whichever mode this host runs (as root in CI's main pass, as an ordinary user in
its non-root pass). The hostile catalogue of test_sandbox.py runs in both modes too.

- Landlock: a process restricted to some paths cannot read, list or write anything else, and
  can still use what it was given (the layer that keeps the host's files denied if a bind is
  missed);
- read-only binds in a user namespace, where the host's mounts are locked: a tree with a mount
  below it is bound with it, read-only throughout;
- dropping capabilities in a user namespace leaves none in any set.
"""

from __future__ import annotations

import ctypes
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

from rlvr.sandbox import jail, privileges
from rlvr.sandbox.runner import mode


def in_child(body: Callable[[], None]) -> str:
    """Run `body` in a forked child (its changes to namespaces and Landlock stay there); "" if it
    returned, else its traceback."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            body()
            os._exit(0)
        except BaseException:
            os.write(write, traceback.format_exc().encode()[-4000:])
            os._exit(1)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        report = f.read().decode()
    _, status = os.waitpid(pid, 0)
    return "" if os.waitstatus_to_exitcode(status) == 0 else report or f"status {status}"


def denied(action: Callable[[], object]) -> bool:
    try:
        action()
    except PermissionError:
        return True
    return False


def test_landlock_denies_every_path_it_was_not_given(tmp_path: Path) -> None:
    abi = privileges.landlock_abi()
    if isinstance(abi, str):
        pytest.skip(abi)
    given, other, scratch = tmp_path / "given", tmp_path / "other", tmp_path / "scratch"
    for directory in (given, other, scratch):
        directory.mkdir()
        (directory / "file").write_text("x")

    def body() -> None:
        assert isinstance(abi, int)
        privileges.restrict_filesystem(abi, [str(given)], [str(scratch)], ["/dev/null"])
        assert (given / "file").read_text() == "x" and os.listdir(given) == ["file"]
        assert denied(lambda: (given / "new").write_text("x"))
        assert denied(lambda: (other / "file").read_text())
        assert denied(lambda: os.listdir(other)) and denied(lambda: os.listdir(tmp_path))
        assert denied(Path(sys.executable).read_bytes)  # not given: as if a bind were missed
        (scratch / "new").write_text("y")
        os.rename(scratch / "new", scratch / "renamed")
        os.unlink(scratch / "renamed")
        with open("/dev/null", "w") as null:
            null.write("x")

    assert in_child(body) == ""


def test_a_bind_in_a_user_namespace_takes_locked_mounts_along_read_only(tmp_path: Path) -> None:
    """As the runner's own user, a tmpfs mounted below the bound tree in an outer namespace is
    locked in the inner one: a plain bind refuses the tree (EINVAL), jail binds it whole and makes
    every mount of it read-only."""
    source, target = tmp_path / "source", tmp_path / "target"
    (source / "below").mkdir(parents=True)
    target.mkdir()

    def body() -> None:
        uid, gid = os.getuid(), os.getgid()
        privileges.enter_user_namespace(uid, gid)
        jail.unshare(jail.CLONE_NEWNS)
        jail.mount(None, "/", None, jail.MS_REC | jail.MS_PRIVATE)
        jail.mount("tmpfs", str(source / "below"), "tmpfs", 0, "size=1m")
        (source / "below" / "file").write_text("x")
        privileges.enter_user_namespace(uid, gid)  # nested: the outer namespace's mounts lock
        jail.unshare(jail.CLONE_NEWNS)
        with pytest.raises(OSError) as plain:
            jail.mount(str(source), str(target), None, jail.MS_BIND)
        assert plain.value.errno == 22
        jail._bind_read_only(str(source), str(target))
        assert (target / "below" / "file").read_text() == "x"
        for path in (target / "new", target / "below" / "new"):
            with pytest.raises(OSError) as write:
                path.write_text("x")
            assert write.value.errno == 30, path  # EROFS

    report = in_child(body)
    if "unshare(CLONE_NEWUSER)" in report:
        pytest.skip(report.strip().splitlines()[-1])
    assert report == ""


def test_no_capability_is_left_in_a_user_namespace() -> None:
    def body() -> None:
        privileges.enter_user_namespace(os.getuid(), os.getgid())
        jail.unshare(jail.CLONE_NEWUTS)  # owned by the user namespace: its hostname is ours to set
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.sethostname(b"x", 1) == 0
        with pytest.raises(OSError):
            privileges.check_no_capabilities()
        privileges.drop_bounding_set()
        privileges.drop_capabilities()
        privileges.check_no_capabilities()
        assert libc.sethostname(b"y", 1) != 0  # CAP_SYS_ADMIN over it: gone
        with pytest.raises(OSError):
            jail.unshare(jail.CLONE_NEWNS)

    report = in_child(body)
    if "unshare(CLONE_NEWUSER)" in report:
        pytest.skip(report.strip().splitlines()[-1])
    assert report == ""


def test_the_mode_is_root_for_root_and_rootless_otherwise() -> None:
    expected = "root" if os.geteuid() == 0 else "rootless"
    assert mode() in (expected, "refused", "unisolated")
    if os.environ.get("CI") and mode() != expected:
        pytest.fail(f"CI must run the sandbox in {expected} mode here, got {mode()}")
