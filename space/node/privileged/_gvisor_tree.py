"""A template's directory tree for gVisor sandboxes, made by root (issue 21).

gVisor runs a sandbox on a directory, so a template's ext4 image is unpacked once per
template digest into a subvolume that every sandbox of it clones. Built templates'
images were written by a guest: the unpack trusts nothing in them.

- No kernel mounts the image: ``debugfs rdump`` reads it in user space.
- debugfs runs confined (space.node.privileged._unpack_child): it sees no file system
  of the host's but read-only ``/usr`` and the tree it writes, with the capabilities
  of owning files and no other, so a link, a ``..`` or a ``/`` in the image's names
  leads nowhere writable outside the tree.
- Bounded: the tree's quota group limits what it may hold (its image's size and a
  margin: rdump writes each hard link as a file of its own), no file it writes may be
  larger than the image, and the unpack ends after ``UNPACK_TIMEOUT_S``.
- rdump keeps a file's permission bits, owner, group and times, and nothing else: no
  set-user-id, set-group-id or sticky bit, no extended attribute (so no file
  capability), and no device node, FIFO or socket. Every complaint debugfs makes
  fails the unpack: a template whose tree would differ from its image is refused.
- All of it happens in a directory of root's alone beside the tree to be, and only a
  complete tree is renamed into place, read-only.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import stat
import sys

from space.limits import DISK_MIB
from space.node.api import InvalidArgument, Timeout, Unavailable
from space.node.core.environment import python_environment
from space.node.core.run import kill_group, run
from space.node.privileged._gvisor import TREE_ROOT
from space.node.privileged._storage import (
    delete_held,
    limit_subvolume,
    open_directory,
    set_read_only,
)
from space.node.privileged.pinned import Pinned
from space.node.privileged.requests import unpacking_name

__all__ = ["MAX_IMAGE_BYTES", "UNPACK_TIMEOUT_S", "make_tree", "tree_limit_bytes"]

#: The longest an unpack may take (the base image's 131 MiB tree takes about a second).
UNPACK_TIMEOUT_S = 300.0
#: The largest image unpacked: a template's disk is at most the largest sandbox disk.
MAX_IMAGE_BYTES = DISK_MIB.high << 20
_UNPACK_CHILD = "space.node.privileged._unpack_child"
#: Where in the staging directory the child unpacks: the guest's root in the tree.
_INTO = f"tree/{TREE_ROOT}"
#: What an unpacking reads of debugfs's complaints before it ends it (a crafted image
#: may make millions; one refuses it).
_MAX_ERROR_LINES, _MAX_LINE_BYTES = 5, 300
_BANNER = b"debugfs "


def tree_limit_bytes(image_bytes: int) -> int:
    """What an image's tree may reference: the image's size and a quarter more (hard
    links come out as copies; btrfs metadata), at least 64 MiB."""
    return max(image_bytes + image_bytes // 4, 64 << 20)


async def make_tree(image_fd: int, parent: Pinned, owner: tuple[int, int]) -> None:
    """Unpack the ext4 image open as ``image_fd`` (a regular file the agent can read)
    into ``TREE_ROOT`` of the subvolume ``parent.name`` of the directory ``parent``
    holds; a no-op if it exists. What exists is complete. The subvolume's top is the
    agent's (``owner``, 0700), and so is each sandbox's volume cloned from it: the
    agent keeps a sandbox's saved state there, beside the guest's root and out of its
    sight. Raises InvalidArgument (not such an image descriptor), Unavailable (debugfs
    complained: the message says what), Timeout.
    """
    assert parent.name is not None
    if await asyncio.to_thread(_exists, parent):
        return
    size = _image_bytes(image_fd)
    scratch, leftover = await asyncio.to_thread(_root_scratch, parent)
    staging = Pinned(
        os.path.join(os.path.dirname(parent.text), _scratch_name(parent), "tree"), scratch, "tree"
    )
    try:
        if leftover:  # an unpack cut short (the broker stopped): start again
            await asyncio.to_thread(delete_held, scratch, "tree", staging.text)
        await run("btrfs", "subvolume", "create", str(staging.path))
        try:
            await limit_subvolume(staging, tree_limit_bytes(size))
            await asyncio.to_thread(os.mkdir, _INTO, 0o755, dir_fd=scratch)
            await _unpack(image_fd, scratch, size)
            await asyncio.to_thread(_publish, scratch, parent, owner)
        except BaseException:
            await asyncio.to_thread(delete_held, scratch, "tree", staging.text)
            raise
    finally:
        await asyncio.to_thread(_drop_scratch, scratch, parent)


def _image_bytes(fd: int) -> int:
    """The size of the image ``fd``; InvalidArgument unless it is a regular file of a
    bounded size opened for reading (so root reads nothing the agent could not)."""
    info = os.fstat(fd)
    mode = fcntl.fcntl(fd, fcntl.F_GETFL)
    if mode & os.O_PATH or mode & os.O_ACCMODE == os.O_WRONLY:
        raise InvalidArgument("make_guest_tree takes an image opened for reading")
    if not stat.S_ISREG(info.st_mode) or not 0 < info.st_size <= MAX_IMAGE_BYTES:
        raise InvalidArgument(f"make_guest_tree takes an image of 1 to {MAX_IMAGE_BYTES} bytes")
    return info.st_size


async def _unpack(image_fd: int, scratch: int, size: int) -> None:
    """Run the confined debugfs (see the module docstring) into ``scratch``/tree."""
    argv = [sys.executable, "-P", "-m", _UNPACK_CHILD, str(image_fd), str(scratch), str(size)]
    argv.append(_INTO)
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        pass_fds=(image_fd, scratch),
        env=python_environment(),
        start_new_session=True,
    )
    try:
        async with asyncio.timeout(UNPACK_TIMEOUT_S):
            assert proc.stderr is not None
            complaints = await _complaints(proc.stderr)
            if complaints:  # refused already: what is left to unpack is not waited for
                await kill_group(proc)
            code = await proc.wait()
    except TimeoutError:
        raise Timeout(f"unpacking the image took more than {UNPACK_TIMEOUT_S:g} s") from None
    finally:
        await kill_group(proc)
    if code != 0 or complaints:
        said = "; ".join(complaints) or f"exit status {code}"
        raise Unavailable(f"unpacking the image failed: {said}")


async def _complaints(stream: asyncio.StreamReader) -> list[str]:
    """The first lines debugfs wrote on stderr but its banner (at most a few: any one
    refuses the image), once that many came or the stream ended."""
    kept: list[str] = []
    while len(kept) < _MAX_ERROR_LINES:
        try:
            line = await stream.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            line = exc.partial
        except asyncio.LimitOverrunError as exc:
            line = await stream.read(exc.consumed)
        if not line:
            break
        if not line.startswith(_BANNER):
            kept.append(line[:_MAX_LINE_BYTES].decode("utf-8", "replace").strip())
    return kept


def _exists(parent: Pinned) -> bool:
    assert parent.name is not None
    try:
        os.stat(parent.name, dir_fd=parent.fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _scratch_name(parent: Pinned) -> str:
    assert parent.name is not None
    return unpacking_name(parent.name)


def _root_scratch(parent: Pinned) -> tuple[int, bool]:
    """A directory of root's alone beside the tree to be, held open, and whether it
    was there already (only root makes one that is root's: a leftover of ours)."""
    name = _scratch_name(parent)
    leftover = False
    try:
        os.mkdir(name, 0o700, dir_fd=parent.fd)
    except FileExistsError:
        leftover = True
    try:
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, dir_fd=parent.fd)
    except OSError as exc:  # a link or a file of the agent's in its place
        raise Unavailable(f"{name} in {parent.text} is not a directory of root's") from exc
    held = os.fstat(fd)
    if held.st_uid != 0 or stat.S_IMODE(held.st_mode) != 0o700:
        os.close(fd)
        raise Unavailable(f"{name} in {parent.text} is not a directory of root's alone")
    return fd, leftover


