"""system.identity: give a restored or forked guest its own clock, RNG, hostname, machine-id.

A guest restored from a memory snapshot is a copy of another moment: its clock stands
at the snapshot's time and its kernel RNG state equals every other copy's (two forks
would draw identical random bytes). The host sends fresh values right after HELLO.

What is changed goes through an ``IdentitySystem``:

- ``LinuxSystem`` makes the syscalls. It refuses to act unless PID 1 is
  ``space.guest.init`` (that is, inside a SPACE guest), a second fence behind the first.
- ``GvisorSystem`` makes the changes a gVisor sandbox's spaced can (``--gvisor``,
  where spaced is the sandbox's init): hostname and machine-id. The clock and the RNG
  are the host's there (gVisor reads both from the host at every call), so a restored
  copy shares neither and those fields are accepted as already true. It refuses to act
  unless spaced is PID 1, which it never is on a host.
- ``RecordingSystem`` only records what it would do (JSON lines in a file); spaced's
  ``--stdio`` mode, which the unit tests run as root on a developer's machine, always
  gets this one (see ``system_for``), so tests can never touch the host's clock,
  hostname, RNG or /etc.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import json
import logging
import os
import secrets
import socket
import stat
import struct
import time
from typing import Protocol, TypeVar

from space.protocol import ErrorCode, Identity

from ._errors import OpError, from_oserror
from ._request import Fields

__all__ = [
    "RNDADDENTROPY",
    "RNDRESEEDCRNG",
    "GvisorSystem",
    "IdentitySystem",
    "LinuxSystem",
    "RecordingSystem",
    "apply_identity",
    "hosts_with",
    "is_space_guest",
    "op_identity",
    "pack_rand_pool_info",
    "replace_file",
    "system_for",
    "write_host_name",
    "write_machine_id",
]

_log = logging.getLogger("spaced")

#: _IOW('R', 0x03, int[2]) in linux/random.h: add bytes to the input pool and credit them.
RNDADDENTROPY = 0x40085203
#: _IO('R', 0x07) in linux/random.h (Linux >= 4.17): reseed the CRNG from the pool now.
RNDRESEEDCRNG = 0x5207
_POOL_HEADER = struct.Struct("=ii")  # struct rand_pool_info: entropy_count, buf_size
_SPACE_INIT = b"space.guest.init"
#: /etc/hosts is read up to this size (a larger one is cut, which a guest would notice).
_MAX_HOSTS_CHARS = 1 << 20
_T = TypeVar("_T")


def pack_rand_pool_info(data: bytes) -> bytearray:
    """``struct rand_pool_info`` for RNDADDENTROPY, crediting every bit of ``data``.

    The host draws ``data`` from its own CSPRNG, so 8 bits of entropy per byte is true.
    A bytearray, so fcntl.ioctl hands the kernel our buffer without its 1 KiB copy limit.
    """
    return bytearray(_POOL_HEADER.pack(len(data) * 8, len(data)) + data)


class IdentitySystem(Protocol):
    """Where system.identity's changes go. Each method raises OSError or OpError."""

    def set_clock_ns(self, time_ns: int) -> None: ...

    def add_entropy(self, data: bytes) -> None: ...

    def set_hostname(self, hostname: str) -> None: ...

    def set_machine_id(self, machine_id: str) -> None: ...


def system_for(stdio: bool, record_path: str | None, *, gvisor: bool = False) -> IdentitySystem:
    """The system spaced uses: in ``--stdio`` mode never the real one, unless spaced is
    a gVisor sandbox's init (``gvisor``).

    ``--stdio`` runs spaced as a host process (the unit tests do so as root), where a
    real change would hit the developer's machine. ``record_path`` counts only there
    (spaced's argument parser refuses it without ``--stdio``).
    """
    if gvisor:
        return GvisorSystem()
    if stdio:
        return RecordingSystem(record_path)
    return LinuxSystem()


