"""The isolation layers the sandbox builds as root before a candidate runs: the minimal root, the
seccomp filter and the per-run cgroup.

Over the 500-line guide by a few lines: the minimal root, seccomp and the cgroup are one threat
model read together; a split is due when it grows.

Loaded by harness.py by path (the zygote runs as `python -I -S harness.py`, so neither rlvr nor any
site-packages is importable there): standard library only. Every function either does its whole job
or raises OSError saying what failed; harness.py decides which failures are fatal (the layers the
runner found available when it probed the host are required on every run).
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import platform
import struct
import sys

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong]
libc.mount.argtypes += [ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.unshare.argtypes = [ctypes.c_int]

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x20000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWUSER = 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
NAMESPACE_FLAGS = CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER
NAMESPACE_FLAGS |= CLONE_NEWPID | CLONE_NEWNET
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2

# Candidate uids: BASE + the host PID of the run's init. PIDs are unique among live processes and
# every process of a run dies with its PID namespace, so no two live runs share a uid (and thus an
# RLIMIT_NPROC count), with no lock to take. Far above the uids of people and of container ranges.
RUN_UID_BASE = 1_500_000_000
NOBODY = 65534


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _b(value: str | None) -> bytes | None:
    return None if value is None else value.encode()


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None):
    _check(libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)), f"mount {target}")


def unshare(flags: int) -> None:
    _check(libc.unshare(flags), "unshare")


def set_parent_death_signal(signal_number: int) -> None:
    _check(libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal_number), 0, 0, 0), "pdeathsig")


def uid_range_is_mapped() -> bool:
    """Whether every uid RUN_UID_BASE + pid exists here (not so in a user namespace mapping few)."""
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            pid_max = int(f.read())
        with open("/proc/self/uid_map") as lines:
            ranges = [tuple(int(x) for x in line.split()) for line in lines]
    except (OSError, ValueError):
        return False
    low, high = RUN_UID_BASE, RUN_UID_BASE + pid_max
    return any(inside <= low and high <= inside + count for inside, _, count in ranges)


# ---------------------------------------------------------------------------------------------
# The minimal root: a tmpfs holding read-only binds of /usr (without /usr/local) and of the
# interpreter's prefix, with an empty tmpfs over every site-packages and over whatever the runner
# named as secret (its checkout, its venv, its working directory). The rest of the host - /home,
# /root, /opt, /srv, /etc, /var, /tmp, datasets - is simply not there.

Op = tuple[str, ...]  # ("bind", path) | ("hide", path) | ("link", path, target) | ("file", path)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def plan_root(secrets: list[str]) -> list[Op]:
    """The mounts that make the minimal root, in order, as host paths (computed once, in the zygote)."""
    ops: list[Op] = [("bind", "/usr")]
    binds = ["/usr"]
    if os.path.isdir("/usr/local"):
        # pip installs, local data: hidden (the interpreter's prefix is bound again if it is there)
        ops.append(("hide", "/usr/local"))
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + name
        if os.path.islink(path):
            ops.append(("link", path, os.readlink(path)))
        elif os.path.isdir(path):
            ops.append(("bind", path))
            binds.append(path)
    prefixes = sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)})
    for prefix in prefixes:
        if not any(_inside(prefix, b) for b in binds) or _inside(prefix, "/usr/local"):
            ops.append(("bind", prefix))
            binds.append(prefix)
    candidates = [os.path.realpath(s) for s in secrets]
    for root in binds:
        for pattern in ("lib*/python*/*-packages", "local/lib*/python*/*-packages", "pkgs", "envs"):
            candidates += glob.glob(os.path.join(root, pattern))
    hidden: list[str] = []
    for path in sorted(set(candidates)):
        if (
            os.path.isdir(path)
            and any(_inside(path, b) and path != b for b in binds)
            and not any(_inside(p, path) for p in prefixes)  # never hide python itself
            and not any(_inside(path, h) for h in hidden)
            # under the empty /usr/local only what a prefix bound again there shows: a mount point
            # made for anything else would show its name (python in /usr, as Debian's)
            and (
                not _inside(path, "/usr/local")
                or any(_inside(path, p) and _inside(p, "/usr/local") for p in prefixes)
            )
        ):
            ops.append(("hide", path))
            hidden.append(path)
    for path in ("/etc/ld.so.cache", "/etc/localtime"):
        if os.path.isfile(path):
            ops.append(("file", path))
    return ops


def _bind_read_only(source: str, target: str) -> None:
    """In a user namespace (rootless) the host's mounts are locked: a bind of a tree with mounts
    below it must take them along (MS_REC; each is then made read-only too), and a remount must
    keep noexec where the host set it. As root neither applies and the first try succeeds."""
    try:
        mount(source, target, None, MS_BIND)
        below = [target]
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        mount(source, target, None, MS_BIND | MS_REC)
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4].encode().decode("unicode_escape") for line in f]
        below = [p for p in points if _inside(p, target)]
    for path in below:
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
        mount(None, path, None, flags | _noexec(path))


def _noexec(path: str) -> int:
    return MS_NOEXEC if os.statvfs(path).f_flag & os.ST_NOEXEC else 0


# Files a run may create per scratch directory. tmpfs's default is half the host's RAM in pages (3M
# inodes on a 24 GiB host): empty files cost no `size` but ~1 KiB of kernel memory each, so a run
# creating 140k files a second could take GiBs of the host's memory where no cgroup limits it.
SCRATCH_INODES = 16384
SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
DEVICES = ("null", "zero", "full", "random", "urandom")


def _scratch(target: str, size: str) -> None:
    """A private, empty, world-writable tmpfs (sticky, like /tmp): gone with the run."""
    os.makedirs(target, exist_ok=True)
    data = f"size={size},nr_inodes={SCRATCH_INODES},mode=1777"
    mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, data)


def build_root(staging: str, ops: list[Op], uid: int) -> None:
    """In a fresh mount namespace and PID namespace: make the minimal root and pivot into it.

    After this the process's / is a read-only tmpfs with the planned read-only binds, /proc of the
    run's own PID namespace, private tmpfs on /tmp, /var/tmp, /dev/shm and /run/lock, a handful
    of device nodes, and an /etc with only passwd, group, hosts, ld.so.cache and localtime.
    """
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates to the host
    mount("tmpfs", staging, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=755")
    hides = []
    for op in ops:
        kind, path = op[0], op[1]
        target = staging + path
        if kind == "link":
            os.symlink(op[2], target)
            continue
        if kind == "file":
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "w").close()
            _bind_read_only(os.path.realpath(path), target)
            continue
        os.makedirs(target, exist_ok=True)
        if kind == "bind":
            _bind_read_only(path, target)
        else:
            mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
            hides.append(path)
    os.makedirs(staging + "/dev", exist_ok=True)
    for name in DEVICES:
        open(f"{staging}/dev/{name}", "w").close()
        mount(f"/dev/{name}", f"{staging}/dev/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0")):
        os.symlink(target, f"{staging}/dev/{name}")
    os.symlink("/proc/self/fd/1", f"{staging}/dev/stdout")
    os.symlink("/proc/self/fd/2", f"{staging}/dev/stderr")
    for path in SCRATCH_DIRS:
        _scratch(staging + path, "64m")
    os.makedirs(staging + "/proc", exist_ok=True)
    mount("proc", staging + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(staging + "/etc", exist_ok=True)
    with open(staging + "/etc/passwd", "w") as f:
        f.write(f"root:x:0:0::/:/bin/sh\nsandbox:x:{uid}:{uid}::/tmp:/bin/sh\n")
    with open(staging + "/etc/group", "w") as f:
        f.write(f"root:x:0:\nsandbox:x:{uid}:\n")
    with open(staging + "/etc/hosts", "w") as f:
        f.write("127.0.0.1 localhost\n")
    # pivot_root(".", "."): the old root ends up stacked on the new one and is detached at once.
    os.chdir(staging)
    _check(libc.syscall(syscall_number("pivot_root"), b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
    # MS_BIND: read-only for this mount only. Without it a remount changes the filesystem under the
    # mount, and where a host bind is stacked on the path (the interpreter's prefix is /usr/local)
    # that filesystem is the host's.
    for path in [*hides, "/"]:
        mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _check(libc.sethostname(b"sandbox", 7), "sethostname")  # the run's own UTS namespace


# ---------------------------------------------------------------------------------------------
# seccomp: a classic BPF filter, built here, installed with prctl. What no candidate needs fails
# with EPERM: new namespaces (unshare, setns, clone with a CLONE_NEW* flag), mounts, ptrace, bpf,
# the kernel keyring, io_uring, perf, the kernel log, module and kexec loading; a socket of a family
# the network namespace does not cover fails with EAFNOSUPPORT. clone3 passes its flags in memory a
# filter cannot read, so it answers ENOSYS and the C library falls back to clone.

# name: (x86_64, aarch64), as in the kernel's unistd headers
_NUMBERS = {
    "unshare": (272, 97),
    "setns": (308, 268),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "ptrace": (101, 117),
    "bpf": (321, 280),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "open_by_handle_at": (304, 265),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "reboot": (169, 142),
    "acct": (163, 89),
    "quotactl": (179, 60),
    "syslog": (103, 116),  # the kernel log, where kernel.dmesg_restrict is 0
    "clone": (56, 220),
    "clone3": (435, 435),
    "prctl": (157, 167),
    "socket": (41, 198),
    "socketpair": (53, 199),
    "setrlimit": (160, 164),
    "prlimit64": (302, 261),
}
# allowed, some arguments denied
FILTERED = ("clone", "clone3", "prctl", "socket", "socketpair", "setrlimit", "prlimit64")
DENIED = [name for name in _NUMBERS if name not in FILTERED]
# Socket families a candidate may create. The network namespace covers these; it does not cover
# AF_VSOCK, which reaches the hypervisor's services from inside a VM (Firecracker, cloud VMs with a
# guest agent, CI runners), nor the kernel attack surface of the rest (AF_ALG, AF_PACKET, ...).
# Any other family answers EAFNOSUPPORT, as on a kernel built without it.
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
SOCKET_FAMILIES = (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK)
# RLIMIT_CORE stays what the harness set, 1: the one value at which the kernel skips a core_pattern
# pipe (Ubuntu's apport, systemd-coredump), a root helper on the host that would receive the crashed
# candidate's memory, hidden inputs included, and store it there; with 0 the pipe still runs. A
# process may always lower its own limit, so lowering it to 0 is what the filter refuses.
RLIMIT_CORE = 4
SYSCALLS = {
    arch: {name: numbers[i] for name, numbers in _NUMBERS.items()}
    for i, arch in enumerate(("x86_64", "aarch64"))
}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}

_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_KILL_PROCESS, _ALLOW = 0x80000000, 0x7FFF0000
_ERRNO = 0x00050000
_EPERM, _ENOSYS, _EAFNOSUPPORT = 1, 38, 97


def syscall_number(name: str) -> int:
    """`name`'s number on this CPU, or OSError (ENOSYS) where there is no table for it (the layer
    that needs it is then reported missing with this reason, not a KeyError naming the CPU)."""
    machine = platform.machine()
    if machine not in SYSCALLS or struct.calcsize("P") != 8:
        raise OSError(
            errno.ENOSYS,
            f"no syscall numbers for a {struct.calcsize('P') * 8}-bit "
            f"interpreter on {machine!r} (x86_64 and aarch64 are known)",
        )
    return SYSCALLS[machine][name]


def seccomp_program() -> bytes | None:
    """The filter for this CPU architecture, or None where there is no syscall table for it."""
    machine = platform.machine()
    # A 32-bit interpreter on a 64-bit kernel makes syscalls of another ABI (the filter's arch check
    # would kill it at its first syscall): no filter there.
    if machine not in SYSCALLS or struct.calcsize("P") != 8:
        return None
    numbers = SYSCALLS[machine]
    # (code, jump-if-true label, jump-if-false label, k); labels resolve to relative offsets.
    program: list[tuple[int, str | None, str | None, int]] = [
        (_LD_W_ABS, None, None, 4),  # seccomp_data.arch
        (_JEQ, "nr", "kill", AUDIT_ARCH[machine]),
    ]
    labels = {}
    labels["nr"] = len(program)
    program.append((_LD_W_ABS, None, None, 0))  # seccomp_data.nr
    if machine == "x86_64":
        program.append((_JGE, "deny", None, 0x40000000))  # the x32 ABI: another table, deny it
    for name in DENIED:
        program.append((_JEQ, "deny", None, numbers[name]))
    program.append((_JEQ, "enosys", None, numbers["clone3"]))
    program.append((_JEQ, "clone", None, numbers["clone"]))
    program.append((_JEQ, "socket", None, numbers["socket"]))
    program.append((_JEQ, "socket", None, numbers["socketpair"]))
    program.append((_JEQ, "setrlimit", None, numbers["setrlimit"]))
    program.append((_JEQ, "prlimit", None, numbers["prlimit64"]))
    program.append((_JEQ, "prctl", "allow", numbers["prctl"]))
    labels["clone"] = len(program)
    program.append((_LD_W_ABS, None, None, 16))  # args[0], low half: clone's flags
    program.append((_JSET, "deny", "allow", NAMESPACE_FLAGS))
    labels["prctl"] = len(program)
    program.append((_LD_W_ABS, None, None, 16))  # a candidate may not outlive its keeper
    program.append((_JEQ, "deny", "allow", PR_SET_PDEATHSIG))
    labels["setrlimit"] = len(program)
    program.append((_LD_W_ABS, None, None, 16))  # args[0]: the resource
    program.append((_JEQ, "deny", "allow", RLIMIT_CORE))
    labels["prlimit"] = len(program)
    program.append((_LD_W_ABS, None, None, 24))  # args[1]: the resource (args[0] is a pid)
    program.append((_JEQ, None, "allow", RLIMIT_CORE))
    program.append((_LD_W_ABS, None, None, 32))  # args[2], the new limit: NULL only reads it
    program.append((_JEQ, None, "deny", 0))
    program.append((_LD_W_ABS, None, None, 36))
    program.append((_JEQ, "allow", "deny", 0))
    labels["socket"] = len(program)
    program.append((_LD_W_ABS, None, None, 16))  # args[0], low half: the family
    for family in SOCKET_FAMILIES:
        program.append((_JEQ, "allow", None, family))
    program.append((_RET, None, None, _ERRNO | _EAFNOSUPPORT))
    for label, value in (
        ("allow", _ALLOW),
        ("deny", _ERRNO | _EPERM),
        ("enosys", _ERRNO | _ENOSYS),
        ("kill", _KILL_PROCESS),
    ):
        labels[label] = len(program)
        program.append((_RET, None, None, value))
    out = bytearray()
    for i, (code, true, false, k) in enumerate(program):
        jt = labels[true] - i - 1 if true else 0
        jf = labels[false] - i - 1 if false else 0
        out += struct.pack("=HBBI", code, jt, jf, k)
    return bytes(out)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install_seccomp(program: bytes) -> None:
    """Irreversible for this process and every process it starts (no_new_privs comes with it)."""
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), 0, 0, 0), "no_new_privs")
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.addressof(buffer))
    _check(
        libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(fprog), 0, 0),
        "seccomp",
    )


# ---------------------------------------------------------------------------------------------
# cgroups: one per run under the runner's own cgroup, with memory (no swap) and pids limits that
# hold for the run's processes together (RLIMIT_AS is per process). cgroup v2 where the parent can
# give its children the memory and pids controllers; else the v1 memory and pids hierarchies.


def cgroup_layout() -> tuple[str, list[str]] | str:
    """("v2" | "v1", parent directories), or why no per-run cgroup can be made here."""
    override = os.environ.get("RLVR_SANDBOX_CGROUP")
    try:
        with open("/proc/self/cgroup") as f:
            own = dict(line.strip().split(":", 2)[1:] for line in f)
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except (OSError, ValueError) as exc:
        return f"cannot read /proc/self/cgroup: {exc}"
    v2_dirs: list[str] = []
    v1: dict[str, str] = {}
    for fields in mounts:
        dash = fields.index("-")
        fstype, root, point, options = fields[dash + 1], fields[3], fields[4], fields[dash + 3]
        if fstype == "cgroup2" and "" in own and _inside(own[""], root):
            v2_dirs.append(point + own[""][len(root.rstrip("/")) :])
        if fstype == "cgroup":
            for controller in ("memory", "pids"):
                mine = own.get(controller)
                if controller in options.split(",") and mine and _inside(mine, root):
                    v1[controller] = point + mine[len(root.rstrip("/")) :]
    for parent in ([override] if override else []) + v2_dirs:
        try:
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                enabled = f.read().split()
            if not {"memory", "pids"} <= set(enabled):
                with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                    f.write("+memory +pids")
            # The controllers may be on where no child can be made (a cgroup2 mounted read-only,
            # as in containers): check, as for v1, so the layer is reported missing, not failed
            # on every run.
            child = os.path.join(parent, f"rlvr-probe-{os.getpid()}")
            os.mkdir(child)
            os.rmdir(child)
            return "v2", [parent]
        except OSError:
            continue
    if set(v1) == {"memory", "pids"}:
        try:
            probe = [os.path.join(v1[c], f"rlvr-probe-{os.getpid()}") for c in ("memory", "pids")]
            for path in probe:
                os.mkdir(path)
            for path in probe:
                os.rmdir(path)
            return "v1", [v1["memory"], v1["pids"]]
        except OSError as exc:
            return f"cgroup v1 memory/pids not writable: {exc.strerror}"
    if v2_dirs:
        return (
            "cgroup v2 here cannot give a child the memory and pids controllers (its parent holds "
            "processes); set RLVR_SANDBOX_CGROUP to a delegated cgroup"
        )
    return "no cgroup v2, nor v1 memory and pids controllers"


def create_cgroup(layout: tuple[str, list[str]], name: str, memory: int, pids: int) -> list[str]:
    kind, parents = layout
    dirs = [os.path.join(p, name) for p in parents]
    # Swap is no way around the memory limit; v2 kills the whole run when any part of it is OOM.
    settings = [("memory.max", memory), ("memory.swap.max", 0), ("memory.oom.group", 1)]
    if kind == "v1":
        settings = [("memory.limit_in_bytes", memory), ("memory.memsw.limit_in_bytes", memory)]
    settings.append(("pids.max", pids))
    for path in dirs:
        os.makedirs(path, exist_ok=True)
    for key, value in settings:
        for path in dirs:
            if os.path.exists(os.path.join(path, key)):
                with open(os.path.join(path, key), "w") as f:
                    f.write(str(value))
    return dirs


def join_cgroup(dirs: list[str], pid: int) -> None:
    for path in dirs:
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(pid))


def remove_cgroup(dirs: list[str]) -> None:
    """After the run's PID namespace is gone; a dying process can hold a cgroup a moment longer."""
    import time

    for path in dirs:
        for _ in range(50):
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)
