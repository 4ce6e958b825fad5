"""Lines with descriptors over a unix socket (the node's attach to its gateway, issue 18):
each line gets the descriptors sent with it, at most MAX_FDS, and every other one the
reader received is closed."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator

import pytest

from space.node.egress.gateway import GatewayError, Listeners
from space.node.network.fd_lines import MAX_FDS, FdLineReader, send_line

#: A line the reader accepts whole in these tests.
MAX_LINE = 1024


class Pipes:
    """Pipes whose write ends get sent: a read end sees EOF once every copy of its
    write end, the receiver's included, is closed."""

    def __init__(self, count: int) -> None:
        self.pairs = [os.pipe() for _ in range(count)]

    @property
    def write_ends(self) -> list[int]:
        return [w for _, w in self.pairs]

    def close_write_ends(self) -> None:
        for w in self.write_ends:
            os.close(w)

    def open_elsewhere(self) -> list[bool]:
        """For each pipe, whether a copy of its write end is still open."""
        found = []
        for r, _ in self.pairs:
            os.set_blocking(r, False)
            try:
                found.append(os.read(r, 1) != b"")
            except BlockingIOError:
                found.append(True)
        return found

    def close(self) -> None:
        for r, _ in self.pairs:
            os.close(r)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


def _read(sock: socket.socket) -> tuple[bytes, list[int], FdLineReader]:
    reader = FdLineReader(sock, max_line_bytes=MAX_LINE)
    line, fds = asyncio.run(reader.readline())
    return line, fds, reader


def test_a_line_arrives_with_the_descriptors_sent_with_it(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, receiver = pair
    pipes = Pipes(2)
    assert send_line(sender, b'{"op": "ping"}\n', []) == 15
    sender.sendall(b'{"op": "attach"}\n')
    socket.send_fds(sender, [b'{"op": "attach", "fds": 2}\n'], pipes.write_ends)
    pipes.close_write_ends()
    reader = FdLineReader(receiver, max_line_bytes=MAX_LINE)

    async def three() -> list[tuple[bytes, list[int]]]:
        return [await reader.readline() for _ in range(3)]

    (first, none), (second, none_either), (third, fds) = asyncio.run(three())
    assert (first, none, second, none_either) == (
        b'{"op": "ping"}\n',
        [],
        b'{"op": "attach"}\n',
        [],
    )
    assert third == b'{"op": "attach", "fds": 2}\n' and len(fds) == 2
    assert pipes.open_elsewhere() == [True, True]
    for fd in fds:
        os.close(fd)
    assert pipes.open_elsewhere() == [False, False]
    pipes.close()


def test_negative_descriptors_past_the_bound_are_closed(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, receiver = pair
    pipes = Pipes(MAX_FDS + 1)
    send_line(sender, b"many\n", pipes.write_ends)
    pipes.close_write_ends()
    line, fds, _ = _read(receiver)
    assert line == b"many\n" and len(fds) == MAX_FDS
    assert pipes.open_elsewhere() == [True] * MAX_FDS + [False]
    for fd in fds:
        os.close(fd)
    assert pipes.open_elsewhere() == [False] * (MAX_FDS + 1)
    pipes.close()


def test_negative_a_line_sent_in_parts_keeps_only_max_fds_of_all_its_parts(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, receiver = pair
    pipes = Pipes(2 * MAX_FDS)
    socket.send_fds(sender, [b"first half, "], pipes.write_ends[:MAX_FDS])
    socket.send_fds(sender, [b"second half\n"], pipes.write_ends[MAX_FDS:])
    pipes.close_write_ends()
    line, fds, _ = _read(receiver)
    assert line == b"first half, second half\n" and len(fds) == MAX_FDS
    assert pipes.open_elsewhere() == [True] * MAX_FDS + [False] * MAX_FDS
    for fd in fds:
        os.close(fd)
    pipes.close()


def test_negative_the_descriptors_of_a_line_cut_short_are_closed(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, receiver = pair
    pipes = Pipes(1)
    socket.send_fds(sender, [b"no newline"], pipes.write_ends)
    pipes.close_write_ends()
    sender.shutdown(socket.SHUT_WR)
    line, fds, _ = _read(receiver)
    assert (line, fds) == (b"", [])
    assert pipes.open_elsewhere() == [False]
    pipes.close()


def test_negative_a_line_over_the_limit_ends_the_session_and_closes_its_descriptors(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, receiver = pair
    pipes = Pipes(1)
    socket.send_fds(sender, [b"x" * (MAX_LINE + 1) + b"\n"], pipes.write_ends)
    pipes.close_write_ends()
    reader = FdLineReader(receiver, max_line_bytes=MAX_LINE)
    with pytest.raises(ValueError, match=f"over {MAX_LINE} bytes"):
        asyncio.run(reader.readline())
    assert pipes.open_elsewhere() == [False]
    pipes.close()


def test_a_line_at_the_limit_is_read(pair: tuple[socket.socket, socket.socket]) -> None:
    sender, receiver = pair
    sender.sendall(b"x" * (MAX_LINE - 1) + b"\n")
    line, fds, _ = _read(receiver)
    assert len(line) == MAX_LINE and fds == []


def test_negative_listeners_are_a_tcp_and_a_udp_socket_or_all_are_closed() -> None:
    a, b = socket.socketpair()
    with pytest.raises(GatewayError, match="two listeners"):
        Listeners.adopt([os.dup(a.fileno()), os.dup(b.fileno())])
    r, w = os.pipe()
    with pytest.raises(GatewayError, match="not a socket"):
        Listeners.adopt([w])
    os.set_blocking(r, False)
    assert os.read(r, 1) == b""  # the pipe's one write end was closed
    os.close(r)
    a.close()
    b.close()


def test_listeners_of_a_tcp_and_a_udp_socket_are_taken_over() -> None:
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listeners = Listeners.adopt([tcp.detach(), udp.detach()])
    assert (listeners.tcp.type, listeners.udp.type) == (socket.SOCK_STREAM, socket.SOCK_DGRAM)
    assert not listeners.tcp.getblocking()
    listeners.close()
