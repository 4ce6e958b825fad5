"""Start one program (a sandbox's QEMU) inside its jail; run as root, as a script.

Usage: ``python3 -I -S _jail_exec.py``, then one JSON spec a line on stdin, answered
by one JSON status a line on stdout (0: running, its host pid in the spec's pid file).
Stdlib only and never imported by the node: it runs in an interpreter of its own, kept
running by the node (``jail._Broker``), so that nothing of the node process (threads,
locks, open descriptors) is carried into the fork that becomes the jailed program, and
no launch pays for starting an interpreter.

In order: join the cgroups; open the sandbox's tap inside its network namespace (the
descriptor is handed to the program), then move to a new, empty network namespace;
unshare mount, PID, IPC and UTS namespaces and fork. The child (PID 1 of its PID
namespace) builds a root on a tmpfs holding only the bind mounts the spec names, pivots
into it, drops every capability and the bounding set, takes the jail's own uid and gid,
sets no_new_privs, installs the seccomp filter and execs. The parent writes the child's
host pid to the spec's pid file once the exec succeeded, and exits 0; on any failure it
prints the step and the error to the spec's log and exits 1, and nothing of the child is
left.

The program is orphaned when the parent exits: the node is a child subreaper, so it
becomes the node's child (and is reaped there); after a node restart, init's.
"""

from __future__ import annotations

import ctypes
import json
import os
import stat
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = (
    0x08000000,
    0x10000000,
    0x20000000,
    0x40000000,
)
NAMESPACE_FLAGS = (CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER) | (
    CLONE_NEWPID | CLONE_NEWNET
)
PR_SET_SECCOMP, PR_CAPBSET_DROP = 22, 24
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
SECCOMP_MODE_FILTER = 2
SYS_PIVOT_ROOT = 155
TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI, IFF_VNET_HDR = 0x0002, 0x1000, 0x4000

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
EPERM, ENOSYS = 1, 38
#: What a VMM never needs, by x86_64 number: to reach or change other processes
#: (ptrace, process_vm_*, kill, kcmp, pidfd_getfd), the kernel (modules, bpf, keyrings,
#: perf, io_uring, userfaultfd, kexec, reboot, swap, clocks, syslog, raw I/O ports),
#: or its own confinement (mounts, namespaces, chroot, handles that skip path lookup).
#: openat stays: QEMU's loader and its runtime open files, and the mount namespace
#: holds nothing but this VM's own. QEMU's own ``-sandbox`` filter adds its list on top.
DENIED_SYSCALLS = {
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kill": 62,
    "tkill": 200, "kcmp": 312, "pidfd_getfd": 438, "process_madvise": 440,
    "init_module": 175, "finit_module": 313, "delete_module": 176, "bpf": 321,
    "keyctl": 250, "add_key": 248, "request_key": 249, "perf_event_open": 298,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "userfaultfd": 323, "kexec_load": 246, "kexec_file_load": 320, "reboot": 169,
    "swapon": 167, "swapoff": 168, "acct": 163, "quotactl": 179, "syslog": 103,
    "iopl": 172, "ioperm": 173, "settimeofday": 164, "clock_settime": 227,
    "clock_adjtime": 305, "adjtimex": 159, "sethostname": 170, "setdomainname": 171,
    "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "unshare": 272,
    "setns": 308, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
    "fsmount": 432, "fspick": 433, "mount_setattr": 442, "open_by_handle_at": 304,
    "name_to_handle_at": 303, "lookup_dcookie": 212, "uselib": 134, "ustat": 136,
    "sysfs": 139, "vhangup": 153, "personality": 135,
}  # fmt: skip
SYS_CLONE, SYS_CLONE3 = 56, 435

_libc = ctypes.CDLL(None, use_errno=True)


class JailError(Exception):
    """One step of building the jail failed."""


def _check(result: int, step: str) -> int:
    if result < 0:
        errno = ctypes.get_errno()
        raise JailError(f"{step}: {os.strerror(errno)}")
    return result


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {source or fstype} on {target}",
    )


def _prctl(option: int, arg2: int = 0, arg3: int | ctypes.c_void_p = 0) -> None:
    _check(
        _libc.prctl(option, ctypes.c_ulong(arg2), arg3, ctypes.c_ulong(0), ctypes.c_ulong(0)),
        f"prctl {option}",
    )


# seccomp


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06


