"""Moves over the node API (issue 19): the export's routes, the stream that only its
ticket opens, the framing the target checks before it accepts a byte, and the target's
admission of what it imports."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import httpx
import pytest

from space.node.agent._admission import Admission
from space.node.agent._moves import Moves, Source, _Frames, frames_of, portable_record
from space.node.agent._registry import Registry
from space.node.api import (
    Conflict,
    ExportTicket,
    InsufficientCapacity,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    SandboxSpec,
    SandboxState,
    Unavailable,
)
from space.node.core.capacity import Host, Policy, Resident, volume_limit_mib
from space.node.core.config import NodeConfig
from space.node.core.state import SandboxRecord
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


def _portable_of(**spec_changes: object) -> dict[str, object]:
    spec = dataclasses.replace(SandboxSpec("sb-9"), **spec_changes)  # type: ignore[arg-type]
    record = SandboxRecord(
        spec=spec,
        state=SandboxState.HIBERNATED,
        created_at=1.0,
        template_digest="abc",
        run_dir="/elsewhere/sb-9",
    )
    return portable_record(record)


def _ticket(**changes: object) -> ExportTicket:
    ticket = ExportTicket(
        sandbox_id="sb-9",
        ticket="t",
        expires_at=2.0,
        record=_portable_of(),
        parents=[],
        key_id="our-key",
        max_stream_bytes=1 << 30,
    )
    return dataclasses.replace(ticket, **changes)  # type: ignore[arg-type]


def _moves() -> Moves:
    def no_source(url: str, ticket: str) -> Source:
        raise AssertionError("a refused import reaches no source")

    return Moves(cast(Registry, None), no_source, "our-key")


@pytest.mark.parametrize(
    ("changes", "source_url", "match"),
    [
        pytest.param({"key_id": "their-key"}, "http://source:1", "another node key", id="key"),
        pytest.param({}, "file:///etc/passwd", "source URL", id="url"),
        pytest.param({"sandbox_id": "sb-other"}, "http://source:1", "record", id="id"),
        pytest.param({"record": {"spec": 1}}, "http://source:1", "malformed", id="record"),
        pytest.param({"max_stream_bytes": 0}, "http://source:1", "max_stream", id="bound"),
        pytest.param(
            {"record": {**_portable_of(cpus=999)}}, "http://source:1", "cpus", id="resources"
        ),
    ],
)
async def test_negative_an_import_is_refused_before_a_byte_moves(
    changes: dict[str, object], source_url: str, match: str
) -> None:
    with pytest.raises(InvalidArgument, match=match):
        await _moves().import_(_ticket(**changes), source_url)


# admission: a target without room refuses the import before it asks the source


class _Pulled(Exception):
    """The import reached the source: admission let it through."""


class _Pool:
    def __init__(self, root: Path) -> None:
        self.root = root

    async def delete_staged(self, path: Path) -> None:
        raise AssertionError(f"nothing was staged, yet {path} is deleted")


class _Registry:
    """What ``Moves.import_`` asks of the registry before its stream: the node's config,
    sandboxes, locks, pool and admission (a real one, over figures)."""

    def __init__(self, root: Path, policy: Policy, host: Host, residents: int) -> None:
        self.config = NodeConfig(data_dir=root)
        self.guest_types = ["qemu"]  # a node without runsc
        self.run_root = root / "run"
        self.pool = _Pool(root)
        self.sandboxes: dict[str, object] = {}
        here = {f"sb-h{i}": Resident(SandboxState.HIBERNATED, 256) for i in range(residents)}
        self.admission = Admission(policy, residents=lambda: here, measure=lambda: host)
        self._lock = asyncio.Lock()

    def lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._lock


_ROOMY = Host(memory_total_mib=24576, memory_available_mib=20000, pool_total_mib=20480,
              pool_free_mib=19000)  # fmt: skip
#: The volume's room an import of a default 256 MiB / 1 GiB sandbox asks of the pool.
_VOLUME_MIB = volume_limit_mib(1024, 256)


@dataclasses.dataclass
class _Target:
    moves: Moves
    admission: Admission
    #: The source URLs the target asked for a stream.
    pulls: list[str]


def _importing(tmp_path: Path, policy: Policy, host: Host, residents: int = 0) -> _Target:
    (tmp_path / "templates").mkdir(exist_ok=True)
    pulls: list[str] = []

    def source(url: str, ticket: str) -> Source:
        pulls.append(url)
        raise _Pulled(url)

    registry = _Registry(tmp_path, policy, host, residents)
    moves = Moves(cast(Registry, registry), source, "our-key")
    return _Target(moves, registry.admission, pulls)


def _sized(memory_mib: int = 256, disk_mib: int = 1024) -> ExportTicket:
    return _ticket(record=_portable_of(memory_mib=memory_mib, disk_mib=disk_mib))


@pytest.mark.parametrize(
    ("policy", "host", "residents", "resource"),
    [
        pytest.param(Policy(max_sandboxes=3), _ROOMY, 3, "sandboxes", id="cap"),
        pytest.param(
            Policy(pool_reserve_mib=1024),
            dataclasses.replace(_ROOMY, pool_free_mib=1024 + _VOLUME_MIB - 1),
            0,
            "pool",
            id="pool",
        ),
        pytest.param(
            Policy(memory_reserve_mib=2048),
            dataclasses.replace(_ROOMY, memory_available_mib=2048 + 96 + 256 // 4 - 1),
            0,
            "memory",
            id="memory",
        ),
    ],
)
async def test_negative_a_target_without_room_refuses_an_import_before_a_byte_moves(
    tmp_path: Path, policy: Policy, host: Host, residents: int, resource: str
) -> None:
    target = _importing(tmp_path, policy, host, residents)
    with pytest.raises(InsufficientCapacity) as refused:
        await target.moves.import_(_sized(), "http://source:1")
    assert refused.value.resource == resource and refused.value.sandbox_id == "sb-9"
    assert refused.value.needed == refused.value.available + 1  # short by exactly one
    assert target.pulls == [] and not (tmp_path / "incoming").exists()
    assert target.admission.info().starting == 0  # nothing held


@pytest.mark.parametrize(
    ("policy", "host", "residents"),
    [
        pytest.param(Policy(max_sandboxes=4), _ROOMY, 3, id="cap"),
        pytest.param(
            Policy(pool_reserve_mib=1024),
            dataclasses.replace(_ROOMY, pool_free_mib=1024 + _VOLUME_MIB),
            0,
            id="pool",
        ),
        pytest.param(
            Policy(memory_reserve_mib=2048),
            dataclasses.replace(_ROOMY, memory_available_mib=2048 + 96 + 256 // 4),
            0,
            id="memory",
        ),
    ],
)
async def test_a_target_with_room_just_enough_pulls_the_import(
    tmp_path: Path, policy: Policy, host: Host, residents: int
) -> None:
    target = _importing(tmp_path, policy, host, residents)
    with pytest.raises(_Pulled):
        await target.moves.import_(_sized(), "http://source:1")
    assert target.pulls == ["http://source:1"]
    assert list((tmp_path / "incoming").iterdir()) == []  # its staging was cleared
    assert target.admission.info().starting == 0  # released with the failure


async def test_negative_a_target_that_lacks_the_guest_type_refuses_before_a_byte_moves(
    tmp_path: Path,
) -> None:
    target = _importing(tmp_path, Policy(), _ROOMY)
    ticket = _ticket(record={**_portable_of(), "guest": "gvisor"})
    with pytest.raises(InvalidArgument, match="guest gvisor is not offered by this node"):
        await target.moves.import_(ticket, "http://source:1")
    assert target.pulls == [] and not (tmp_path / "incoming").exists()
    assert target.admission.info().starting == 0


async def test_negative_an_import_is_admitted_at_its_own_size(tmp_path: Path) -> None:
    # Room for a default sandbox's volume is not room for one with a 4 GiB disk.
    host = dataclasses.replace(_ROOMY, pool_free_mib=1024 + _VOLUME_MIB)
    with pytest.raises(InsufficientCapacity, match="pool"):
        await _importing(tmp_path, Policy(pool_reserve_mib=1024), host).moves.import_(
            _sized(disk_mib=4096), "http://source:1"
        )
