"""Template shipping over the node API (issue 19): the routes, the stream that only its
ticket opens, and the checks a target makes of a ticket before a byte moves."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import httpx
import pytest

from space.node.agent._catalog import Build, Catalog, _Record
from space.node.agent._registry import Registry
from space.node.agent._shipping import Shipping, TemplateSource
from space.node.agent._templates import Templates
from space.node.api import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    TemplateTicket,
    Unavailable,
)
from space.node.core.template import READY_SHAPE, Shape, Template
from space.node.http.client import RemoteNode
from space.node.http.server import create_node_app
from space.node.storage.btrfs import BtrfsPool
from tests.unit.fakes import FakeNode
from tests.unit.test_control_templates import archive, spec

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


async def _node_with_template() -> tuple[FakeNode, str]:
    node = FakeNode()

    async def context() -> AsyncIterator[bytes]:
        yield archive(spec("py", "v1"))

    stream = await node.build_template(context())
    _ = [event async for event in stream]
    return node, node.templates[("py", "v1")].digest


async def test_a_template_streams_to_its_ticket_alone() -> None:
    node, digest = await _node_with_template()
    async with remote(node) as client:
        ticket = await client.export_template(f"py@{digest}")
        assert (ticket.name, ticket.digest, ticket.tags) == ("py", digest, ["v1"])
        assert ticket.ticket not in repr(ticket)
        # The target holds no node token of the source: only the ticket.
        async with remote(node, token="not-the-node-token") as target:
            chunks = [c async for c in target.stream_template(digest, ticket.ticket, None)]
        assert b"".join(chunks) == b"a template's stream"
        with pytest.raises(Unavailable):  # the fake imports nothing; the route answers
            await client.import_template(ticket, "http://source:1")


async def test_negative_a_template_stream_opens_to_no_other_credential() -> None:
    node, digest = await _node_with_template()
    async with remote(node) as client:
        ticket = await client.export_template(f"py@{digest}")
        for wrong in ("guess", TOKEN):  # not even the node token
            with pytest.raises(PermissionDenied):
                _ = [c async for c in client.stream_template(digest, wrong, None)]
        with pytest.raises(PermissionDenied):  # the ticket is for one build
            _ = [c async for c in client.stream_template("0" * 64, ticket.ticket, None)]
        with pytest.raises(NotFound):
            await client.export_template("nope:v1")
        with pytest.raises(InvalidArgument):
            await client.export_template("../etc")  # refused before anything is sent
    transport = httpx.ASGITransport(app=create_node_app(node, TOKEN))
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as raw:
        answer = await raw.get(f"/node/v1/template-exports/{digest}/stream")
        assert answer.status_code == 403
        # Every other route still needs the node token; the ticket opens none.
        answer = await raw.post(
            f"/node/v1/templates/py@{digest}/export",
            headers={"Authorization": f"Bearer {ticket.ticket}"},
        )
        assert answer.status_code == 401
        answer = await raw.post(
            "/node/v1/templates/imports",
            json={"ticket": {"name": "py"}, "source_url": "http://source:1"},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert answer.status_code in (400, 422)


_DIGEST = "a" * 64


def _record(**changes: object) -> dict[str, object]:
    build = Build(_DIGEST, "debian:bookworm", 5.0, READY_SHAPE, {"A": "b"}, "/opt", None)
    return {**dataclasses.asdict(build), **changes}


def _ticket(**changes: object) -> TemplateTicket:
    ticket = TemplateTicket(
        name="t.py",
        digest=_DIGEST,
        tags=["v1"],
        ticket="t",
        expires_at=2.0,
        record=_record(),
        parents=[],
        key_id="our-key",
        max_stream_bytes=1 << 30,
    )
    return dataclasses.replace(ticket, **changes)  # type: ignore[arg-type]


def _shipping() -> Shipping:
    def no_source(url: str, ticket: str) -> TemplateSource:
        raise AssertionError("a refused import reaches no source")

    return Shipping(cast(Registry, None), cast(Templates, None), no_source, "our-key")


_SOURCE = "http://source:1"


@pytest.mark.parametrize(
    ("changes", "source_url", "match"),
    [
        pytest.param({"key_id": "their-key"}, _SOURCE, "another node key", id="key"),
        pytest.param({}, "file:///etc/passwd", "source URL", id="url"),
        pytest.param({"name": "base"}, _SOURCE, "every node's own", id="base"),
        pytest.param({"name": "../x"}, _SOURCE, "the name", id="name"),
        pytest.param({"digest": "zz"}, _SOURCE, "the digest", id="digest"),
        pytest.param({"tags": []}, _SOURCE, "tags", id="no-tags"),
        pytest.param({"tags": ["a/b"]}, _SOURCE, "the tag", id="bad-tag"),
        pytest.param({"max_stream_bytes": 0}, _SOURCE, "bounds", id="bound"),
        pytest.param({"record": _record(digest="b" * 64)}, _SOURCE, "record", id="other-build"),
        pytest.param({"record": _record(extra=1)}, _SOURCE, "record", id="extra-key"),
        pytest.param({"record": [1]}, _SOURCE, "record", id="not-an-object"),
        pytest.param(
            {"record": _record(shape={"cpus": 999, "memory_mib": 256, "disk_mib": 2048})},
            _SOURCE,
            "cpus",
            id="cpus",
        ),
        pytest.param(
            {"record": _record(shape={"cpus": "1", "memory_mib": 256, "disk_mib": 2048})},
            _SOURCE,
            "not a number",
            id="shape-type",
        ),
        pytest.param({"record": _record(env={"A": 1})}, _SOURCE, "texts", id="env"),
        pytest.param({"record": _record(start="x\0y")}, _SOURCE, "texts", id="nul"),
        pytest.param(
            {"record": _record(created_at=float("nan"))}, _SOURCE, "created_at", id="time"
        ),
    ],
)
async def test_negative_a_template_import_is_refused_before_a_byte_moves(
    changes: dict[str, object], source_url: str, match: str
) -> None:
    with pytest.raises(InvalidArgument, match=match):
        await _shipping().import_(_ticket(**changes), source_url)


def test_a_received_build_takes_only_the_tags_whose_build_is_not_newer(tmp_path: Path) -> None:
    catalog = Catalog(cast(Template, None), cast(BtrfsPool, None), tmp_path)
    shape = Shape(1, 256, 2048)
    older = Build("1" * 64, "debian:bookworm", 10.0, shape)
    newer = Build("2" * 64, "debian:bookworm", 20.0, shape)
    catalog._records["py"] = _Record(
        "py", {"v1": older.digest, "latest": newer.digest}, {b.digest: b for b in (older, newer)}
    )
    middle = Build("3" * 64, "debian:bookworm", 15.0, shape)
    assert catalog.newer_tags("py", ["v1", "latest", "v2"], middle) == ["v1", "v2"]
    assert catalog.newer_tags("other", ["v1"], middle) == ["v1"]
