"""Templates built once and shipped to another node (issue 19), on two nodes of this host.

A template built on the source is pulled by the target over the source's node API;
the target's copy keeps the build's UUID as its received UUID, its sandboxes start with
the built file, and a sandbox made from it on the source moves to the target
incrementally against the shipped copy; a template built on the shipped one ships as
its difference.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from space.node.agent._shipping import TemplateSource
from space.node.agent._templates import Templates
from space.node.api import (
    ExecRequest,
    InvalidArgument,
    NotFound,
    SandboxSpec,
    SandboxState,
    TemplateTicket,
    Unavailable,
)
from space.node.storage.streams import is_read_only_subvolume, subvolume_ids

from .moves_nodes import TwoNodes, two_nodes
from .test_moves import _flip, _one, _read_all, _run
from .test_templates import _build, _built, _context

# Two node starts (each a base ready state), a build, a shipment and a move under TCG.
pytestmark = [pytest.mark.vm, pytest.mark.timeout(1200)]

_SPEC = textwrap.dedent("""\
    name = "shipped"
    tag = "v1"
    base = "debian:bookworm"
    start = "sh /opt/app/server.sh"

    [[steps]]
    copy = { src = "app", dst = "/opt/app" }

    [[steps]]
    run = '''echo built-on-the-source > /opt/built'''
    """)


def test_a_template_built_on_one_node_ships_and_its_sandboxes_then_move_incrementally(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    (tmp_path / "context").mkdir()
    with two_nodes(tmp_path / "nodes") as nodes:
        source, target = nodes.source, nodes.target
        info = _built(nodes.run(_build(source, _context(tmp_path / "context", _SPEC))))
        ticket = nodes.run(source.export_template("shipped:v1"))
        _refuses_a_damaged_stream(nodes, ticket)

        ready_s = _timing_adoption(target.templates)
        start = time.monotonic()
        shipped = nodes.run(target.import_template(ticket, nodes.source_url))
        ship_s = time.monotonic() - start
        record_property("ship_s", round(ship_s, 3))
        record_property("ready_s", round(ready_s[0], 3))
        record_property("ship_bytes", shipped.stream_bytes)
        print(
            f"\nshipped {shipped.stream_bytes} bytes in {ship_s:.2f} s, of which "
            f"{ready_s[0]:.2f} s making the ready state"
        )
        assert (shipped.template.name, shipped.template.tag) == ("shipped", "v1")
        assert shipped.template.digest == info.digest and shipped.template.ready
        assert shipped.parent is None  # built on base, which every node has of its own
        copy = target.pool.template("shipped", info.digest).path
        original = source.pool.template("shipped", info.digest).path
        assert is_read_only_subvolume(copy)
        assert subvolume_ids(copy).received_uuid == subvolume_ids(original).uuid
        again = nodes.run(target.import_template(ticket, nodes.source_url))
        assert again.stream_bytes == 0 and again.template.digest == info.digest

        nodes.run(target.create_sandbox(SandboxSpec("on-target", template="shipped:v1")))
        out, code = nodes.run(_run(target, "on-target", ExecRequest(argv=["cat", "/opt/built"])))
        assert (out, code) == ("built-on-the-source\n", 0)
        nodes.run(target.delete_sandbox("on-target"))

        sid = "mv-shipped"
        nodes.run(source.create_sandbox(SandboxSpec(sid, template="shipped:v1")))
        nodes.run(source.write_file(sid, "/home/user/moved.txt", _one(b"made on the source")))
        nodes.run(source.hibernate_sandbox(sid))
        offer = nodes.run(source.export_sandbox(sid))
        moved = nodes.run(target.import_sandbox(offer, nodes.source_url))
        nodes.run(source.finish_export(sid, offer.ticket, moved=True))
        record_property("move_bytes", moved.stream_bytes)
        print(f"then moved a sandbox of it: {moved.stream_bytes} bytes against {moved.parent}")
        assert moved.status.state == SandboxState.HIBERNATED
        assert moved.parent == subvolume_ids(original).uuid  # against the shipped copy
        reader = nodes.run(target.read_file(sid, "/home/user/moved.txt"))
        assert nodes.run(_read_all(reader)) == b"made on the source"
        nodes.run(target.delete_sandbox(sid))
        _ships_a_derived_template_as_its_difference(
            nodes, tmp_path, subvolume_ids(original).uuid, shipped.stream_bytes
        )
        for node in (source, target):
            nodes.run(node.delete_template("shipped:v1"))
            assert not list((node.pool.root / "incoming").glob("*"))


class _Damaged:
    """The source's API as the target sees it, one byte of the stream flipped."""

    def __init__(self, inner: TemplateSource) -> None:
        self._inner = inner

    async def stream_template(
        self, digest: str, ticket: str, parent: str | None
    ) -> AsyncIterator[bytes]:
        whole = [c async for c in self._inner.stream_template(digest, ticket, parent)]
        yield _flip(b"".join(whole))

    async def aclose(self) -> None:
        await self._inner.aclose()


def _refuses_a_damaged_stream(nodes: TwoNodes, ticket: TemplateTicket) -> None:
    """A stream damaged on the way is refused, and nothing of it is left on the target."""
    shipping = nodes.target.shipping
    real = shipping._remote
    shipping._remote = lambda url, token: _Damaged(real(url, token))
    try:
        # Refused by btrfs receive's own checksums or by ours.
        with pytest.raises((InvalidArgument, Unavailable)):
            nodes.run(nodes.target.import_template(ticket, nodes.source_url))
    finally:
        shipping._remote = real
    root = nodes.target.pool.root
    assert not (root / "templates" / "shipped").exists()
    assert not list((root / "incoming").glob("*"))
    with pytest.raises(NotFound):
        nodes.run(nodes.target.export_template("shipped:v1"))


def _timing_adoption(templates: Templates) -> list[float]:
    """How long each adoption of a received build (its ready state, its tags) takes."""
    adopt, took = templates.adopt, []

    async def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        try:
            return await adopt(*args, **kwargs)
        finally:
            took.append(time.monotonic() - start)

    templates.adopt = timed  # type: ignore[method-assign]
    return took


_DERIVED = textwrap.dedent("""\
    name = "derived"
    tag = "v1"
    base = "template:shipped:v1"

    [[steps]]
    run = '''echo derived-on-the-source > /opt/derived'''
    """)


def _ships_a_derived_template_as_its_difference(
    nodes: TwoNodes, tmp_path: Path, shipped_uuid: str, full_bytes: int
) -> None:
    """A template built on the shipped one ships incrementally against the target's
    copy of it, and its sandboxes there see both builds' files."""
    source, target = nodes.source, nodes.target
    (tmp_path / "derived").mkdir()
    _built(nodes.run(_build(source, _context(tmp_path / "derived", _DERIVED))))
    ticket = nodes.run(source.export_template("derived:v1"))
    assert ticket.parents[0] == shipped_uuid  # its base first
    result = nodes.run(target.import_template(ticket, nodes.source_url))
    print(f"then a template built on it: {result.stream_bytes} bytes against {result.parent}")
    assert result.parent == shipped_uuid and result.stream_bytes < full_bytes / 2
    nodes.run(target.create_sandbox(SandboxSpec("derived-sb", template="derived:v1")))
    argv = ["cat", "/opt/built", "/opt/derived"]
    out, code = nodes.run(_run(target, "derived-sb", ExecRequest(argv=argv)))
    assert (out, code) == ("built-on-the-source\nderived-on-the-source\n", 0)
    nodes.run(target.delete_sandbox("derived-sb"))
    for node in (source, target):
        nodes.run(node.delete_template("derived:v1"))
