"""Subvolumes as btrfs send streams, out of and into the pool (issue 19: moves).

``send_subvolume`` writes the send stream of a read-only subvolume (incremental against
a read-only parent) into a pipe the node agent reads: the ``BTRFS_IOC_SEND`` ioctl on
the held subvolume, so root acts on exactly what it checked, never on a name looked
up again. ``receive_subvolume`` feeds what the agent writes into a pipe to ``btrfs
receive`` in an empty staging directory of the pool, reading it first: a stream that is
not a btrfs send stream, holds more or other than one subvolume, runs past its byte
limit, stalls, or stops before its end command is refused, and then nothing of it is
left in the directory. What it received stays read-only and root's until the agent,
having checked the SHA-256 the broker answers against the sender's, asks for it with
``adopt_received``.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import select
import signal
import stat
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from space.node.api import InvalidArgument, Unavailable
from space.node.core.environment import python_environment
from space.node.core.send_stream import SendStreamFraming
from space.node.privileged import _storage
from space.node.privileged._gvisor import TREE_ROOT
from space.node.privileged.pinned import Pinned, reopen

__all__ = ["Received", "adopt_received", "receive_subvolume", "send_subvolume"]

_CHUNK_BYTES = 1 << 20
#: A stream that stops flowing for this long is cut (the sender died or stalled).
IDLE_TIMEOUT_S = 60.0
#: What btrfs receive may take after its stream ended to finish the subvolume.
_FINISH_TIMEOUT_S = 120.0
_BTRFS_SUPER_MAGIC = 0x9123683E
_FIRST_FREE_OBJECTID = 256
_libc = ctypes.CDLL(None, use_errno=True)

#: BTRFS_IOC_SEND = _IOW(0x94, 38, struct btrfs_ioctl_send_args): s64 send_fd, u64
#: clone_sources_count, u64 *clone_sources, u64 parent_root, u64 flags, u32 version,
#: u8 reserved[28] (72 bytes).
_IOC_SEND = 0x40489426
#: BTRFS_IOC_INO_LOOKUP = _IOWR(0x94, 18, struct btrfs_ioctl_ino_lookup_args): u64
#: treeid, u64 objectid, char name[4080]; treeid 0 answers the fd's own tree.
_IOC_INO_LOOKUP = 0xD0009412
_INO_LOOKUP = struct.Struct("=QQ4080s")


class _SendArgs(ctypes.Structure):
    _fields_ = [
        ("send_fd", ctypes.c_int64),
        ("clone_sources_count", ctypes.c_uint64),
        ("clone_sources", ctypes.POINTER(ctypes.c_uint64)),
        ("parent_root", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("version", ctypes.c_uint32),
        ("reserved", ctypes.c_uint8 * 28),
    ]


def _open_read_only_subvolume(pinned: Pinned) -> int:
    """A descriptor of the read-only subvolume ``pinned``. Raises InvalidArgument."""
    fd = reopen(pinned, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if os.fstat(fd).st_ino != _FIRST_FREE_OBJECTID or not _storage.read_only(fd):
            raise InvalidArgument(f"{pinned.text} is not a read-only subvolume")
    except BaseException:
        os.close(fd)
        raise
    return fd


#: BTRFS_IOC_FS_INFO = _IOR(0x94, 31, struct btrfs_ioctl_fs_info_args): 1024 bytes,
#: u64 max_id, u64 num_devices, u8 fsid[16], ...
_IOC_FS_INFO = 0x8400941F


def fs_uuid(fd: int) -> bytes:
    """The UUID of the btrfs filesystem of ``fd`` (statfs's f_fsid differs per
    subvolume on btrfs). Raises InvalidArgument off btrfs."""
    args = bytearray(1024)
    try:
        fcntl.ioctl(fd, _IOC_FS_INFO, args)
    except OSError as exc:
        raise InvalidArgument(f"not on a btrfs filesystem: {exc}") from exc
    return bytes(args[16:32])


def _root_id(fd: int) -> int:
    args = bytearray(_INO_LOOKUP.pack(0, _FIRST_FREE_OBJECTID, b""))
    fcntl.ioctl(fd, _IOC_INO_LOOKUP, args)
    treeid: int = _INO_LOOKUP.unpack(args)[0]
    return treeid


def send_subvolume(subvolume: Pinned, parent: Pinned | None, out: int) -> None:
    """Write the send stream of ``subvolume`` (against ``parent``: only what differs)
    into ``out``; blocking, returns once all of it is written. Raises
    InvalidArgument (not read-only subvolumes), Unavailable (the ioctl failed: the
    reader went away, or the two are not of one filesystem)."""
    source = _open_read_only_subvolume(subvolume)
    try:
        args = _SendArgs(send_fd=out)
        if parent is not None:
            parent_fd = _open_read_only_subvolume(parent)
            try:
                if fs_uuid(parent_fd) != fs_uuid(source):
                    raise InvalidArgument("a send's parent is of another filesystem")
                root = _root_id(parent_fd)
            finally:
                os.close(parent_fd)
            sources = (ctypes.c_uint64 * 1)(root)
            args.parent_root, args.clone_sources_count = root, 1
            args.clone_sources = ctypes.cast(sources, ctypes.POINTER(ctypes.c_uint64))
        os.set_blocking(out, True)
        # A signal landing on this thread while the pipe is full ends the send in its
        # write: EINTR, a cut stream, or, for a handler that restarts system calls (as
        # asyncio's do), a send begun again from its first byte into the same pipe,
        # two streams in one. Blocked here, signals go to the broker's other threads.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            fcntl.ioctl(source, _IOC_SEND, args)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    except OSError as exc:
        raise Unavailable(f"btrfs send of {subvolume.text} failed: {exc}") from exc
    finally:
        os.close(source)


@dataclass(frozen=True, slots=True)
class Received:
    """A stream ``receive_subvolume`` took: the subvolume's name in the staging
    directory, the stream's length and its SHA-256 (hex)."""

    name: str
    stream_bytes: int
    sha256: str


