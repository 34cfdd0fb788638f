"""What the sandbox adds to jail.py's layers without root, and on top of them everywhere: a user
namespace, dropping every capability, and Landlock.

- Rootless mode (the runner is not root; issue 38): the keeper enters a new user namespace that maps
  only the runner's own uid and gid (the kernel lets any user do this where unprivileged user
  namespaces are allowed). In it the run holds the capabilities it needs to build the same PID,
  mount, network, IPC, UTS and cgroup namespaces and the same minimal root as root does, all of them
  owned by that namespace and no use outside it; then it drops every capability before the
  candidate runs. There is no second uid to switch to, so runs share the runner's uid; the kernel
  counts RLIMIT_NPROC per user namespace, so each run's process budget is still its own.
- Capabilities are dropped in both modes (bounding set too), so nothing the candidate executes can
  gain one back, even from a binary with file capabilities.
- Landlock (Linux 5.13+, where the kernel enables it): once the minimal root is built, file access is
  limited to the paths it was built from (read and execute beneath the read-only binds, read-write
  on the private scratch directories), so a host directory that reached the run some other way (a
  bind the plan missed, a descriptor) is still denied. Optional: reported, and required once seen.

Loaded by harness.py by path like jail.py (standard library only; no rlvr imports).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

CLONE_NEWUSER = 0x10000000
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
PR_SET_NO_NEW_PRIVS = 38
CAPABILITY_VERSION_3 = 0x20080522
# capset and the Landlock calls have the same numbers on x86_64 and aarch64 (for Landlock, on every
# architecture: they are newer than the unified table).
CAPSET = {"x86_64": 126, "aarch64": 91}
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1


def _fail(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


# ---------------------------------------------------------------------------------------------
# The user namespace of a rootless run.


def enter_user_namespace(uid: int, gid: int) -> None:
    """unshare(CLONE_NEWUSER) and map `uid` and `gid` to themselves: the one mapping an unprivileged
    process may write for itself. setgroups is denied first, as the kernel requires for gid_map
    (so a run cannot drop a supplementary group that a file's permissions deny it through)."""
    if libc.unshare(CLONE_NEWUSER) != 0:
        err = ctypes.get_errno()
        hint = (
            " (unprivileged user namespaces are not allowed here: kernel.unprivileged_userns_clone, "
            "user.max_user_namespaces, an AppArmor or seccomp profile such as Docker's default)"
        )
        raise OSError(err, f"unshare(CLONE_NEWUSER): {os.strerror(err)}{hint}")
    for name, line in (
        ("setgroups", "deny"),
        ("uid_map", f"{uid} {uid} 1"),
        ("gid_map", f"{gid} {gid} 1"),
    ):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(line)


def drop_bounding_set() -> None:
    """Empty the bounding and ambient sets: nothing executed later gains a capability back (not
    even from a binary with file capabilities). Needs CAP_SETPCAP, so it comes first."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        dropped = libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) == 0
        if not dropped and ctypes.get_errno() != errno.EINVAL:  # EINVAL: a cap the kernel lacks
            raise _fail(f"dropping capability {cap} from the bounding set")
    libc.prctl(PR_CAP_AMBIENT, ctypes.c_ulong(PR_CAP_AMBIENT_CLEAR_ALL), 0, 0, 0)


def drop_capabilities() -> None:
    """Empty the inheritable, permitted and effective sets too (after drop_bounding_set). As root
    the uid change does this; in a user namespace the run keeps its uid, so this is what takes away
    its power over its own namespaces (mounting, sethostname, ...)."""
    machine = os.uname().machine
    if machine not in CAPSET:
        raise OSError(errno.ENOSYS, f"no capset number for {machine!r}")
    header = struct.pack("=Ii", CAPABILITY_VERSION_3, 0)
    data = bytes(24)  # two {effective, permitted, inheritable} words of 32 bits, all empty
    if libc.syscall(CAPSET[machine], header, data) != 0:
        raise _fail("capset")


def check_no_capabilities() -> None:
    """Raise unless this process holds no capability in any set."""
    with open("/proc/self/status") as f:
        held = [line.split() for line in f if line.startswith("Cap")]
    if any(int(value, 16) for _, value in held):
        raise OSError(errno.EPERM, f"capabilities still held: {held}")


# ---------------------------------------------------------------------------------------------
# Landlock. Access rights by ABI version, as in <linux/landlock.h>.

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REFER, TRUNCATE = 1 << 13, 1 << 14
ABI1_ACCESS = (1 << 13) - 1  # execute .. make_sym
FILE_ONLY = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2


def landlock_abi() -> int | str:
    """The kernel's Landlock ABI version, or why there is none (not built, disabled at boot)."""
    version = libc.syscall(
        LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), LANDLOCK_CREATE_RULESET_VERSION
    )
    if version >= 1:
        return int(version)
    err = ctypes.get_errno()
    if err == errno.ENOSYS:
        return "the kernel has no Landlock (Linux 5.13+ built with CONFIG_SECURITY_LANDLOCK)"
    if err == errno.EOPNOTSUPP:
        return "Landlock is built in but not enabled (boot with lsm=...,landlock)"
    return f"Landlock: {os.strerror(err)}"


def handled_access(abi: int) -> int:
    """Every file-system right this ABI knows, except IOCTL_DEV (v5): a tty ioctl on /dev/null is
    harmless and programs probe it (isatty)."""
    access = ABI1_ACCESS
    if abi >= 2:
        access |= REFER
    if abi >= 3:
        access |= TRUNCATE
    return access


def restrict_filesystem(
    abi: int, read_only: list[str], read_write: list[str], files: list[str]
) -> None:
    """Allow only: read and execute beneath `read_only`, everything beneath `read_write`, read and
    write of the single files in `files` (device nodes); deny every other path. Where the ABI has
    scopes (v6), abstract unix sockets and signals outside the run are denied too (the network and
    PID namespaces already hide them). Needs no_new_privs or CAP_SYS_ADMIN, and is irreversible."""
    access = handled_access(abi)
    if abi >= 6:
        attr = struct.pack("=QQQ", access, 0, SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL)
    else:
        attr = struct.pack("=Q", access)
    ruleset = libc.syscall(LANDLOCK_CREATE_RULESET, attr, ctypes.c_size_t(len(attr)), 0)
    if ruleset < 0:
        raise _fail("landlock_create_ruleset")
    try:
        rules = [(p, access & (EXECUTE | READ_FILE | READ_DIR)) for p in read_only]
        rules += [(p, access) for p in read_write]
        rules += [(p, access & (READ_FILE | WRITE_FILE)) for p in files]
        for path, allowed in rules:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                if not os.path.isdir(path):
                    allowed &= FILE_ONLY
                rule = struct.pack("=Qi", allowed, fd)
                if (
                    libc.syscall(
                        LANDLOCK_ADD_RULE, int(ruleset), LANDLOCK_RULE_PATH_BENEATH, rule, 0
                    )
                    != 0
                ):
                    raise _fail(f"landlock_add_rule {path}")
            finally:
                os.close(fd)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), 0, 0, 0) != 0:
            raise _fail("no_new_privs")
        if libc.syscall(LANDLOCK_RESTRICT_SELF, int(ruleset), 0) != 0:
            raise _fail("landlock_restrict_self")
    finally:
        os.close(int(ruleset))
