"""Interactive processes on a real guest (issue 20): stdin in pieces, a PTY session
with resize and Ctrl-C, through the node's NodeService on a booted VM."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable

import pytest

from space.node.agent import Node
from space.node.api import (
    ExecExited,
    ExecOutput,
    ExecRequest,
    ExecStream,
    NotFound,
    PtySize,
    SandboxSpec,
)

from .conftest import NodeHarness

pytestmark = pytest.mark.vm


async def _until(stream: ExecStream, needle: bytes, seen: bytearray, timeout_s: float = 60) -> None:
    iterator = aiter(stream)
    async with asyncio.timeout(timeout_s):
        while needle not in seen:
            event = await anext(iterator)
            if isinstance(event, ExecOutput):
                seen.extend(event.data)


async def _end(stream: ExecStream) -> tuple[bytes, ExecExited]:
    out = bytearray()
    async with asyncio.timeout(60):
        async for event in stream:
            if isinstance(event, ExecOutput):
                out.extend(event.data)
            else:
                return bytes(out), event
    raise AssertionError("no exit")


async def _stdin_in_pieces(node: Node, sid: str) -> list[float]:
    stream = await node.exec(sid, ExecRequest(argv=["cat"], open_stdin=True))
    latencies = []
    seen = bytearray()
    for index in range(10):  # each piece echoed back: input to output round trip
        started = time.monotonic()
        await node.write_stdin(sid, stream.process_id, f"piece-{index};".encode())
        await _until(stream, f"piece-{index};".encode(), seen)
        latencies.append(time.monotonic() - started)
    await node.write_stdin(sid, stream.process_id, b"", eof=True)
    out, exited = await _end(stream)
    assert exited.exit_code == 0
    assert bytes(seen + out) == b"".join(f"piece-{i};".encode() for i in range(10))
    with pytest.raises(NotFound):  # a foreground process leaves the table with its stream
        await node.write_stdin(sid, stream.process_id, b"late")
    return latencies


async def _pty_session(node: Node, sid: str) -> None:
    script = (
        "trap 'echo GOT-INT; exit 7' INT; stty size; "
        'while read line; do echo "line:$line"; stty size; done'
    )
    request = ExecRequest(argv=["sh", "-c", script], pty=PtySize(rows=30, cols=100))
    stream = await node.exec(sid, request)
    seen = bytearray()
    await _until(stream, b"30 100", seen)
    await node.resize_pty(sid, stream.process_id, PtySize(rows=50, cols=132))
    await node.write_stdin(sid, stream.process_id, b"hello\n")
    await _until(stream, b"50 132", seen)
    assert b"line:hello" in seen
    await node.write_stdin(sid, stream.process_id, b"\x03")  # Ctrl-C through the terminal
    out, exited = await _end(stream)
    assert b"GOT-INT" in seen + out and exited.exit_code == 7


def test_stdin_in_pieces_and_a_pty_session_with_resize_and_ctrl_c(
    node: NodeHarness, record_property: Callable[[str, object], None]
) -> None:
    sid = "it-interactive"
    node.run(node.node.create_sandbox(SandboxSpec(sid)))
    try:
        latencies = node.run(_stdin_in_pieces(node.node, sid))
        node.run(_pty_session(node.node, sid))
    finally:
        node.run(node.node.delete_sandbox(sid))
    median_ms = statistics.median(latencies) * 1000
    record_property("stdin_echo_p50_ms", round(median_ms, 1))
    print(f"\nstdin piece to its echo: p50 {median_ms:.1f} ms, max {max(latencies) * 1000:.1f} ms")
