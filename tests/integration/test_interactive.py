"""Interactive processes and directory watches on a real guest (issue 20): stdin in
pieces, a PTY session with resize and Ctrl-C, a recursive watch, through the node's
NodeService on a booted VM."""

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
    WatchEvent,
    WatchStream,
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


async def _changes(stream: WatchStream, wanted: set[tuple[str, str]]) -> list[WatchEvent]:
    seen: list[WatchEvent] = []
    iterator = aiter(stream)
    async with asyncio.timeout(60):
        while not wanted <= {(e.type, e.name) for e in seen}:
            seen.append(await anext(iterator))
    return seen


async def _recursive_watch(node: Node, sid: str) -> None:
    async def run(cmd: str) -> None:
        assert (await _end(await node.exec(sid, ExecRequest(cmd=cmd))))[1].exit_code == 0

    await run("mkdir -p w/old")
    stream = await node.watch_dir(sid, "w", recursive=True)
    assert stream.path == "/home/user/w"
    await run("echo 1 > w/old/f && mkdir -p w/new/inner && sleep 0.5 && echo 2 > w/new/inner/g")
    await run("chmod 600 w/old/f && mv w/old/f w/old/h && rm w/old/h")
    seen = await _changes(
        stream,
        {
            ("create", "old/f"), ("write", "old/f"), ("create", "new"),
            ("write", "new/inner/g"), ("chmod", "old/f"), ("rename", "old/f"),
            ("create", "old/h"), ("remove", "old/h"),
        },
    )  # fmt: skip
    assert next(e for e in seen if e.name == "new").is_dir
    await stream.aclose()
    await run("rm -rf w")


def test_stdin_a_pty_session_with_resize_and_ctrl_c_and_a_recursive_watch(
    node: NodeHarness, record_property: Callable[[str, object], None]
) -> None:
    sid = "it-interactive"
    node.run(node.node.create_sandbox(SandboxSpec(sid)))
    try:
        latencies = node.run(_stdin_in_pieces(node.node, sid))
        node.run(_pty_session(node.node, sid))
        started = time.monotonic()
        node.run(_recursive_watch(node.node, sid))
        record_property("recursive_watch_s", round(time.monotonic() - started, 2))
    finally:
        node.run(node.node.delete_sandbox(sid))
    median_ms = statistics.median(latencies) * 1000
    record_property("stdin_echo_p50_ms", round(median_ms, 1))
    print(f"\nstdin piece to its echo: p50 {median_ms:.1f} ms, max {max(latencies) * 1000:.1f} ms")
