"""Subvolumes of the pool as btrfs send streams, for the node agent (issue 19: moves).

``send_stream`` yields the send stream of a read-only subvolume, incremental against a
read-only parent; ``receive_stream`` feeds chunks to ``btrfs receive`` in a staging
directory and answers what the root broker counted and hashed; ``adopt_received``
makes what was received the agent's. Root does each through its broker
(space.node.privileged._streams): the agent only holds the pipes. ``subvolume_ids``
reads a subvolume's UUIDs, which say which parent two pools share.

Every function raises space.node.api.errors leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from space.node.api import InvalidArgument, Unavailable
from space.node.core.send_stream import SendStreamFraming
from space.node.privileged import RootBroker
from space.node.privileged.requests import AdoptReceived, ReceiveSubvolume, SendSubvolume

__all__ = [
    "STREAM_CHUNK_BYTES",
    "Received",
    "SubvolumeIds",
    "adopt_received",
    "is_read_only_subvolume",
    "receive_stream",
    "send_stream",
    "subvolume_ids",
]

STREAM_CHUNK_BYTES = 1 << 20
#: F_SETPIPE_SZ (linux/fcntl.h): pipes of 1 MiB (an unprivileged process's default
#: maximum) instead of 64 KiB take a stream in 16x fewer reads and writes.
_F_SETPIPE_SZ = 1031
#: BTRFS_IOC_GET_SUBVOL_INFO = _IOR(0x94, 60, struct btrfs_ioctl_get_subvol_info_args),
#: 504 bytes: uuid at 296, parent_uuid at 312, received_uuid at 328 (any user may ask).
_IOC_GET_SUBVOL_INFO = 0x81F8943C
_SUBVOL_INFO_BYTES = 504
_NIL = uuid.UUID(int=0)


@dataclass(frozen=True, slots=True)
class SubvolumeIds:
    """A subvolume's UUID, the UUID of the subvolume it is a snapshot of, and the UUID
    of the subvolume it was received from (each None if it has none)."""

    uuid: str
    parent_uuid: str | None
    received_uuid: str | None

    @property
    def stream_id(self) -> str:
        """What a send stream names this subvolume by when it is the parent: the
        subvolume it was received from, if any, else itself (as ``btrfs send`` does)."""
        return self.received_uuid or self.uuid


#: BTRFS_IOC_SUBVOL_GETFLAGS = _IOR(0x94, 25, u64); BTRFS_SUBVOL_RDONLY.
_IOC_SUBVOL_GETFLAGS, _SUBVOL_RDONLY = 0x80089419, 1 << 1


def is_read_only_subvolume(path: Path) -> bool:
    """Whether ``path`` (not followed if a link) is a read-only subvolume."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_ino != 256:
            return False
        flags = bytearray(8)
        fcntl.ioctl(fd, _IOC_SUBVOL_GETFLAGS, flags)
        return bool(int.from_bytes(flags, "little") & _SUBVOL_RDONLY)
    except OSError:
        return False
    finally:
        os.close(fd)


def _pipe() -> tuple[int, int]:
    read_end, write_end = os.pipe()
    with contextlib.suppress(OSError):  # a smaller pipe only costs speed
        fcntl.fcntl(write_end, _F_SETPIPE_SZ, STREAM_CHUNK_BYTES)
    return read_end, write_end


def subvolume_ids(path: Path) -> SubvolumeIds:
    """The UUIDs of the subvolume ``path``. Raises InvalidArgument if it is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            args = bytearray(_SUBVOL_INFO_BYTES)
            fcntl.ioctl(fd, _IOC_GET_SUBVOL_INFO, args)
        finally:
            os.close(fd)
    except OSError as exc:
        raise InvalidArgument(f"{path} is not a subvolume: {exc}") from exc

    def at(offset: int) -> str | None:
        value = uuid.UUID(bytes=bytes(args[offset : offset + 16]))
        return None if value == _NIL else str(value)

    own = at(296)
    assert own is not None
    return SubvolumeIds(own, at(312), at(328))


async def send_stream(broker: RootBroker, path: Path, parent: Path | None) -> AsyncIterator[bytes]:
    """The send stream of the read-only subvolume ``path`` (against ``parent``), in
    chunks of at most STREAM_CHUNK_BYTES. Raises InvalidArgument, Unavailable (after
    the chunks that came: the stream is then cut). Closing the iterator early ends the
    send (the broker's write fails)."""
    read_end, write_end = _pipe()
    request = SendSubvolume(path=str(path), parent=None if parent is None else str(parent))
    sending = asyncio.ensure_future(broker.call(request, fds=(write_end,), give=True))
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=STREAM_CHUNK_BYTES)
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_end, "rb", buffering=0)
    )
    # Followed here too, so that a stream that lost its framing is never stored or
    # shipped, and the refusal says where it went wrong.
    framing = SendStreamFraming()
    try:
        while chunk := await reader.read(STREAM_CHUNK_BYTES):
            _follow(framing, chunk, path)
            yield chunk
        await sending
        _follow(framing, None, path)
    finally:
        transport.close()
        if not sending.done():
            with contextlib.suppress(Exception):
                await sending
        elif not sending.cancelled():
            sending.exception()  # retrieved: raised above when it mattered