def seccomp_program() -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k): deny-listed calls fail with EPERM, clone3 with
    ENOSYS (glibc then uses clone, whose flags a filter can see), a clone that asks for
    a namespace with EPERM, any other architecture or the x32 ABI kills the process."""
    denied = sorted(set(DENIED_SYSCALLS.values()))
    body: list[tuple[str, int, str | int, str | int]] = [
        ("ld", 4, 0, 0),  # seccomp_data.arch
        ("jeq", AUDIT_ARCH_X86_64, 0, "kill"),
        ("ld", 0, 0, 0),  # seccomp_data.nr
        ("jge", X32_SYSCALL_BIT, "kill", 0),
        *(("jeq", nr, "eperm", 0) for nr in denied),
        ("jeq", SYS_CLONE3, "enosys", 0),
        ("jeq", SYS_CLONE, 0, "allow"),
        ("ld", 16, 0, 0),  # the low half of args[0]: clone's flags
        ("jset", NAMESPACE_FLAGS, "eperm", "allow"),
    ]
    returns = {
        "allow": SECCOMP_RET_ALLOW,
        "eperm": SECCOMP_RET_ERRNO | EPERM,
        "enosys": SECCOMP_RET_ERRNO | ENOSYS,
        "kill": SECCOMP_RET_KILL_PROCESS,
    }
    end = len(body)
    where = {label: end + i for i, label in enumerate(returns)}
    codes = {"ld": _LD_W_ABS, "jeq": _JEQ_K, "jge": _JGE_K, "jset": _JSET_K}

    def offset(at: int, to: str | int) -> int:
        return to if isinstance(to, int) else where[to] - at - 1

    program = [
        (codes[op], offset(i, jt), offset(i, jf), k) for i, (op, k, jt, jf) in enumerate(body)
    ]
    return program + [(_RET_K, 0, 0, action) for action in returns.values()]


def _install_seccomp() -> None:
    program = seccomp_program()
    filters = (_SockFilter * len(program))(*(_SockFilter(*insn) for insn in program))
    fprog = _SockFprog(len(program), filters)
    _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.cast(ctypes.pointer(fprog), ctypes.c_void_p))


# the jail's steps


def _join_cgroups(procs_files: list[str]) -> None:
    for procs in procs_files:
        try:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        except OSError as exc:
            raise JailError(f"joining cgroup {os.path.dirname(procs)}: {exc}") from exc


def _open_tap(netns: str, tap: str) -> int:
    """A descriptor on the sandbox's tap, opened inside its namespace."""
    ns = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.setns(ns, CLONE_NEWNET), f"entering {netns}")
    finally:
        os.close(ns)
    fd = os.open("/dev/net/tun", os.O_RDWR)
    ifreq = tap.encode().ljust(16, b"\0") + (IFF_TAP | IFF_NO_PI | IFF_VNET_HDR).to_bytes(
        2, "little"
    )
    buf = ctypes.create_string_buffer(ifreq.ljust(40, b"\0"), 40)
    _check(_libc.ioctl(fd, ctypes.c_ulong(TUNSETIFF), buf), f"attaching to {tap}")
    return fd


