"""How long ``commands.run`` waits (issue 15): for the start, as long as the server does;
for the end, the command's ``timeout_s`` plus a grace, counted from the start.

A tiny handler plays the API, so the start can come late and the stream can stall
(the ASGI transport of the live API buffers a whole answer). The grace is cut to a
fraction of a second.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import httpx
import pytest

from space.sdk import _commands
from space.sdk._commands import AsyncCommands
from space.sdk._http import ApiClient, ConnectionConfig
from space.sdk.errors import Timeout

pytestmark = pytest.mark.anyio

SANDBOX = "sb-busy"
TIMEOUT_S = 0.05
GRACE_S = 0.05
#: Far longer than TIMEOUT_S + GRACE_S.
LATE_S = 0.6

START = {"type": "start", "pid": 7, "process_id": "p1"}
OUTPUT = {"type": "stdout", "data": "b2sK"}  # "ok\n"
EXIT = {"type": "exit", "exit_code": 0, "signal": None, "timed_out": False}

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


@pytest.fixture(autouse=True)
def short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_commands, "_CLIENT_GRACE_S", GRACE_S)


def lines(*events: Mapping[str, object]) -> bytes:
    return b"".join(json.dumps(event).encode() + b"\n" for event in events)


def commands(handler: Handler, timeouts: list[dict[str, float]]) -> AsyncCommands:
    async def recording(request: httpx.Request) -> httpx.Response:
        timeouts.append(request.extensions["timeout"])
        return await handler(request)

    config = ConnectionConfig(api_url="http://space", transport=httpx.MockTransport(recording))
    return AsyncCommands(ApiClient(config), SANDBOX)


async def test_run_waits_for_a_start_that_comes_long_after_timeout_plus_grace() -> None:
    async def busy_guest(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(LATE_S)  # the node waits for a busy guest to start it
        return httpx.Response(200, content=lines(START, OUTPUT, EXIT))

    timeouts: list[dict[str, float]] = []
    result = await commands(busy_guest, timeouts).run("echo ok", timeout_s=TIMEOUT_S)
    assert (result.stdout, result.exit_code) == ("ok\n", 0)
    # No bound of the client's below the server's: read and pool waits are the hung-API
    # backstop, not the 30 s of an ordinary request nor timeout_s plus the grace.
    backstop = _commands._STREAM_READ_TIMEOUT_S
    assert [(t["read"], t["pool"]) for t in timeouts] == [(backstop, backstop)]


async def test_a_background_start_waits_as_long_as_a_foreground_one() -> None:
    async def busy_guest(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(LATE_S)
        return httpx.Response(200, content=lines(START))

    timeouts: list[dict[str, float]] = []
    handle = await commands(busy_guest, timeouts).run("serve", background=True)
    assert handle.process_id == "p1"
    backstop = _commands._STREAM_READ_TIMEOUT_S
    assert [(t["read"], t["pool"]) for t in timeouts] == [(backstop, backstop)]


async def test_negative_run_gives_up_timeout_plus_grace_after_the_start() -> None:
    async def stalled() -> AsyncIterator[bytes]:
        yield lines(START)
        await asyncio.sleep(30)  # the exit never comes (a broken guest daemon)

    async def started_then_stalled(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(LATE_S)  # a late start counts for nothing
        return httpx.Response(200, content=stalled())

    began = time.monotonic()
    with pytest.raises(Timeout) as failure:
        await commands(started_then_stalled, []).run("sleep 9", timeout_s=TIMEOUT_S)
    waited = time.monotonic() - began
    assert LATE_S + TIMEOUT_S + GRACE_S <= waited < LATE_S + 2.0
    limit = TIMEOUT_S + GRACE_S
    assert f"within {limit} s of its start (process p1)" in failure.value.message
    assert failure.value.sandbox_id == SANDBOX
    assert failure.value.details == {"timeout_s": limit}
