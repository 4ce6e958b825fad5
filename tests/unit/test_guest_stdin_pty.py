"""Interactive stdin, PTY sessions and process tags (issue 20), on spaced as a real
subprocess (--stdio) driven through GuestChannel."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from space.node.api import (
    Conflict,
    ExecExited,
    ExecOutput,
    ExecRequest,
    ExecStream,
    InvalidArgument,
    NotFound,
    PtySize,
)
from space.node.channel import GuestChannel
from space.protocol import MAX_INPUT_BYTES, MAX_PTY_SIZE

from ._guest_harness import Guest, run_with_channel
from .fakes import wait_for


async def read_until(stream: ExecStream, needle: bytes, seen: bytearray) -> None:
    """Collect stdout into ``seen`` until it holds ``needle`` (a PTY echoes input too)."""
    iterator = aiter(stream)
    async with asyncio.timeout(20):
        while needle not in seen:
            event = await anext(iterator)
            if isinstance(event, ExecOutput):
                seen.extend(event.data)


async def finish(stream: ExecStream) -> tuple[bytes, bytes, ExecExited]:
    out, err = bytearray(), bytearray()
    exited = None
    async with asyncio.timeout(20):
        async for event in stream:
            if isinstance(event, ExecOutput):
                (out if event.stream == "stdout" else err).extend(event.data)
            else:
                exited = event
    assert exited is not None
    return bytes(out), bytes(err), exited


def test_stdin_written_in_pieces_then_closed_reaches_a_foreground_process(
    tmp_path: Path,
) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        stream = await channel.exec(ExecRequest(argv=["cat"], open_stdin=True))
        assert await channel.write_stdin(stream.process_id, b"one ") == 4
        assert await channel.write_stdin(stream.process_id, b"two") == 3
        assert await channel.write_stdin(stream.process_id, b"", eof=True) == 0
        out, _, exited = await finish(stream)
        assert out == b"one two" and exited.exit_code == 0

    run_with_channel(tmp_path, body)


def test_stdin_reaches_a_background_process_and_its_output_is_buffered(tmp_path: Path) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        request = ExecRequest(argv=["cat"], open_stdin=True, background=True, tag="echoer")
        started = await channel.exec(request)
        listed = {p.process_id: p for p in await channel.list_processes()}
        assert listed[started.process_id].tag == "echoer"
        big = b"x" * MAX_INPUT_BYTES  # exactly the cap: accepted
        assert await channel.write_stdin(started.process_id, big, eof=True) == MAX_INPUT_BYTES
        out, _, exited = await finish(await channel.attach(started.process_id))
        assert len(out) == MAX_INPUT_BYTES and exited.exit_code == 0

    run_with_channel(tmp_path, body)


def test_a_followed_background_exec_streams_its_output_and_end_on_one_request(
    tmp_path: Path,
) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        request = ExecRequest(
            cmd="cat; echo err >&2; exit 4",
            open_stdin=True,
            background=True,
            follow=True,
            tag="followed",
        )
        stream = await channel.exec(request)
        (info,) = await channel.list_processes()  # a background process like any other
        assert (info.process_id, info.pid, info.tag) == (stream.process_id, stream.pid, "followed")
        assert info.running
        assert await channel.write_stdin(stream.process_id, b"hi", eof=True) == 2
        out, err, exited = await finish(stream)
        assert (out, err, exited) == (b"hi", b"err\n", ExecExited(4, None, False))

    run_with_channel(tmp_path, body)


def test_closing_a_followed_exec_detaches_and_the_process_runs_on(tmp_path: Path) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        request = ExecRequest(
            cmd='echo one; read line; echo "$line"; sleep 30',
            open_stdin=True,
            background=True,
            follow=True,
        )
        stream = await channel.exec(request)
        await read_until(stream, b"one\n", bytearray())
        await stream.aclose()
        await asyncio.sleep(0.3)
        (info,) = await channel.list_processes()
        assert info.process_id == stream.process_id and info.running
        assert await channel.write_stdin(stream.process_id, b"two\n") == 4
        attached = await channel.attach(stream.process_id)
        await read_until(attached, b"one\ntwo\n", bytearray())  # replay, then live
        await channel.kill_process(stream.process_id, 15)
        _, _, exited = await finish(attached)
        assert exited.signal == 15

    run_with_channel(tmp_path, body)


def test_negative_follow_without_background_is_refused_and_starts_nothing(
    tmp_path: Path,
) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        with pytest.raises(InvalidArgument, match="follow needs background"):
            await channel.exec(ExecRequest(cmd="touch made", follow=True))
        assert await channel.list_processes() == []
        assert not (tmp_path / "made").exists()

    run_with_channel(tmp_path, body)


def test_negative_stdin_to_unknown_finished_or_closed_processes_is_refused(
    tmp_path: Path,
) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        with pytest.raises(NotFound):
            await channel.write_stdin("p0000000000000000", b"x")
        plain = await channel.exec(ExecRequest(argv=["sleep", "30"], background=True))
        with pytest.raises(Conflict, match="without open_stdin"):
            await channel.write_stdin(plain.process_id, b"x")
        await channel.kill_process(plain.process_id)
        done = await channel.exec(ExecRequest(argv=["true"], open_stdin=True, background=True))
        await finish(await channel.attach(done.process_id))
        with pytest.raises(Conflict, match="exited"):
            await channel.write_stdin(done.process_id, b"x")
        # A process that does not end at EOF (cat would, and be gone: NotFound).
        idle = await channel.exec(
            ExecRequest(argv=["sleep", "30"], open_stdin=True, background=True)
        )
        await channel.write_stdin(idle.process_id, b"", eof=True)
        with pytest.raises(Conflict, match="closed"):
            await channel.write_stdin(idle.process_id, b"x")
        with pytest.raises(InvalidArgument, match="exceeds"):
            await channel.write_stdin(idle.process_id, b"x" * (MAX_INPUT_BYTES + 1))
        await channel.kill_process(idle.process_id)
        stream = await channel.exec(ExecRequest(argv=["cat"], open_stdin=True))
        await channel.write_stdin(stream.process_id, b"", eof=True)
        assert (await finish(stream))[2].exit_code == 0
        with pytest.raises(InvalidArgument, match="excludes"):
            await channel.exec(ExecRequest(argv=["cat"], stdin=b"x", open_stdin=True))

    run_with_channel(tmp_path, body)


def test_a_pty_session_echoes_resizes_and_takes_ctrl_c(tmp_path: Path) -> None:
    script = (
        "trap 'echo GOT-INT; exit 7' INT; stty size; "
        'while read line; do echo "line:$line"; stty size; done'
    )

    async def body(channel: GuestChannel, guest: Guest) -> None:
        request = ExecRequest(argv=["sh", "-c", script], pty=PtySize(rows=30, cols=100))
        stream = await channel.exec(request)
        seen = bytearray()
        await read_until(stream, b"30 100", seen)
        await channel.resize_pty(stream.process_id, PtySize(rows=40, cols=120))
        await channel.write_stdin(stream.process_id, b"hello\n")
        await read_until(stream, b"40 120", seen)
        assert b"line:hello" in seen
        await channel.write_stdin(stream.process_id, b"\x03")  # Ctrl-C via the terminal
        out, err, exited = await finish(stream)
        assert b"GOT-INT" in seen + out and err == b"" and exited.exit_code == 7
        cat = await channel.exec(ExecRequest(argv=["cat"], pty=PtySize()))
        await channel.write_stdin(cat.process_id, b"typed\n", eof=True)  # then Ctrl-D
        out, _, exited = await finish(cat)
        assert out.count(b"typed") == 2 and exited.exit_code == 0  # the echo, then cat

    run_with_channel(tmp_path, body)


def test_negative_pty_sizes_out_of_range_and_resizes_without_a_pty_are_refused(
    tmp_path: Path,
) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        for size in (PtySize(0, 80), PtySize(24, MAX_PTY_SIZE + 1)):
            with pytest.raises(InvalidArgument, match="pty"):
                await channel.exec(ExecRequest(argv=["true"], pty=size))
        edge = ExecRequest(argv=["stty", "size"], pty=PtySize(MAX_PTY_SIZE, 1))
        out, _, _ = await finish(await channel.exec(edge))
        assert out.strip() == f"{MAX_PTY_SIZE} 1".encode()
        plain = await channel.exec(ExecRequest(argv=["sleep", "30"], background=True))
        with pytest.raises(Conflict, match="no pty"):
            await channel.resize_pty(plain.process_id, PtySize(10, 10))
        with pytest.raises(NotFound):
            await channel.resize_pty("p0000000000000000", PtySize(10, 10))
        await channel.kill_process(plain.process_id)
        with pytest.raises(InvalidArgument, match="tag"):
            await channel.exec(ExecRequest(argv=["true"], tag="no spaces"))

    run_with_channel(tmp_path, body)


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_closing_a_pty_exec_kills_its_process_and_spaced_keeps_no_descriptor(
    tmp_path: Path,
) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        spaced = guest.proc.pid
        before = _open_fds(spaced)
        stream = await channel.exec(ExecRequest(argv=["sleep", "300"], pty=PtySize()))
        assert _alive(stream.pid)
        await stream.aclose()  # the client went away
        await wait_for(lambda: not _alive(stream.pid) and _open_fds(spaced) <= before, 10)
        with pytest.raises(NotFound):
            await channel.write_stdin(stream.process_id, b"x")

    run_with_channel(tmp_path, body)