class _StreamCheck:
    """A stream's framing (SendStreamFraming), its length within ``max_bytes`` and its
    SHA-256, as it passes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.total = 0
        self.hash = hashlib.sha256()
        self.framing = SendStreamFraming()

    def feed(self, data: bytes) -> None:
        """Account for ``data``; raises InvalidArgument at the first byte that is wrong."""
        self.total += len(data)
        if self.total > self.max_bytes:
            raise InvalidArgument(f"the stream is over its limit of {self.max_bytes} bytes")
        self.hash.update(data)
        self.framing.feed(data)


def receive_subvolume(pool: Pinned, directory: Pinned, source: int, max_bytes: int) -> Received:
    """``btrfs receive`` the stream read from ``source`` into the empty ``directory`` of
    the btrfs pool whose top level is ``pool``, checking the stream as it passes (see
    the module docstring); blocking.

    Raises InvalidArgument (a bad, oversized, stalled or cut stream; a directory that
    is not empty or not in the pool), Unavailable (btrfs receive failed). On any
    failure nothing received is left in ``directory``.
    """
    root_fd = reopen(pool, os.O_RDONLY | os.O_DIRECTORY)
    dir_fd = reopen(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _fs_type(root_fd) != _BTRFS_SUPER_MAGIC or os.fstat(root_fd).st_ino != 256:
            raise InvalidArgument(f"{pool.text} is not the top of a btrfs pool")
        same = fs_uuid(dir_fd) == fs_uuid(root_fd)
        if not same or not directory.text.startswith(pool.text + "/"):
            raise InvalidArgument(f"{directory.text} is not in the pool {pool.text}")
        if _names(dir_fd):
            raise InvalidArgument(f"{directory.text} is not empty")
        try:
            return _receive(pool, directory, dir_fd, source, max_bytes)
        except BaseException:
            _clear(dir_fd, directory.text)
            raise
    finally:
        os.close(dir_fd)
        os.close(root_fd)


def _fs_type(fd: int) -> int:
    """statfs's f_type of the filesystem of ``fd``."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on x86-64
    if _libc.fstatfs(fd, buf) != 0:
        return 0
    f_type: int = struct.unpack_from("=q", buf.raw)[0]
    return f_type


#: The receive runs in a mount namespace of its own (see _receive_child): btrfs receive
#: reaches its destination, and the pool's top (where it finds an incremental stream's
#: parent), by path names it resolves itself, so both are bind-mounted from the held
#: descriptors onto directories root just made, and no name the agent controls is
#: resolved by root.
_RECEIVE_CHILD = "space.node.privileged._receive_child"


def _receive(pool: Pinned, directory: Pinned, dir_fd: int, source: int, max_bytes: int) -> Received:
    os.set_blocking(source, True)
    check = _StreamCheck(max_bytes)
    with tempfile.TemporaryDirectory(prefix="space-receive-") as scratch:
        top, into = os.path.join(scratch, "pool"), os.path.join(scratch, "into")
        os.mkdir(top, 0o700)
        os.mkdir(into, 0o700)
        argv = [sys.executable, "-P", "-m", _RECEIVE_CHILD]
        argv += [str(pool.fd), top, str(directory.fd), into]
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            pass_fds=(pool.fd, directory.fd),
            env=python_environment(),
            start_new_session=True,
        )
        try:
            _pump(source, proc, check)
        finally:
            if proc.returncode is None:
                proc.kill()
                proc.wait()
            for stream in (proc.stdin, proc.stderr):
                with contextlib.suppress(OSError):
                    if stream is not None:
                        stream.close()
    return Received(_the_subvolume(dir_fd, directory.text), check.total, check.hash.hexdigest())


