"""A wait on the guest lasts as long as the guest is alive (issue 15), never longer.

A FakeGuest (tests/fake_guest.py) plays a guest that is slow but alive (it answers
PINGs, or talks on other streams) or one that has gone silent. The channel's silence
timeout is cut to a fraction of a second, so "longer than the old fixed deadline" is
several silence timeouts here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from space.node.api import ExecExited, ExecOutput, ExecRequest, ExecStream, Timeout
from space.node.channel import GuestChannel
from space.node.channel._liveness import Liveness
from space.protocol import Channel, Frame, FrameKind, encode_credit, encode_data
from tests.fake_guest import FakeGuest, connect

SANDBOX = "sb-slow"
SILENCE_S = 0.4
PING_S = 0.1
#: How long a slow guest takes here: several silence timeouts.
SLOW_S = 4 * SILENCE_S
OPTIONS = {"silence_timeout_s": SILENCE_S, "ping_interval_s": PING_S}


class Recorder:
    """Reads what the host sends to a FakeGuest, answering PINGs if ``pong``."""

    def __init__(self, guest: FakeGuest, *, pong: bool) -> None:
        self.guest = guest
        self.pong = pong
        self.frames: list[Frame] = []
        self.opened: asyncio.Queue[Frame] = asyncio.Queue()
        self.input_ended = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            frame = await self.guest.frame()
            self.frames.append(frame)
            if frame.kind is FrameKind.PING and self.pong:
                self.guest.send(FrameKind.PONG, 0, frame.payload)
            elif frame.kind is FrameKind.OPEN:
                self.opened.put_nowait(frame)
            elif frame.kind is FrameKind.EOF:
                self.input_ended.set()

    def kinds(self, kind: FrameKind) -> list[Frame]:
        return [frame for frame in self.frames if frame.kind is kind]

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


@contextlib.asynccontextmanager
async def guest_session(*, pong: bool) -> AsyncIterator[tuple[GuestChannel, FakeGuest, Recorder]]:
    channel, guest = await connect(SANDBOX, channel_options=OPTIONS)
    recorder = Recorder(guest, pong=pong)
    try:
        yield channel, guest, recorder
    finally:
        await recorder.stop()
        await channel.close()
        await guest.close()


def started(guest: FakeGuest, stream: int) -> None:
    guest.send_json(FrameKind.EVENT, stream, {"event": "started", "pid": 7, "process_id": "p1"})


def exited(guest: FakeGuest, stream: int) -> None:
    result: dict[str, object] = {"ok": True, "exit_code": 0, "signal": None, "timed_out": False}
    guest.send_json(FrameKind.RESULT, stream, result)


async def collect(stream: ExecStream) -> tuple[bytes, ExecExited | None]:
    out, end = bytearray(), None
    async for event in stream:
        if isinstance(event, ExecOutput):
            out += event.data
        else:
            end = event
    return bytes(out), end


def test_an_exec_that_starts_after_many_silence_timeouts_is_answered_while_pongs_come() -> None:
    async def main() -> None:
        async with guest_session(pong=True) as (channel, guest, recorder):
            starting = asyncio.create_task(channel.exec(ExecRequest(argv=["echo", "ok"])))
            opened = await recorder.opened.get()
            await asyncio.sleep(SLOW_S)  # the daemon is busy: it answers only PINGs
            started(guest, opened.stream)
            guest.send(FrameKind.DATA, opened.stream, encode_data(Channel.OUTPUT, b"ok\n"))
            exited(guest, opened.stream)
            stream = await starting
            assert await collect(stream) == (b"ok\n", ExecExited(0, None, False))
            assert len(recorder.kinds(FrameKind.PING)) >= SLOW_S / PING_S / 2
            assert not recorder.kinds(FrameKind.CANCEL)

    asyncio.run(main())


def test_a_slow_answer_is_awaited_while_the_guest_talks_on_another_stream() -> None:
    async def main() -> None:
        # No PONG at all: the frames of a running exec are the only signs of life.
        async with guest_session(pong=False) as (channel, guest, recorder):
            running = asyncio.create_task(channel.exec(ExecRequest(argv=["top"])))
            exec_stream = (await recorder.opened.get()).stream
            started(guest, exec_stream)
            output = asyncio.create_task(collect(await running))
            stat = asyncio.create_task(channel.stat("f"))
            stat_stream = (await recorder.opened.get()).stream
            for _ in range(int(SLOW_S / PING_S)):
                guest.send(FrameKind.DATA, exec_stream, encode_data(Channel.OUTPUT, b"."))
                await asyncio.sleep(PING_S)
            stat_result = {"name": "f", "path": "/f", "type": "file", "size": 1, "mode": 420}
            stat_result |= {"mtime": 0.0, "owner": "user"}
            guest.send_json(FrameKind.RESULT, stat_stream, {"ok": True, "stat": stat_result})
            exited(guest, exec_stream)
            assert (await stat).size == 1
            out, end = await output
            assert out == b"." * int(SLOW_S / PING_S) and end is not None
            assert not recorder.kinds(FrameKind.CANCEL)

    asyncio.run(main())


def test_a_running_exec_silent_for_longer_than_the_silence_timeout_ends_normally() -> None:
    async def main() -> None:
        async with guest_session(pong=True) as (channel, guest, recorder):
            starting = asyncio.create_task(channel.exec(ExecRequest(argv=["sleep", "1"])))
            opened = await recorder.opened.get()
            started(guest, opened.stream)
            stream = await starting
            ending = asyncio.create_task(collect(stream))
            await asyncio.sleep(SLOW_S)  # the process prints nothing; the daemon pongs
            exited(guest, opened.stream)
            assert await ending == (b"", ExecExited(0, None, False))

    asyncio.run(main())


def test_negative_a_silent_guest_fails_the_exec_start_with_timeout_and_cancels_it() -> None:
    async def main() -> None:
        async with guest_session(pong=False) as (channel, guest, recorder):
            began = time.monotonic()
            starting = asyncio.create_task(channel.exec(ExecRequest(argv=["echo"])))
            opened = await recorder.opened.get()
            with pytest.raises(Timeout) as failure:
                await starting
            waited = time.monotonic() - began
            assert SILENCE_S <= waited < SILENCE_S + 1.0
            assert failure.value.sandbox_id == SANDBOX
            assert f"sent nothing for {SILENCE_S} s" in failure.value.message
            await asyncio.sleep(0.05)
            assert [f.stream for f in recorder.kinds(FrameKind.CANCEL)] == [opened.stream]
            assert recorder.kinds(FrameKind.PING)  # it was asked, and said nothing
            # Late frames of the abandoned stream are dropped; the channel lives on.
            started(guest, opened.stream)
            exited(guest, opened.stream)
            recorder.pong = True
            assert await channel.ping(timeout_s=2) < 1
            assert not channel.closed

    asyncio.run(main())


def test_negative_silence_is_counted_from_the_guests_last_frame_not_the_request() -> None:
    async def main() -> None:
        async with guest_session(pong=True) as (channel, _guest, recorder):
            began = time.monotonic()
            answering = asyncio.create_task(channel.stat("f"))
            await recorder.opened.get()
            await asyncio.sleep(SLOW_S)
            recorder.pong = False  # the guest dies here
            died = time.monotonic()
            with pytest.raises(Timeout):
                await answering
            assert time.monotonic() - began >= SLOW_S + SILENCE_S - PING_S
            assert time.monotonic() - died < SILENCE_S + 1.0

    asyncio.run(main())


def test_negative_a_guest_falling_silent_mid_exec_fails_the_stream_and_kills_the_process() -> None:
    async def main() -> None:
        async with guest_session(pong=False) as (channel, guest, recorder):
            starting = asyncio.create_task(channel.exec(ExecRequest(argv=["sleep", "9"])))
            opened = await recorder.opened.get()
            started(guest, opened.stream)
            stream = await starting
            with pytest.raises(Timeout, match="exec: the guest sent nothing"):
                await collect(stream)
            await asyncio.sleep(0.05)
            assert [f.stream for f in recorder.kinds(FrameKind.CANCEL)] == [opened.stream]

    asyncio.run(main())


async def chunks(count: int, size: int) -> AsyncIterator[bytes]:
    for _ in range(count):
        yield b"x" * size


def test_a_write_waits_for_credit_as_long_as_the_guest_pongs() -> None:
    async def main() -> None:
        async with guest_session(pong=True) as (channel, guest, recorder):
            writing = asyncio.create_task(channel.write_file("big", chunks(3, 512 * 1024)))
            opened = await recorder.opened.get()
            await asyncio.sleep(SLOW_S)  # 1 MiB sent, the rest waits for credit
            guest.send(FrameKind.CREDIT, opened.stream, encode_credit(1 << 20))
            await recorder.input_ended.wait()
            stat = {"name": "big", "path": "/big", "type": "file", "size": 3 << 19}
            stat |= {"mode": 420, "mtime": 0.0, "owner": "user"}
            guest.send_json(FrameKind.RESULT, opened.stream, {"ok": True, "stat": stat})
            assert (await writing).size == 3 << 19
            assert not recorder.kinds(FrameKind.CANCEL)

    asyncio.run(main())


def test_negative_a_write_to_a_silent_guest_raises_timeout_and_cancels() -> None:
    async def main() -> None:
        async with guest_session(pong=False) as (channel, _guest, recorder):
            writing = asyncio.create_task(channel.write_file("big", chunks(3, 512 * 1024)))
            opened = await recorder.opened.get()
            with pytest.raises(Timeout, match="writing big: the guest sent nothing"):
                await writing
            await asyncio.sleep(0.05)
            assert [f.stream for f in recorder.kinds(FrameKind.CANCEL)] == [opened.stream]

    asyncio.run(main())


def test_an_idle_channel_is_not_pinged_and_concurrent_waits_share_one_ping() -> None:
    async def main() -> None:
        async with guest_session(pong=False) as (channel, _guest, recorder):
            await asyncio.sleep(2 * PING_S)
            assert not recorder.kinds(FrameKind.PING)  # nothing waits: nothing to ask
            waits = [asyncio.create_task(channel.stat(f"f{n}")) for n in range(5)]
            for _ in waits:
                await recorder.opened.get()
            results = await asyncio.gather(*waits, return_exceptions=True)
            assert all(isinstance(result, Timeout) for result in results)
            pings = len(recorder.kinds(FrameKind.PING))
            assert 1 <= pings <= SILENCE_S / PING_S + 1  # once per interval, not per wait
            await asyncio.sleep(2 * PING_S)
            assert len(recorder.kinds(FrameKind.PING)) == pings

    asyncio.run(main())


@pytest.mark.parametrize(("silence_s", "ping_s"), [(1.0, 0.0), (1.0, 2.0), (0.0, 0.0)])
def test_negative_a_ping_interval_outside_the_silence_timeout_is_refused(
    silence_s: float, ping_s: float
) -> None:
    with pytest.raises(ValueError, match="ping_interval_s"):
        Liveness(lambda: None, silence_timeout_s=silence_s, ping_interval_s=ping_s)
