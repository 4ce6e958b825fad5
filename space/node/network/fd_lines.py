"""JSON lines over a unix stream socket, a line carrying descriptors (SCM_RIGHTS).

The node speaks to its egress gateway this way (issue 18): the node, as root, binds
the gateway's listeners inside a sandbox's namespace and sends them along with the
``attach`` line, so the gateway itself never enters a namespace. The sender hands a
line's descriptors over with its bytes in one ``sendmsg``; the kernel ends a read at
a message carrying descriptors, so the descriptors a read brings belong to the line
holding its last byte. A reader accepts at most ``max_fds`` per line: the kernel
drops (closes) those past its buffer, and this module closes those past the bound
that several reads brought.
"""

from __future__ import annotations

import asyncio
import os
import socket

__all__ = ["MAX_FDS", "FdLineReader", "close_fds", "send_line", "write_line"]

#: Descriptors one line may carry (an attach needs two: TCP and UDP).
MAX_FDS = 2
_READ_BYTES = 65536


def send_line(sock: socket.socket, line: bytes, fds: list[int]) -> int:
    """Send ``line`` (which ends in a newline) with ``fds`` on the non-blocking stream
    ``sock``; returns how many bytes went out (the descriptors always did if any byte
    did); the caller writes the rest. Raises OSError (BlockingIOError when the socket
    is full: the peer has not read the last line)."""
    if not fds:
        return sock.send(line)
    return socket.send_fds(sock, [line], fds)


async def write_line(sock: socket.socket, line: bytes, fds: list[int]) -> None:
    """Send all of ``line`` with ``fds`` on the non-blocking stream ``sock``, waiting
    while it is full; the caller serialises writers. Raises OSError."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            sent = send_line(sock, line, fds)
            break
        except BlockingIOError:
            writable = loop.create_future()
            loop.add_writer(sock.fileno(), _settle, writable)
            try:
                await writable
            finally:
                loop.remove_writer(sock.fileno())
    if sent < len(line):
        await loop.sock_sendall(sock, line[sent:])


class FdLineReader:
    """Reads lines with their descriptors from a non-blocking unix stream socket.

    Each descriptor is received close-on-exec and belongs to its caller once
    ``readline`` returns it; those of a partial line at EOF are closed."""

    def __init__(self, sock: socket.socket, *, max_line_bytes: int, max_fds: int = MAX_FDS) -> None:
        self._sock = sock
        self._max_line, self._max_fds = max_line_bytes, max_fds
        self._buffer = b""
        #: Descriptors not yet handed out, each with the offset in ``_buffer`` of the
        #: last byte of the read that brought it.
        self._fds: list[tuple[int, int]] = []

    async def readline(self) -> tuple[bytes, list[int]]:
        """The next line (newline included) and its descriptors; ``(b"", [])`` at EOF.
        Raises ValueError for a line over ``max_line_bytes`` (the session should end),
        OSError from the socket."""
        while (end := self._buffer.find(b"\n")) < 0:
            if len(self._buffer) > self._max_line:
                self.close()
                raise ValueError(f"a control line is over {self._max_line} bytes")
            data, fds = await self._receive()
            if not data:
                self.close()
                return b"", []
            self._buffer += data
            self._fds += [(len(self._buffer) - 1, fd) for fd in fds]
        if end >= self._max_line:
            self.close()
            raise ValueError(f"a control line is over {self._max_line} bytes")
        line, self._buffer = self._buffer[: end + 1], self._buffer[end + 1 :]
        mine = [fd for offset, fd in self._fds if offset <= end]
        self._fds = [(offset - end - 1, fd) for offset, fd in self._fds if offset > end]
        close_fds(mine[self._max_fds :])
        return line, mine[: self._max_fds]

    def close(self) -> None:
        """Close the descriptors not handed out (the socket stays the caller's)."""
        close_fds([fd for _, fd in self._fds])
        self._fds = []

    async def _receive(self) -> tuple[bytes, list[int]]:
        loop = asyncio.get_running_loop()
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(
                    self._sock, _READ_BYTES, self._max_fds, socket.MSG_CMSG_CLOEXEC
                )
                return data, fds
            except BlockingIOError:
                readable = loop.create_future()
                loop.add_reader(self._sock.fileno(), _settle, readable)
                try:
                    await readable
                finally:
                    loop.remove_reader(self._sock.fileno())


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():  # the reader may fire again before it is removed
        future.set_result(None)


def close_fds(fds: list[int]) -> None:
    """Close each of ``fds`` (descriptors received and not wanted)."""
    for fd in fds:
        os.close(fd)