def _publish(scratch: int, parent: Pinned, owner: tuple[int, int]) -> None:
    """Check an unpacked tree, give its top to the agent, make it read-only and move
    it to its final name."""
    assert parent.name is not None
    if not _has_guest_python(scratch):
        raise Unavailable("the image has no /usr/bin/python3 to run the guest daemon on")
    tree = open_directory("tree", scratch)
    if tree is None:
        raise Unavailable("the unpacked tree is gone")
    try:
        # Both made here by root (rdump fills the guest's root, never replaces it).
        guest_root = open_directory(TREE_ROOT, tree)
        if guest_root is None:
            raise Unavailable("the unpacked tree has no guest root")
        os.fchmod(guest_root, 0o755)
        os.close(guest_root)
        os.fchown(tree, *owner)
        os.fchmod(tree, 0o700)
        os.rename("tree", parent.name, src_dir_fd=scratch, dst_dir_fd=parent.fd)
        set_read_only(tree, True)  # a read-only subvolume cannot be renamed
    finally:
        os.close(tree)


def _has_guest_python(scratch: int) -> bool:
    """Whether tree/usr/bin/python3 is there, looked up without following a link of
    the image's (python3 itself may be one: the guest resolves it)."""
    fd: int | None = scratch
    opened = []
    try:
        for name in ("tree", TREE_ROOT, "usr", "bin"):
            assert fd is not None
            fd = open_directory(name, fd)
            if fd is None:
                return False
            opened.append(fd)
        os.stat("python3", dir_fd=fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False
    finally:
        for held in opened:
            os.close(held)


def _drop_scratch(scratch: int, parent: Pinned) -> None:
    """Remove the (then empty) scratch directory, if it is still the one made."""
    try:
        made = os.fstat(scratch)
        there = os.stat(_scratch_name(parent), dir_fd=parent.fd, follow_symlinks=False)
        if (made.st_dev, made.st_ino) == (there.st_dev, there.st_ino):
            os.rmdir(_scratch_name(parent), dir_fd=parent.fd)
    except OSError:
        pass  # gone, moved or not empty: the agent's doing, and nothing of root's is in it
    finally:
        os.close(scratch)
