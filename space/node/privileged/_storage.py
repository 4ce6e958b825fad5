"""The pool's root operations: loop mounts, quotas, limits, sizes, subvolume deletion.

What btrfs lets a subvolume's owner do (make a subvolume, snapshot it, make it
read-only) the node agent does itself (space.node.storage.btrfs); this is the rest.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import os
import shutil
import stat
import struct
from pathlib import Path

from space.node.api import InvalidArgument, Unavailable
from space.node.core.ownership import adopt_tree, mount_points
from space.node.core.run import run
from space.node.privileged.pinned import Pinned, reopen
from space.node.vmm.jail import JAIL_UIDS

__all__ = [
    "adopt_pool",
    "delete_subvolume",
    "enable_quotas",
    "exclusive_bytes",
    "limit_subvolume",
    "mount_pool",
    "referenced_bytes",
    "unmount_pool",
]

#: BTRFS_IOC_QGROUP_LIMIT = _IOR(0x94, 43, struct btrfs_ioctl_qgroup_limit_args) (linux/btrfs.h).
_QGROUP_LIMIT = 0x8030942B
_LIMIT_MAX_RFER = 1 << 0
#: struct btrfs_ioctl_qgroup_limit_args: u64 qgroupid (0: the subvolume of the fd), then
#: struct btrfs_qgroup_limit: u64 flags, max_rfer, max_excl, rsv_rfer, rsv_excl.
_QGROUP_LIMIT_ARGS = struct.Struct("=6Q")
#: BTRFS_IOC_SNAP_DESTROY = _IOW(0x94, 15, struct btrfs_ioctl_vol_args {s64 fd; char name[4088]}).
_SNAP_DESTROY = 0x5000940F
_VOL_ARGS = struct.Struct("=q4088s")
#: BTRFS_IOC_SUBVOL_GETFLAGS/SETFLAGS = _IOR/_IOW(0x94, 25/26, u64); BTRFS_SUBVOL_RDONLY.
_SUBVOL_GETFLAGS, _SUBVOL_SETFLAGS, _SUBVOL_RDONLY = 0x80089419, 0x4008941A, 1 << 1
_FLAGS = struct.Struct("=Q")
#: LOOP_CTL_GET_FREE and LOOP_CONFIGURE (linux/loop.h; Linux 5.8), LO_FLAGS_AUTOCLEAR.
_LOOP_CTL_GET_FREE, _LOOP_CONFIGURE, _LO_FLAGS_AUTOCLEAR = 0x4C82, 0x4C0A, 4
#: struct loop_config: u32 fd, u32 block_size, struct loop_info64 (5 u64, 4 u32, file
#: name[64], crypt name[64], key[32], 2 u64 init), u64 reserved[8].
_LOOP_CONFIG = struct.Struct("=II5Q4I64s64s32s2Q8Q")
_UMOUNT_NOFOLLOW = 8
_libc = ctypes.CDLL(None, use_errno=True)
#: The pool holds disks and states, never a program: what a crafted image holds (a
#: set-user-id file, a device node) is no use to whoever made it.
_POOL_MOUNT_OPTIONS = "nosuid,nodev"


async def mount_pool(image: Pinned, mountpoint: Pinned, *, mkfs: bool) -> None:
    """Mount the btrfs in file ``image`` on ``mountpoint``, formatting it first with
    ``mkfs``. The loop device is set up here, on the very file that was checked (mount's
    own ``-o loop`` would look its path up again), and goes with the unmount."""
    if mkfs:
        await run("mkfs.btrfs", "-q", str(image.path))
    backing = reopen(image, os.O_RDWR)
    try:
        device, loop = await asyncio.to_thread(_attach_loop, backing, image.text)
    finally:
        os.close(backing)
    try:  # the loop stays bound while held: until the mount holds it too
        argv = ["mount", "--no-canonicalize", "-t", "btrfs", "-o", _POOL_MOUNT_OPTIONS]
        await run(*argv, device, str(mountpoint.path))
    finally:
        os.close(loop)


def _attach_loop(backing: int, name: str) -> tuple[str, int]:
    """A free loop device bound to ``backing``, cleared on its last close, and a
    descriptor of it."""
    control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(16):  # another process may take the free device first
            device = f"/dev/loop{fcntl.ioctl(control, _LOOP_CTL_GET_FREE)}"
            loop = os.open(device, os.O_RDWR | os.O_CLOEXEC)
            info = (0, 0, 0, 0, 0, 0, 0, 0, _LO_FLAGS_AUTOCLEAR, name.encode()[:63], b"", b"", 0, 0)
            try:
                fcntl.ioctl(loop, _LOOP_CONFIGURE, _LOOP_CONFIG.pack(backing, 0, *info, *[0] * 8))
                return device, loop
            except OSError as exc:
                os.close(loop)
                if exc.errno != errno.EBUSY:
                    raise Unavailable(f"cannot set up a loop device for {name}: {exc}") from exc
        raise Unavailable(f"no free loop device for {name}")
    finally:
        os.close(control)


async def adopt_pool(root: Pinned, owner: tuple[int, int]) -> None:
    """Make the pool at ``root`` ``owner``'s (see requests.AdoptPool); a no-op once its
    root directory is theirs. The root is 0700."""
    if os.fstat(root.fd).st_uid != owner[0]:
        await asyncio.to_thread(_adopt_read_only_subvolumes, root, owner)
        await asyncio.to_thread(adopt_tree, Path(root.text), owner, JAIL_UIDS, dir_fd=root.fd)
    os.chmod(root.path, 0o700)


def _adopt_read_only_subvolumes(root: Pinned, owner: tuple[int, int]) -> None:
    """Adopt each read-only subvolume (templates/*/*, snapshots/*, layers/*): made
    writable for that and read-only again."""
    for kind in ("templates", "snapshots", "layers"):
        for parent, text in _subdirectories(
            root.fd, kind, root.text, depth=2 if kind == "templates" else 1
        ):
            try:
                for name in os.listdir(parent):
                    _adopt_if_read_only(name, parent, Path(text, name), owner)
            finally:
                os.close(parent)


def _adopt_if_read_only(name: str, dir_fd: int, text: Path, owner: tuple[int, int]) -> None:
    fd = open_directory(name, dir_fd)
    if fd is None:
        return
    try:
        if os.fstat(fd).st_ino == 256 and read_only(fd):
            set_read_only(fd, False)
            try:
                adopt_tree(text, owner, JAIL_UIDS, dir_fd=fd)
            finally:
                set_read_only(fd, True)
    finally:
        os.close(fd)


def _subdirectories(dir_fd: int, name: str, text: str, *, depth: int) -> list[tuple[int, str]]:
    """The directories ``depth - 1`` levels below ``name`` in ``dir_fd``, open, none
    reached through a link."""
    fd = open_directory(name, dir_fd)
    if fd is None:
        return []
    if depth == 1:
        return [(fd, os.path.join(text, name))]
    try:
        return [
            found
            for child in os.listdir(fd)
            for found in _subdirectories(fd, child, os.path.join(text, name), depth=depth - 1)
        ]
    finally:
        os.close(fd)


def open_directory(name: str, dir_fd: int) -> int | None:
    try:
        return os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError:  # missing, not a directory, or a link
        return None


def read_only(fd: int) -> bool:
    flags = bytearray(_FLAGS.size)
    fcntl.ioctl(fd, _SUBVOL_GETFLAGS, flags)
    return bool(_FLAGS.unpack(flags)[0] & _SUBVOL_RDONLY)


def set_read_only(fd: int, on: bool) -> None:
    flags = bytearray(_FLAGS.size)
    fcntl.ioctl(fd, _SUBVOL_GETFLAGS, flags)
    (value,) = _FLAGS.unpack(flags)
    wanted = value | _SUBVOL_RDONLY if on else value & ~_SUBVOL_RDONLY
    if wanted != value:
        fcntl.ioctl(fd, _SUBVOL_SETFLAGS, _FLAGS.pack(wanted))


async def unmount_pool(image: Pinned, mountpoint: Pinned) -> None:
    """Unmount ``mountpoint`` if mounted and detach what loop devices ``image`` still
    has then (the node's own clear themselves; an older node's stayed)."""
    if mountpoint.text in await asyncio.to_thread(mount_points):
        await asyncio.to_thread(_unmount, mountpoint)
    out = await run("losetup", "-l", "-n", "-O", "NAME", "-j", str(image.path), check=False)
    for loop in (line.strip() for line in out.splitlines() if line.strip()):
        await run("losetup", "-d", loop, check=False)


def _unmount(mountpoint: Pinned) -> None:
    # By its name in the held parent, never following a link (the mount itself cannot
    # be held: a descriptor on it keeps it busy).
    assert mountpoint.name is not None
    if _libc.umount2(str(mountpoint.path).encode(), _UMOUNT_NOFOLLOW) != 0:
        err = ctypes.get_errno()
        raise Unavailable(f"cannot unmount {mountpoint.text}: {os.strerror(err)}")


async def enable_quotas(root: Pinned) -> None:
    """Turn quota groups on and wait for their first scan; idempotent."""
    await run("btrfs", "quota", "enable", str(root.path))
    await run("btrfs", "quota", "rescan", "-W", str(root.path), timeout_s=600.0)


async def limit_subvolume(path: Pinned, max_referenced: int) -> None:
    """Limit the quota group of subvolume ``path`` to reference ``max_referenced`` bytes
    (the ioctl: a ``btrfs`` command costs a process per volume)."""

    def limit() -> None:
        fd = reopen(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            args = _QGROUP_LIMIT_ARGS.pack(0, _LIMIT_MAX_RFER, max_referenced, 0, 0, 0)
            fcntl.ioctl(fd, _QGROUP_LIMIT, bytearray(args))
        finally:
            os.close(fd)

    try:
        await asyncio.to_thread(limit)
    except OSError as exc:
        raise Unavailable(f"quota limit of {path.text} failed: {exc}") from exc


async def referenced_bytes(path: Pinned) -> int:
    """Bytes subvolume ``path`` refers to, as its quota group counts them."""
    out = await run("btrfs", "qgroup", "show", "-rf", "--raw", str(path.path))
    return _second_column(out, "btrfs qgroup show")


async def exclusive_bytes(path: Pinned) -> int:
    """Bytes of data only ``path`` refers to, by extent sharing (``btrfs filesystem du``)."""
    out = await run("btrfs", "filesystem", "du", "-s", "--raw", str(path.path), timeout_s=120.0)
    return _second_column(out, "btrfs filesystem du")


async def delete_subvolume(target: Pinned) -> None:
    """Delete the subvolume ``target`` (its parent held; read-only or not); a plain
    directory is removed as a tree; idempotent. By ioctl on the held parent: the
    ``btrfs`` command would look the path up again."""

    def delete() -> None:
        assert target.name is not None
        delete_held(target.fd, target.name, target.text)

    try:
        await asyncio.to_thread(delete)
    except OSError as exc:
        raise Unavailable(f"cannot delete {target.text}: {exc}") from exc


def delete_held(parent_fd: int, name: str, text: str) -> None:
    """Delete ``name`` in the directory ``parent_fd`` holds: a subvolume (read-only or
    not) by ioctl, a plain directory as a tree; nothing if it is gone or not a
    directory. Raises InvalidArgument for a link, OSError if the deletion fails."""
    try:
        if stat.S_ISLNK(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode):
            raise InvalidArgument(f"{text} is a link")
    except FileNotFoundError:
        return
    fd = open_directory(name, parent_fd)
    if fd is None:
        return  # gone, or not a directory
    try:
        is_subvolume = os.fstat(fd).st_ino == 256
        if is_subvolume:
            set_read_only(fd, False)
    finally:
        os.close(fd)
    if not is_subvolume:
        shutil.rmtree(name, ignore_errors=True, dir_fd=parent_fd)
        return
    parent = os.open(f"/proc/self/fd/{parent_fd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(parent, _SNAP_DESTROY, bytearray(_VOL_ARGS.pack(0, name.encode())))
    finally:
        os.close(parent)


def _second_column(out: str, what: str) -> int:
    try:
        return int(out.strip().splitlines()[-1].split()[1])
    except (IndexError, ValueError) as exc:
        raise Unavailable(f"cannot parse {what} output: {out[-200:]!r}") from exc