def _follow(framing: SendStreamFraming, chunk: bytes | None, path: Path) -> None:
    """Feed ``chunk`` (None: the end) to ``framing``; Unavailable where it is lost."""
    try:
        if chunk is None:
            framing.finish()
        else:
            framing.feed(chunk)
    except InvalidArgument as exc:
        raise Unavailable(f"the send stream of {path} lost its framing: {exc.message}") from None


@dataclass(frozen=True, slots=True)
class Received:
    """What ``receive_stream`` took: the received subvolume's path (read-only, root's,
    in the staging directory), the stream's length and its SHA-256 (hex) as the broker
    counted them."""

    path: Path
    stream_bytes: int
    sha256: str


async def receive_stream(
    broker: RootBroker,
    pool_root: Path,
    directory: Path,
    chunks: AsyncIterable[bytes],
    *,
    max_bytes: int,
) -> Received:
    """Receive the send stream ``chunks`` into the empty ``directory`` of the pool at
    ``pool_root``. Raises InvalidArgument (refused: not a send stream, over
    ``max_bytes``, cut), Unavailable; then nothing received is left there. An error
    ``chunks`` raises is raised as is, after the broker refused the cut stream."""
    read_end, write_end = _pipe()
    request = ReceiveSubvolume(pool=str(pool_root), directory=str(directory), max_bytes=max_bytes)
    receiving = asyncio.ensure_future(broker.call(request, fds=(read_end,), give=True))
    # The event loop writes the pipe, never a thread: a thread left writing by a
    # cancelled await would write the rest of its chunk into whatever took the
    # descriptor's number once it was closed (another stream's pipe).
    try:
        writer = await _pipe_writer(write_end)
    except BaseException:
        with contextlib.suppress(Exception):
            await receiving
        raise
    # Followed here too: a stream that lost its framing is refused as this node read
    # it, and a refusal of one read well-framed here went wrong in the pipe.
    framing = SendStreamFraming()
    try:
        async for chunk in chunks:
            if receiving.done():
                break  # refused already: its error says why
            framing.feed(chunk)
            writer.write(chunk)
            await writer.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the broker stopped reading: its answer says why
    except BaseException:
        writer.transport.abort()
        with contextlib.suppress(Exception):
            await receiving
        raise
    finally:
        writer.close()  # after what is buffered: the broker reads its end
    try:
        value = await receiving
    except InvalidArgument as refused:
        raise InvalidArgument(
            f"{refused.message} (this node wrote it {framing.parsed} bytes, well-framed)"
        ) from None
    if not isinstance(value, dict):
        raise Unavailable(f"the root broker answered {value!r} to a receive")
    name, size, digest = value.get("name"), value.get("stream_bytes"), value.get("sha256")
    if not isinstance(name, str) or type(size) is not int or not isinstance(digest, str):
        raise Unavailable(f"the root broker answered {value!r} to a receive")
    return Received(directory / name, size, digest)


async def _pipe_writer(write_end: int) -> asyncio.StreamWriter:
    """A writer of the pipe's end ``write_end``, which it owns (closes) from here on."""
    loop = asyncio.get_running_loop()
    pipe = os.fdopen(write_end, "wb", buffering=0)
    try:
        protocol = asyncio.StreamReaderProtocol(asyncio.StreamReader())
        transport, _ = await loop.connect_write_pipe(lambda: protocol, pipe)
    except BaseException:
        pipe.close()
        raise
    return asyncio.StreamWriter(transport, protocol, None, loop)


async def adopt_received(
    broker: RootBroker, path: Path, *, writable: bool, guest_tree: bool = False
) -> None:
    """Make the received subvolume ``path`` the agent's (see AdoptReceived)."""
    await broker.call(AdoptReceived(path=str(path), writable=writable, guest_tree=guest_tree))