def _build_root(root: str, binds: list[tuple[str, str, str]], spec: dict[str, object]) -> None:
    """A tmpfs at ``root`` with each bind's source at its path (``mode`` ro or rw; dev: a
    device node of the jail's own) and each of the spec's secrets a file in its
    secrets_dir only its uid can read."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("jail", root, "tmpfs", MS_NOSUID, "size=1m,mode=0755")
    secrets = {str(k): str(v) for k, v in dict(spec.get("secrets") or {}).items()}  # type: ignore[call-overload]
    if secrets:
        _write_secrets(root + str(spec["secrets_dir"]), secrets, int(spec["uid"]))  # type: ignore[call-overload]
    _make_devices(root, [path for _, path, mode in binds if mode == "dev"], int(spec["uid"]))  # type: ignore[call-overload]
    for source, path, mode in binds:
        if mode == "dev":
            continue
        target = root + path
        held = _held_here(source, path)
        try:
            os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
            if stat.S_ISDIR(os.fstat(held).st_mode):
                os.makedirs(target, mode=0o755, exist_ok=True)
            else:
                os.close(os.open(target, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600))
            _mount(f"/proc/self/fd/{held}", target, None, MS_BIND)
        finally:
            os.close(held)
        flags = MS_BIND | MS_REMOUNT | MS_NOSUID
        flags |= {"ro": MS_RDONLY | MS_NODEV, "rw": MS_NODEV | MS_NOEXEC}[mode]
        _mount(None, target, None, flags)
    for link, to in (
        ("bin", "usr/bin"),
        ("sbin", "usr/sbin"),
        ("lib", "usr/lib"),
        ("lib64", "usr/lib64"),
    ):
        if os.path.islink("/" + link) and not os.path.lexists(root + "/" + link):
            os.symlink(to, root + "/" + link)
    old = root + "/.old"
    os.mkdir(old, 0o700)
    _check(_libc.syscall(SYS_PIVOT_ROOT, root.encode(), old.encode()), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old", MNT_DETACH), "detaching the host's root")
    os.rmdir("/.old")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _make_devices(root: str, devices: list[str], uid: int) -> None:
    """Each of ``devices`` (host paths under /dev) a node of the jail's own, on a
    read-only tmpfs of its own, its uid's alone (0600), as Firecracker's jailer makes
    them: the jail can open /dev/kvm whatever the host's node allows (often 0660 to a
    ``kvm`` group a jailed uid is not in), and the host's nodes are not shared."""
    if not devices:
        return
    dev = root + "/dev"
    os.mkdir(dev, 0o755)
    _mount("jail-dev", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for path in devices:
        info = os.stat(path)
        if not path.startswith("/dev/") or not stat.S_ISCHR(info.st_mode):
            raise JailError(f"{path} is not a character device under /dev")
        target = root + path
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        os.mknod(target, stat.S_IFCHR | 0o600, info.st_rdev)
        os.chown(target, uid, uid)
    _mount(None, dev, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)


def _held_here(source: str, path: str) -> int:
    """An O_PATH descriptor of the file at ``path`` in this mount namespace, reached
    without following a link, if it is the very file ``source`` leads to (the broker's
    held descriptor of what it checked; a mount can only be bound from this namespace's
    own mounts, so that one cannot be used itself)."""
    want = os.stat(source)
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in filter(None, path.split("/")):
            step = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = step
        got = os.fstat(fd)
        if (got.st_dev, got.st_ino) != (want.st_dev, want.st_ino):
            raise JailError(f"{path} is not the file that was checked")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_secrets(directory: str, secrets: dict[str, str], uid: int) -> None:
    os.mkdir(directory, 0o500)
    for name, value in secrets.items():
        if "/" in name or name in ("", ".", ".."):
            raise JailError(f"bad secret name {name!r}")
        fd = os.open(f"{directory}/{name}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        try:
            os.write(fd, value.encode("ascii"))
            os.fchown(fd, uid, uid)
        finally:
            os.close(fd)
    os.chown(directory, uid, uid)


def _drop_privileges(uid: int, gid: int, last_cap: int) -> None:
    for cap in range(last_cap + 1):
        _prctl(PR_CAPBSET_DROP, cap)
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)  # clears the permitted and effective capability sets
    _prctl(PR_SET_NO_NEW_PRIVS, 1)


def _child(spec: dict[str, object], errors: int) -> None:
    """The jailed program's process: never returns."""
    try:
        binds = [(str(s), str(p), str(m)) for s, p, m in spec["binds"]]  # type: ignore[attr-defined]
        with open("/proc/sys/kernel/cap_last_cap") as f:  # before the host's /proc is gone
            last_cap = f.read()
        os.umask(0o022)  # the jail's own directories: every jailed uid walks them
        _build_root(str(spec["root"]), binds, spec)
        _check(_libc.sethostname(b"jail", 4), "sethostname")
        if spec.get("sched_batch"):
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        _drop_privileges(int(spec["uid"]), int(spec["gid"]), int(last_cap))  # type: ignore[call-overload]
        # What QEMU makes (its sockets, in its run directory, whose group is the node
        # agent's and set-group-id) its uid and the agent may use, nobody else.
        os.umask(0o007)
        _install_seccomp()
        argv = [str(a) for a in spec["argv"]]  # type: ignore[attr-defined]
        os.execve(argv[0], argv, {str(k): str(v) for k, v in spec["env"].items()})  # type: ignore[attr-defined]
    except BaseException as exc:
        os.write(errors, str(exc).encode()[:4000] or type(exc).__name__.encode())
    os._exit(127)


def main(spec: dict[str, object]) -> int:
    _join_cgroups([str(p) for p in spec.get("cgroups", [])])  # type: ignore[attr-defined]
    if spec.get("netns"):
        tap = _open_tap(str(spec["netns"]), str(spec["tap"]))
        tap_fd = int(spec["tap_fd"])  # type: ignore[call-overload]
        if tap != tap_fd:
            os.dup2(tap, tap_fd)
            os.close(tap)
        os.set_inheritable(tap_fd, True)  # Python opens every descriptor close-on-exec
    # The pid file's directory held now (after the tap took its number): the jail's
    # pivot (this process shares its mount namespace with the child) leaves only
    # what the jail sees by path.
    run_dir, pid_name = os.path.split(str(spec["pid_file"]))
    held_dir = os.open(run_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    _check(
        _libc.unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS),
        "unshare",
    )
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _child(spec, write_end)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as errors:
        failure = errors.read(4096)
    if failure:
        os.waitpid(pid, 0)
        raise JailError(failure.decode(errors="replace"))
    # Its directory is the node's: never through a link.
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    with open(os.open(pid_name + ".tmp", flags, 0o600, dir_fd=held_dir), "w") as f:
        f.write(f"{pid}\n")
    os.replace(pid_name + ".tmp", pid_name, src_dir_fd=held_dir, dst_dir_fd=held_dir)
    os.close(held_dir)
    return 0


def _launch(spec: dict[str, object]) -> int:
    """One launch, in a process of its own: its output goes to the spec's log."""
    log = os.open(str(spec["log"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)  # never the broker's request pipe: the program would keep it
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    try:
        return main(spec)
    except (JailError, OSError, KeyError, ValueError, TypeError) as exc:
        print(f"jail: {exc}", file=sys.stderr)
        return 1


def serve() -> None:
    """Answer launches until stdin closes: one JSON spec a line in, one JSON status a
    line out. Each launch forks from this interpreter, its imports done once."""
    for line in sys.stdin.buffer:
        try:
            spec = json.loads(line)
        except ValueError:
            status = 2
        else:
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = _launch(spec)
                finally:
                    os._exit(code)
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        sys.stdout.write(json.dumps({"status": status}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
