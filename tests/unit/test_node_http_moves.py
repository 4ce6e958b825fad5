"""Moves over the node API (issue 19): the export's routes, the stream that only its
ticket opens, and the framing the target checks before it accepts a byte."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator

import httpx
import pytest

from space.node.agent._moves import _Frames, frames_of
from space.node.api import (
    Conflict,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    SandboxSpec,
    Unavailable,
)
from space.node.http.client import RemoteNode
from space.node.http.server import create_node_app
from tests.unit._fake_moves import FAKE_STREAM
from tests.unit.fakes import FakeNode

pytestmark = pytest.mark.anyio
TOKEN = "node-secret"


@contextlib.asynccontextmanager
async def remote(node: FakeNode, token: str = TOKEN) -> AsyncIterator[RemoteNode]:
    transport = httpx.ASGITransport(app=create_node_app(node, TOKEN))
    client = RemoteNode("http://node", token, transport=transport)
    try:
        yield client
    finally:
        await client.aclose()


async def _node_with(sandbox_id: str) -> FakeNode:
    node = FakeNode()
    await node.create_sandbox(SandboxSpec(sandbox_id))
    return node


async def test_an_export_streams_to_its_ticket_and_finishes() -> None:
    node = await _node_with("sb-1")
    async with remote(node) as client:
        ticket = await client.export_sandbox("sb-1")
        assert ticket.parents == ["parent-uuid"] and ticket.ticket not in repr(ticket)
        with pytest.raises(Conflict):
            await client.export_sandbox("sb-1")
        # The target holds no node token of the source: only the ticket.
        async with remote(node, token="not-the-node-token") as target:
            chunks = [c async for c in target.stream_export("sb-1", ticket.ticket, "parent-uuid")]
        assert b"".join(chunks) == b"".join(FAKE_STREAM)
        await client.finish_export("sb-1", ticket.ticket, moved=True)
    assert node.finished == [("sb-1", True)]


async def test_negative_the_stream_opens_to_no_other_credential() -> None:
    node = await _node_with("sb-1")
    async with remote(node) as client:
        ticket = await client.export_sandbox("sb-1")
        for wrong in ("guess", TOKEN):  # not even the node token
            with pytest.raises(PermissionDenied):
                _ = [c async for c in client.stream_export("sb-1", wrong, None)]
        with pytest.raises(InvalidArgument):
            _ = [c async for c in client.stream_export("sb-1", ticket.ticket, "other")]
        with pytest.raises(PermissionDenied):
            await client.finish_export("sb-1", "guess", moved=True)
    transport = httpx.ASGITransport(app=create_node_app(node, TOKEN))
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as raw:
        answer = await raw.get("/node/v1/exports/sb-1/stream")
        assert answer.status_code == 403
        # Every other route still needs the node token, the ticket opens none.
        answer = await raw.post(
            "/node/v1/sandboxes/sb-1/export",
            headers={"Authorization": f"Bearer {ticket.ticket}"},
        )
        assert answer.status_code == 401
    assert node.exports == {"sb-1": ticket.ticket}


async def test_negative_an_unknown_sandbox_has_no_export() -> None:
    async with remote(FakeNode()) as client:
        with pytest.raises(NotFound):
            await client.export_sandbox("nope")
        with pytest.raises(Unavailable):
            await client.import_sandbox(
                await (await _node_with("sb-2")).export_sandbox("sb-2"), "http://x"
            )


async def _chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def _framed(payload: list[bytes]) -> bytes:
    async def source() -> AsyncIterator[bytes]:
        for chunk in payload:
            yield chunk

    return b"".join([frame async for frame in frames_of(source())])


async def _unframed(wire: bytes, size: int = 7) -> tuple[bytes, _Frames]:
    frames = _Frames(_chunks(wire, size))
    return b"".join([data async for data in frames]), frames


async def test_the_frames_give_back_the_stream_and_its_trailer_whatever_the_cuts() -> None:
    payload = [b"btrfs-stream\0" + b"x" * 100, b"y" * 3000]
    wire = await _framed(payload)
    for size in (1, 5, 64, len(wire)):
        data, frames = await _unframed(wire, size)
        assert data == b"".join(payload)
        assert frames.trailer == (hashlib.sha256(data).hexdigest(), len(data))


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda w: w[:-1], id="trailer-cut"),
        pytest.param(lambda w: w[:-41], id="no-trailer"),
        pytest.param(lambda w: w + b"D", id="after-trailer"),
        pytest.param(lambda w: b"Z" + w[1:], id="not-a-frame"),
        pytest.param(lambda w: b"D\xff\xff\xff\xff" + w[5:], id="oversized-frame"),
    ],
)
async def test_negative_a_damaged_move_stream_is_refused(damage: object) -> None:
    wire = damage(await _framed([b"a" * 100, b"b" * 100]))  # type: ignore[operator]
    with pytest.raises(InvalidArgument):
        await _unframed(wire)