class RecordingSystem:
    """Records each change as one JSON line appended to ``path`` (or only logs it)."""

    def __init__(self, path: str | None) -> None:
        self._path = path

    def _record(self, change: dict[str, object]) -> None:
        _log.info("--stdio mode: %s recorded, not applied", change["change"])
        if self._path is None:
            return
        with open(self._path, "a", encoding="utf-8") as file:
            file.write(json.dumps(change, sort_keys=True) + "\n")

    def set_clock_ns(self, time_ns: int) -> None:
        self._record({"change": "clock", "time_ns": time_ns})

    def add_entropy(self, data: bytes) -> None:
        self._record({"change": "entropy", "entropy": base64.b64encode(data).decode()})

    def set_hostname(self, hostname: str) -> None:
        self._record({"change": "hostname", "hostname": hostname})

    def set_machine_id(self, machine_id: str) -> None:
        self._record({"change": "machine_id", "machine_id": machine_id})


def is_space_guest(pid1_cmdline: str = "/proc/1/cmdline") -> bool:
    """Whether PID 1 is SPACE's guest init (``python3 -B -m space.guest.init``)."""
    try:
        with open(pid1_cmdline, "rb") as file:
            return _SPACE_INIT in file.read(4096).split(b"\0")
    except OSError:
        return False


class LinuxSystem:
    """The real changes, as root inside a SPACE guest (Debian's 6.1 kernel)."""

    def __init__(self, pid1_cmdline: str = "/proc/1/cmdline") -> None:
        self._pid1_cmdline = pid1_cmdline

    def _require_guest(self) -> None:
        if not is_space_guest(self._pid1_cmdline):
            raise OpError(
                ErrorCode.PERMISSION_DENIED,
                "PID 1 is not space.guest.init: refusing to change this machine's identity",
            )

    def set_clock_ns(self, time_ns: int) -> None:
        self._require_guest()
        time.clock_settime_ns(time.CLOCK_REALTIME, time_ns)

    def add_entropy(self, data: bytes) -> None:
        """Mix ``data`` into the input pool, credited, then force a CRNG reseed.

        Without the reseed the CRNG would keep its cloned key until its next scheduled
        reseed (up to a minute on 6.1), and forks would share random bytes till then.
        """
        self._require_guest()
        fd = os.open("/dev/urandom", os.O_WRONLY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, RNDADDENTROPY, pack_rand_pool_info(data))
            try:
                fcntl.ioctl(fd, RNDRESEEDCRNG)
            except OSError as exc:
                _log.warning(
                    "RNDRESEEDCRNG failed (%s; a kernel before 4.17?): "
                    "writing the entropy to /dev/urandom as well",
                    exc,
                )
                _write_all(fd, data)
        finally:
            os.close(fd)

    def set_hostname(self, hostname: str) -> None:
        self._require_guest()
        socket.sethostname(hostname)
        write_host_name("/", hostname)

    def set_machine_id(self, machine_id: str) -> None:
        self._require_guest()
        write_machine_id("/", machine_id)


class GvisorSystem:
    """The changes inside a gVisor sandbox, whose init spaced is (see the module
    docstring). Its application kernel gives root of the sandbox its own UTS namespace
    and files: nothing here reaches the host."""

    def __init__(self, pid: int | None = None) -> None:
        self._pid = os.getpid() if pid is None else pid

    def _require_init(self) -> None:
        if self._pid != 1:
            raise OpError(
                ErrorCode.PERMISSION_DENIED,
                "spaced is not the sandbox's init: refusing to change this machine's identity",
            )

    def set_clock_ns(self, time_ns: int) -> None:
        self._require_init()  # gVisor's clock is the host's: nothing stood still

    def add_entropy(self, data: bytes) -> None:
        self._require_init()  # getrandom is the host's at every call: no cloned pool

    def set_hostname(self, hostname: str) -> None:
        self._require_init()
        socket.sethostname(hostname)
        write_host_name("/", hostname)

    def set_machine_id(self, machine_id: str) -> None:
        self._require_init()
        write_machine_id("/", machine_id)


