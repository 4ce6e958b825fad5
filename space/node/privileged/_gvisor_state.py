"""gVisor sandboxes' saved states as root: ``runsc checkpoint`` out, ``runsc restore`` in
(issue 21).

runsc writes and reads a checkpoint only as a file it opens by name itself (its
checkpoint creates ``checkpoint.img`` with O_EXCL in ``--image-path``, and its restore
refuses a file of size 0, such as a pipe), so root cannot hand it the agent's sealing
pipe the way QEMU gets one. The plaintext therefore passes through a file in
``<runsc home>/images``, a tmpfs of root's alone (0700) mounted there: memory, never
disk. Root copies it to the descriptor the agent handed over (the pipe of its sealer,
space.node.vmm.state_io) and removes it at once; on restore it copies what the agent's
opener verified into a fresh file there, which runsc reads and root removes. Root
never writes to a path of the agent's: only to descriptors the agent opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import stat
import subprocess
from pathlib import Path

from space.node.api import InvalidArgument, Timeout, Unavailable
from space.node.core.run import run

__all__ = [
    "IMAGE",
    "checkpoint",
    "image_dir",
    "release_image",
    "release_images",
    "stage_image",
]

#: The file runsc writes in and reads from its ``--image-path``.
IMAGE = "checkpoint.img"
_CHUNK_BYTES = 1 << 20
#: How long a copy waits for the agent's end of a pipe to move at all.
_STALL_S = 60.0
_CHECKPOINT_TIMEOUT_S = 300.0
_mounting = asyncio.Lock()


async def _images(home: Path) -> Path:
    """``home/images``, a tmpfs of root's alone, mounted on first use."""
    images = home / "images"
    async with _mounting:
        if not await asyncio.to_thread(os.path.ismount, images):
            await asyncio.to_thread(images.mkdir, mode=0o700, exist_ok=True)
            await run(
                "mount", "-t", "tmpfs", "-o", "mode=0700,nosuid,nodev,noexec",
                "space-runsc-images", str(images),
            )  # fmt: skip
    return images


async def image_dir(home: Path, name: str) -> Path:
    """A fresh, empty directory for the state of the sandbox ``name`` (a leftover of an
    earlier one, cut short, is removed)."""
    directory = await _images(home) / name
    await asyncio.to_thread(_drop, directory)
    await asyncio.to_thread(directory.mkdir, mode=0o700)
    return directory


def _drop(directory: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (directory / IMAGE).unlink()
    with contextlib.suppress(FileNotFoundError):
        directory.rmdir()


async def checkpoint(name: str, *, runsc: list[str], home: Path, out_fd: int) -> int:
    """Save the sandbox ``name`` (left running, or paused if it was) and copy its state
    to ``out_fd`` (a pipe or a file the agent opened); returns the bytes copied.
    Raises Unavailable (runsc's words, or the copy failed) or Timeout."""
    _check_fd(out_fd, "a checkpoint")
    directory = await image_dir(home, name)
    try:
        await run(
            *runsc, "checkpoint", f"--image-path={directory}", "--leave-running", name,
            timeout_s=_CHECKPOINT_TIMEOUT_S,
        )  # fmt: skip
        return await asyncio.to_thread(_copy_out, directory / IMAGE, out_fd)
    finally:
        await asyncio.to_thread(_drop, directory)


async def stage_image(home: Path, name: str, in_fd: int, max_bytes: int) -> Path:
    """Copy the state the agent streams on ``in_fd`` (at most ``max_bytes``) into a
    fresh image directory for ``runsc restore``; returns the directory. Raises
    InvalidArgument (too large), Unavailable or Timeout; nothing is left then."""
    _check_fd(in_fd, "a restore")
    directory = await image_dir(home, name)
    try:
        await asyncio.to_thread(_copy_in, in_fd, directory / IMAGE, max_bytes)
    except BaseException:
        await asyncio.to_thread(_drop, directory)
        raise
    return directory


async def release_image(directory: Path) -> None:
    await asyncio.to_thread(_drop, directory)


def release_images(home: Path) -> None:
    """Unmount the images' tmpfs (the node stops; no state is being copied)."""
    images = home / "images"
    if os.path.ismount(images):
        subprocess.run(["umount", "--lazy", str(images)], check=False, timeout=60)
    with contextlib.suppress(OSError):
        images.rmdir()


def _check_fd(fd: int, what: str) -> None:
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISFIFO(mode) or stat.S_ISREG(mode)):
        raise InvalidArgument(f"{what} takes a pipe or a file")
    os.set_blocking(fd, False)


def _wait(fd: int, events: int) -> None:
    poller = select.poll()
    poller.register(fd, events)
    if not poller.poll(int(_STALL_S * 1000)):
        raise Timeout(f"the node's end of the state stream stalled for {_STALL_S} s")


def _copy_out(path: Path, out_fd: int) -> int:
    with open(path, "rb") as image:
        total = 0
        while chunk := image.read(_CHUNK_BYTES):
            view = memoryview(chunk)
            while view:
                try:
                    view = view[os.write(out_fd, view) :]
                except BlockingIOError:
                    _wait(out_fd, select.POLLOUT)
                except OSError as exc:
                    raise Unavailable(f"handing over the state failed: {exc}") from exc
            total += len(chunk)
    return total


def _copy_in(in_fd: int, path: Path, max_bytes: int) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    out = os.open(path, flags, 0o600)
    total = 0
    try:
        while True:
            try:
                chunk = os.read(in_fd, _CHUNK_BYTES)
            except BlockingIOError:
                _wait(in_fd, select.POLLIN)
                continue
            if not chunk:
                break
            total += len(chunk)
            if total > max_bytes:
                raise InvalidArgument(f"a saved state over {max_bytes} bytes")
            view = memoryview(chunk)
            while view:
                view = view[os.write(out, view) :]
    finally:
        os.close(out)
    if total == 0:
        raise Unavailable("the saved state is empty")
