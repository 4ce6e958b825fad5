"""A hostile guest can break its own channel, never the node or another channel.

A fake guest on a socketpair answers HELLO correctly, then misbehaves while the host
has a call pending. Each misbehaviour must: close that channel, fail the pending call
with Unavailable (carrying the sandbox id), log exactly one error, and leave a second,
healthy channel running at the same time untouched.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import pytest

from space.node.api import ExecRequest, ProcessSelector, Timeout, Unavailable
from space.node.channel import GuestChannel
from space.protocol import (
    DATA_CHUNK_BYTES,
    INITIAL_WINDOW_BYTES,
    MAX_FRAME_BYTES,
    Channel,
    FrameKind,
    encode_data,
    encode_frame,
)
from tests.fake_guest import FakeGuest, connect

HOSTILE = "sb-hostile"
HEALTHY = "sb-healthy"


def started(guest: FakeGuest, stream: int) -> None:
    guest.send_json(FrameKind.EVENT, stream, {"event": "started", "pid": 7, "process_id": "p1"})


async def run_exec(channel: GuestChannel) -> None:
    stream = await channel.exec(ExecRequest(argv=["x"]))
    await asyncio.sleep(0.2)  # let the reader take in everything the guest sent
    async for _ in stream:
        pass


async def run_follow(channel: GuestChannel) -> None:
    """A background exec that follows its output on the same stream (E2B's Start)."""
    stream = await channel.exec(ExecRequest(argv=["x"], background=True, follow=True))
    await asyncio.sleep(0.2)
    async for _ in stream:
        pass


async def run_attach_by_pid(channel: GuestChannel) -> None:
    """An attach that names the process by its pid (E2B's Connect)."""
    stream = await channel.attach(ProcessSelector(pid=7))
    await asyncio.sleep(0.2)
    async for _ in stream:
        pass


def _started_with(**fields: object) -> Callable[[FakeGuest, int], None]:
    def act(guest: FakeGuest, stream: int) -> None:
        event = {"event": "started", "pid": 7, "process_id": "p1"} | fields
        guest.send_json(FrameKind.EVENT, stream, event)

    return act


async def run_stat(channel: GuestChannel) -> None:
    await channel.stat("x")


@dataclass(frozen=True)
class Misbehaviour:
    name: str
    call: Callable[[GuestChannel], Coroutine[Any, Any, None]]
    act: Callable[[FakeGuest, int], None]


def _beyond_credit(guest: FakeGuest, stream: int) -> None:
    started(guest, stream)
    chunk = encode_data(Channel.OUTPUT, b"x" * (DATA_CHUNK_BYTES - 1))
    for _ in range(INITIAL_WINDOW_BYTES // len(chunk) + 1):
        guest.send(FrameKind.DATA, stream, chunk)


async def run_input(channel: GuestChannel) -> None:
    await channel.write_stdin("p1", b"keys")


async def run_watch(channel: GuestChannel) -> None:
    stream = await channel.watch_dir("/home/user", recursive=True)
    await asyncio.sleep(0.2)
    async for _ in stream:
        pass


def _watch_line(line: bytes) -> Callable[[FakeGuest, int], None]:
    def act(guest: FakeGuest, stream: int) -> None:
        guest.watching(stream)
        guest.watch_lines(stream, line)

    return act


def _truncated_then_eof(guest: FakeGuest, stream: int) -> None:
    guest.writer.write(struct.pack(">IBI", 100, FrameKind.RESULT, stream) + b"{")
    guest.writer.close()


def _string_exit_code(guest: FakeGuest, stream: int) -> None:
    started(guest, stream)
    result = {"ok": True, "exit_code": "0", "signal": None, "timed_out": False}
    guest.send_json(FrameKind.RESULT, stream, result)


def _background_start_for_a_follow(guest: FakeGuest, stream: int) -> None:
    started(guest, stream)  # then the RESULT of an unfollowed background exec: no end
    guest.send_json(FrameKind.RESULT, stream, {"ok": True, "process_id": "p1", "pid": 7})


def _started_twice(guest: FakeGuest, stream: int) -> None:
    started(guest, stream)
    started(guest, stream)


CASES = [
    Misbehaviour(
        "oversized length",
        run_stat,
        lambda g, s: g.writer.write(struct.pack(">I", MAX_FRAME_BYTES + 1) + b"\0" * 64),
    ),
    Misbehaviour("truncated frame then EOF", run_stat, _truncated_then_eof),
    Misbehaviour("unknown kind", run_stat, lambda g, s: g.send(99, s, b"")),
    Misbehaviour("DATA beyond credit", run_exec, _beyond_credit),
    Misbehaviour(
        "DATA on an unknown stream",
        run_stat,
        lambda g, s: g.send(FrameKind.DATA, s + 1000, encode_data(Channel.OUTPUT, b"x")),
    ),
    Misbehaviour(
        "DATA before the started event",
        run_exec,
        lambda g, s: g.send(FrameKind.DATA, s, encode_data(Channel.OUTPUT, b"x")),
    ),
    Misbehaviour(
        "malformed RESULT JSON", run_stat, lambda g, s: g.send(FrameKind.RESULT, s, b"{not json")
    ),
    Misbehaviour("wrong-typed exit_code", run_exec, _string_exit_code),
    Misbehaviour(
        "Stat of the wrong shape",
        run_stat,
        lambda g, s: g.send_json(FrameKind.RESULT, s, {"ok": True, "stat": {"name": 1}}),
    ),
    Misbehaviour(
        "RESULT without ok", run_stat, lambda g, s: g.send_json(FrameKind.RESULT, s, {"x": 1})
    ),
    Misbehaviour("too many events", run_exec, _started_twice),
    Misbehaviour("a followed exec's DATA beyond credit", run_follow, _beyond_credit),
    Misbehaviour(
        "a followed exec's DATA before the started event",
        run_follow,
        lambda g, s: g.send(FrameKind.DATA, s, encode_data(Channel.ERROR, b"x")),
    ),
    Misbehaviour("a followed exec's wrong-typed exit_code", run_follow, _string_exit_code),
    Misbehaviour("a followed exec started twice", run_follow, _started_twice),
    Misbehaviour(
        "a followed exec ending without an exit", run_follow, _background_start_for_a_follow
    ),
    Misbehaviour(
        "an attach by pid answered by another pid", run_attach_by_pid, _started_with(pid=8)
    ),
    Misbehaviour(
        "a started event's pty that is no boolean", run_attach_by_pid, _started_with(pty=1)
    ),
    Misbehaviour("a followed exec's pty that is no boolean", run_follow, _started_with(pty="yes")),
    Misbehaviour("an attach by pid's DATA beyond credit", run_attach_by_pid, _beyond_credit),
    Misbehaviour("an attach by pid's wrong-typed exit_code", run_attach_by_pid, _string_exit_code),
    Misbehaviour(
        "OPEN from the guest",
        run_stat,
        lambda g, s: g.send_json(FrameKind.OPEN, 2, {"op": "exec", "argv": ["sh"]}),
    ),
    Misbehaviour("CANCEL from the guest", run_stat, lambda g, s: g.send(FrameKind.CANCEL, s)),
    Misbehaviour(
        "a second HELLO",
        run_stat,
        lambda g, s: g.send_json(FrameKind.HELLO, 0, {"version": 1}),
    ),
    Misbehaviour(
        "process.input answering more bytes than sent",
        run_input,
        lambda g, s: g.send_json(FrameKind.RESULT, s, {"ok": True, "bytes": 2**40}),
    ),
    Misbehaviour(
        "a watch started with no path",
        run_watch,
        lambda g, s: g.send_json(FrameKind.EVENT, s, {"event": "watching", "path": 7}),
    ),
    Misbehaviour("a watch line of unknown type", run_watch, _watch_line(b'{"type": "boom"}\n')),
    Misbehaviour("a watch line that is not JSON", run_watch, _watch_line(b"create /etc/shadow\n")),
    Misbehaviour(
        "a watch event without is_dir",
        run_watch,
        _watch_line(b'{"type": "create", "path": "/a", "name": "a"}\n'),
    ),
    Misbehaviour("a watch line without end", run_watch, _watch_line(b"x" * (64 * 1024 + 1))),
    Misbehaviour(
        "a dropped count that is no count",
        run_watch,
        _watch_line(b'{"type": "dropped", "count": -1}\n'),
    ),
    Misbehaviour("an oversized PING", run_stat, lambda g, s: g.send(FrameKind.PING, 0, b"p" * 65)),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_negative_a_misbehaving_guest_closes_only_its_own_channel(
    case: Misbehaviour, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="space.node.channel")

    async def main() -> None:
        hostile, bad_guest = await connect(HOSTILE)
        healthy, good_guest = await connect(HEALTHY)
        serving = asyncio.create_task(good_guest.serve_pings())
        try:
            pending = asyncio.create_task(case.call(hostile))
            opened = await bad_guest.frame()
            assert opened.kind is FrameKind.OPEN
            case.act(bad_guest, opened.stream)
            with pytest.raises(Unavailable) as failure:
                async with asyncio.timeout(5):
                    await pending
            assert failure.value.sandbox_id == HOSTILE
            assert hostile.closed
            with pytest.raises(Unavailable):
                await hostile.ping()
            assert not healthy.closed
            assert await healthy.ping(timeout_s=2) < 1
        finally:
            serving.cancel()
            await hostile.close()
            await healthy.close()
            await bad_guest.close()
            await good_guest.close()

    asyncio.run(main())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and HOSTILE in errors[0].getMessage()


def test_negative_a_guest_without_a_common_version_is_unavailable() -> None:
    async def main() -> None:
        with pytest.raises(Unavailable, match="no common version"):
            await connect(HOSTILE, version=None, error="speaks 2 only")

    asyncio.run(main())


def test_negative_a_hello_for_another_session_is_unavailable() -> None:
    async def main() -> None:
        with pytest.raises(Unavailable, match="another session"):
            await connect(HOSTILE, session="not-ours")

    asyncio.run(main())


def test_negative_a_silent_guest_times_out_the_hello() -> None:
    async def main() -> None:
        host_sock, guest_sock = socket.socketpair()
        reader, writer = await asyncio.open_unix_connection(sock=host_sock)
        try:
            with pytest.raises(Timeout) as failure:
                await GuestChannel.open(reader, writer, sandbox_id=HOSTILE, hello_timeout_s=0.2)
            assert failure.value.sandbox_id == HOSTILE
        finally:
            guest_sock.close()

    asyncio.run(main())


def test_negative_a_frame_before_the_hello_is_unavailable() -> None:
    async def main() -> None:
        host_sock, guest_sock = socket.socketpair()
        reader, writer = await asyncio.open_unix_connection(sock=host_sock)
        guest_sock.sendall(encode_frame(FrameKind.PONG, 0, b""))
        try:
            with pytest.raises(Unavailable, match="expected HELLO"):
                await GuestChannel.open(reader, writer, sandbox_id=HOSTILE, hello_timeout_s=2)
        finally:
            guest_sock.close()
        assert writer.is_closing()

    asyncio.run(main())


def test_late_credit_for_a_finished_stream_is_tolerated() -> None:
    async def main() -> None:
        channel, guest = await connect(HOSTILE)
        try:
            pending = asyncio.create_task(channel.remove("x"))
            opened = await guest.frame()
            guest.send_json(FrameKind.RESULT, opened.stream, {"ok": True})
            await pending
            guest.send(FrameKind.CREDIT, opened.stream, struct.pack(">I", 10))
            serving = asyncio.create_task(guest.serve_pings())
            assert await channel.ping(timeout_s=2) < 1
            assert not channel.closed
            serving.cancel()
        finally:
            await channel.close()
            await guest.close()

    asyncio.run(main())