def _pump(source: int, proc: subprocess.Popen[bytes], check: _StreamCheck) -> None:
    """Pass ``source`` to ``proc`` through ``check`` until its end; wait for ``proc``."""
    assert proc.stdin is not None and proc.stderr is not None
    try:
        while True:
            ready, _, _ = select.select([source], [], [], IDLE_TIMEOUT_S)
            if not ready:
                raise InvalidArgument(f"the stream stalled for {IDLE_TIMEOUT_S} s")
            data = os.read(source, _CHUNK_BYTES)
            if not data:
                break
            check.feed(data)
            proc.stdin.write(data)
        check.framing.finish()
        proc.stdin.close()
        proc.wait(_FINISH_TIMEOUT_S)
    except (BrokenPipeError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"btrfs receive failed: {exc}; {_stderr(proc)}") from exc
    if proc.returncode != 0:
        raise Unavailable(f"btrfs receive failed ({proc.returncode}): {_stderr(proc)}")


def _stderr(proc: subprocess.Popen[bytes]) -> str:
    if proc.poll() is None or proc.stderr is None:
        return ""
    return proc.stderr.read(4096).decode(errors="replace").strip()


def _names(dir_fd: int) -> list[str]:
    """The entries of the directory ``dir_fd`` as they are now (``os.listdir`` of the
    descriptor itself may answer from where an earlier listing left it)."""
    return os.listdir(f"/proc/self/fd/{dir_fd}")


def _the_subvolume(dir_fd: int, text: str) -> str:
    """The one read-only subvolume btrfs receive made in the directory."""
    names = _names(dir_fd)
    if len(names) != 1:
        raise InvalidArgument(f"the stream made {len(names)} entries in {text}, not one")
    fd = _storage.open_directory(names[0], dir_fd)
    if fd is None:
        raise InvalidArgument(f"the stream made no subvolume in {text}")
    try:
        if os.fstat(fd).st_ino != _FIRST_FREE_OBJECTID or not _storage.read_only(fd):
            raise InvalidArgument(f"the stream made no finished subvolume in {text}")
    finally:
        os.close(fd)
    return names[0]


def _clear(dir_fd: int, text: str) -> None:
    """Delete whatever a failed receive left in the staging directory."""
    for name in _names(dir_fd):
        with contextlib.suppress(OSError, InvalidArgument, Unavailable):
            _storage.delete_held(dir_fd, name, os.path.join(text, name))


def adopt_received(
    subvolume: Pinned, owner: tuple[int, int], *, writable: bool, guest_tree: bool = False
) -> None:
    """Hand the received subvolume ``subvolume`` (its parent held) to ``owner``: every
    file and directory becomes theirs, 0600/0700, whatever owner and mode the stream
    gave it, and what is neither (a link, a device, a fifo: a VM's volume holds none)
    is removed. With ``guest_tree`` (a gVisor sandbox's volume) its guest's root
    directory, TREE_ROOT, is kept as received: owners, modes and links are the
    guest's, as in the tree it was cloned from, and the pool's nosuid and nodev make
    its set-user-id bits and device nodes nothing to the host. ``writable`` makes it a
    sandbox's volume; otherwise it stays read-only as received, so that later streams
    can name it as their parent. Raises InvalidArgument if it is not a subvolume, or
    with ``guest_tree`` has no root directory."""
    assert subvolume.name is not None
    fd = _storage.open_directory(subvolume.name, subvolume.fd)
    if fd is None:
        raise InvalidArgument(f"{subvolume.text} is not a directory")
    try:
        if os.fstat(fd).st_ino != _FIRST_FREE_OBJECTID:
            raise InvalidArgument(f"{subvolume.text} is not a subvolume")
        if guest_tree:
            _check_guest_root(fd, subvolume.text)
        _storage.set_read_only(fd, False)
        try:
            _own_tree(fd, owner, keep=TREE_ROOT if guest_tree else None)
        finally:
            if not writable:
                _storage.set_read_only(fd, True)
    finally:
        os.close(fd)


def _check_guest_root(top: int, text: str) -> None:
    """Raise InvalidArgument unless TREE_ROOT in ``top`` is a directory (not a link)."""
    try:
        mode = os.stat(TREE_ROOT, dir_fd=top, follow_symlinks=False).st_mode
    except FileNotFoundError:
        mode = 0
    if not stat.S_ISDIR(mode):
        raise InvalidArgument(f"{text} holds no guest root directory")


def _own_tree(top: int, owner: tuple[int, int], *, keep: str | None = None) -> None:
    """Give ``owner`` everything below the directory ``top``, by descriptor throughout,
    but the directory ``keep`` directly in it and what it holds."""
    os.fchown(top, *owner)
    os.fchmod(top, 0o700)
    for directory, dirs, files, fd in os.fwalk(".", dir_fd=top):
        if directory == "." and keep in dirs:
            dirs.remove(keep)  # not walked, and left as it is
        for name in (*dirs, *files):
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode):
                held = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                try:
                    os.chown(f"/proc/self/fd/{held}", *owner)
                    mode = 0o700 if stat.S_ISDIR(info.st_mode) else 0o600
                    os.chmod(f"/proc/self/fd/{held}", mode)
                finally:
                    os.close(held)
            else:
                os.unlink(name, dir_fd=fd)