def hosts_with(text: str, hostname: str) -> str:
    """``text`` (an /etc/hosts) with ``127.0.1.1`` naming ``hostname``, as Debian does,
    so the machine resolves its own name; other lines are kept as they are."""
    lines = [line for line in text.splitlines() if line.split()[:1] != ["127.0.1.1"]]
    at = next((i + 1 for i, line in enumerate(lines) if line.startswith("127.0.0.1")), 0)
    lines.insert(at, f"127.0.1.1\t{hostname}")
    return "\n".join(lines) + "\n"


def write_host_name(root: str, hostname: str) -> None:
    """Name the host in ``root``/etc/hostname and ``root``/etc/hosts (atomically)."""
    replace_file(os.path.join(root, "etc/hostname"), f"{hostname}\n".encode(), 0o644)
    hosts = os.path.join(root, "etc/hosts")
    try:
        with open(hosts, encoding="utf-8", errors="replace") as file:
            text = file.read(_MAX_HOSTS_CHARS)
    except FileNotFoundError:
        text = "127.0.0.1\tlocalhost\n"
    replace_file(hosts, hosts_with(text, hostname).encode(), 0o644)


def write_machine_id(root: str, machine_id: str) -> None:
    """Replace ``root``/etc/machine-id atomically (mode 0444), and dbus's copy
    ``root``/var/lib/dbus/machine-id only where it is a regular file (a symlink, usually
    to /etc/machine-id, is left alone)."""
    data = f"{machine_id}\n".encode()
    replace_file(os.path.join(root, "etc/machine-id"), data, 0o444)
    dbus = os.path.join(root, "var/lib/dbus/machine-id")
    try:
        is_file = stat.S_ISREG(os.lstat(dbus).st_mode)
    except FileNotFoundError:
        return
    if is_file:
        replace_file(dbus, data, 0o444)


def replace_file(path: str, data: bytes, mode: int) -> None:
    """Atomically replace ``path`` (temp file in its directory, rename).

    A symlink at ``path`` is replaced, never followed. On failure the old file stays
    and the temp file is removed; raises OSError. No fsync: each would flush the VM's
    disk image on the host (~100 ms under TCG, in the middle of every fork), and ext4
    (data=ordered, auto_da_alloc) commits the data before the rename anyway, so a crash
    leaves the old or the new file.
    """
    directory, name = os.path.split(path)
    temp = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)  # the umask may have taken bits away
            _write_all(fd, data)
        finally:
            os.close(fd)
        os.rename(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def apply_identity(identity: Identity, system: IdentitySystem) -> list[str]:
    """Apply the given fields in IDENTITY_FIELDS order (the clock first); return their names.

    Raises OpError at the first failure, naming the fields applied before it (those stay
    applied). Applying the same identity again is harmless.
    """
    steps = {
        "time_ns": lambda: system.set_clock_ns(_given(identity.time_ns)),
        "entropy": lambda: system.add_entropy(_given(identity.entropy)),
        "hostname": lambda: system.set_hostname(_given(identity.hostname)),
        "machine_id": lambda: system.set_machine_id(_given(identity.machine_id)),
    }
    applied: list[str] = []
    for name in identity.fields():
        try:
            steps[name]()
        except OSError as exc:
            error = from_oserror(exc)
            raise OpError(error.code, f"{name}: {error.message} (applied: {applied})") from None
        except OpError as exc:
            raise OpError(exc.code, f"{name}: {exc.message} (applied: {applied})") from None
        _log.info("identity: applied %s", name)
        applied.append(name)
    return applied


def _given(value: _T | None) -> _T:
    assert value is not None  # apply_identity only runs steps of given fields
    return value


async def op_identity(fields: Fields, system: IdentitySystem) -> dict[str, object]:
    """The system.identity handler; a malformed request raises ProtocolError.

    The changes run in a thread (fsync may be slow on the guest's disk); a CANCEL
    mid-way lets them finish, the answer is dropped.
    """
    identity = Identity.from_request(fields.mapping())
    applied = await asyncio.to_thread(apply_identity, identity, system)
    return {"ok": True, "applied": list(applied)}
