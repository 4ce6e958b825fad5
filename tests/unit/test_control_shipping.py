"""Issue 19 on the control plane: a template is built on one node and shipped to the
others, in the background of the build and by the background round (a node that joins
later, a shipment that failed); creates find a node that has the template."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from space.control.background import background_round
from space.control.shipping import plan, ship_round
from space.control.template_names import node_name
from space.node.api import TemplateImport, TemplateInfo, TemplateTicket, Unavailable
from tests.unit.fakes import FakeClock, FakeNode, Harness
from tests.unit.test_control_nodes import _ctx, _heartbeat, _replica
from tests.unit.test_control_templates import archive, build, lines, spec

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("on_both_databases")]


class _ShippingNode(FakeNode):
    """A fake node that imports a template by taking its tags from the fake at the
    source URL, after reading the stream with the ticket (what a real target pulls as
    a btrfs stream); ``fail_imports`` imports fail first."""

    def __init__(self, node_id: str, fakes: dict[str, FakeNode]) -> None:
        super().__init__(node_id)
        self.fakes = fakes
        self.imports: list[str] = []
        self.fail_imports = 0

    async def import_template(self, ticket: TemplateTicket, source_url: str) -> TemplateImport:
        if self.fail_imports:
            self.fail_imports -= 1
            raise Unavailable("the source went away mid-stream")
        source = self.fakes[source_url.removeprefix("http://").partition(":")[0]]
        data = b"".join(
            [c async for c in source.stream_template(ticket.digest, ticket.ticket, None)]
        )
        wanted = (ticket.name, ticket.digest)
        infos = [i for i in source.templates.values() if (i.name, i.digest) == wanted]
        for info in infos:
            known = self.templates.get((info.name, info.tag))
            if known is None or known.created_at <= info.created_at:
                self.templates[(info.name, info.tag)] = info
        self.imports.append(ticket.digest)
        return TemplateImport(infos[0], len(data), None)


def _cluster(*node_ids: str) -> dict[str, FakeNode]:
    fakes: dict[str, FakeNode] = {}
    fakes.update({n: _ShippingNode(n, fakes) for n in node_ids})
    return fakes


async def _settled(h: Harness) -> None:
    """Until the shipments started after a build have run."""
    await asyncio.gather(*_ctx(h).tasks)


async def test_a_build_runs_on_one_node_and_ships_to_the_others_in_the_background(
    tmp_path: Path,
) -> None:
    fakes = _cluster("n1", "n2", "n3")
    async with _replica(tmp_path, fakes, FakeClock()) as h:
        for node_id in fakes:
            await _heartbeat(h, node_id)
        events = lines(await build(h, h.key("acme"), archive(spec("py", "v1"))))
        assert events[-1]["type"] == "template"
        digest = events[-1]["template"]["digest"]
        assert sum(len(fake.contexts) for fake in fakes.values()) == 1  # built once
        await _settled(h)
        name = node_name("acme", "py")
        for fake in fakes.values():
            assert fake.templates[(name, "v1")].digest == digest
        shipped = [f for f in fakes.values() if isinstance(f, _ShippingNode) and f.imports]
        assert len(shipped) == 2  # the two that did not build it


async def test_a_node_that_joins_later_gets_the_templates_at_the_next_round(
    tmp_path: Path,
) -> None:
    fakes = _cluster("n1", "n2")
    async with _replica(tmp_path, fakes, FakeClock()) as h:
        await _heartbeat(h, "n1")
        events = lines(await build(h, h.key("acme"), archive(spec("py", "v1"))))
        await _settled(h)
        await _heartbeat(h, "n2")
        assert (node_name("acme", "py"), "v1") not in fakes["n2"].templates
        await background_round(_ctx(h))
        got = fakes["n2"].templates[(node_name("acme", "py"), "v1")]
        assert got.digest == events[-1]["template"]["digest"]
        await background_round(_ctx(h))  # nothing more to do: nothing shipped twice
        assert isinstance(fakes["n2"], _ShippingNode) and len(fakes["n2"].imports) == 1


async def test_negative_a_failed_shipment_is_tried_again_next_round_and_loses_nothing(
    tmp_path: Path,
) -> None:
    fakes = _cluster("n1", "n2")
    async with _replica(tmp_path, fakes, FakeClock()) as h:
        await _heartbeat(h, "n1")
        lines(await build(h, h.key("acme"), archive(spec("py", "v1"))))
        n2 = fakes["n2"]
        assert isinstance(n2, _ShippingNode)
        n2.fail_imports = 1
        await _heartbeat(h, "n2")
        await background_round(_ctx(h))
        key = (node_name("acme", "py"), "v1")
        assert key not in n2.templates and key in fakes["n1"].templates
        await background_round(_ctx(h))
        assert n2.templates[key] == fakes["n1"].templates[key]


async def test_a_round_starts_no_shipment_past_its_budget(tmp_path: Path) -> None:
    fakes = _cluster("n1", "n2")
    async with _replica(tmp_path, fakes, FakeClock()) as h:
        await _heartbeat(h, "n1")
        for name in ("py", "app"):
            lines(await build(h, h.key("acme"), archive(spec(name, "v1"))))
        await _settled(h)
        await _heartbeat(h, "n2")
        assert len(await ship_round(_ctx(h), budget_s=0.0)) == 1  # the first one starts
        assert len(await ship_round(_ctx(h))) == 1  # the rest, next round
        assert len(await ship_round(_ctx(h))) == 0


async def test_a_create_placed_on_a_node_without_the_template_goes_to_one_with_it(
    tmp_path: Path,
) -> None:
    fakes = {"n1": FakeNode("n1"), "n2": FakeNode("n2")}  # these import nothing
    async with _replica(tmp_path, fakes, FakeClock()) as h:
        await _heartbeat(h, "n1")
        await _heartbeat(h, "n2")
        lines(await build(h, h.key("acme"), archive(spec("py", "v1"))))
        builder = next(n for n, fake in fakes.items() if fake.contexts)
        other = "n2" if builder == "n1" else "n1"
        # The builder reports itself full now: placement tries the other node first,
        # which refuses for want of the template (not shipped there yet).
        await _heartbeat(h, builder, room=0)
        body = {"template": "py:v1"}
        made = await h.client.post("/v1/sandboxes", json=body, headers=h.key("acme"))
        assert made.status_code == 201, made.text
        assert made.json()["node_id"] == builder
        assert not fakes[other].boxes


def _info(name: str, tag: str, digest: str, created_at: float) -> TemplateInfo:
    return TemplateInfo(name, tag, digest, created_at, "debian:bookworm", 1, 256, 2048)


def test_the_plan_ships_the_newest_build_of_each_tag_oldest_build_first() -> None:
    base = _info("base", "latest", "b" * 64, 1.0)
    old, new, other = (
        _info("t.py", "v1", "1" * 64, 10.0),
        _info("t.py", "v1", "2" * 64, 20.0),
        (_info("t.app", "latest", "3" * 64, 15.0)),
    )
    holdings = {
        "n1": [base, new],
        "n2": [base, old, other],
        "n3": [base],
    }
    assert plan(holdings) == [
        (f"t.app@{'3' * 64}", "n2", "n1"),
        (f"t.app@{'3' * 64}", "n2", "n3"),
        (f"t.py@{'2' * 64}", "n1", "n2"),  # its v1 is older: it moves forward
        (f"t.py@{'2' * 64}", "n1", "n3"),
    ]
    settled = {n: [base, new, other] for n in holdings}
    assert plan(settled) == []  # base is every node's own: never shipped
    retagged = dataclasses.replace(new, tag="latest")
    assert plan({"n1": [new, retagged], "n2": [new]}) == [(f"t.py@{'2' * 64}", "n1", "n2")]
    # From the holder whose tags for the build are all it is the newest of.
    assert plan({"n0": [new], "n1": [new, retagged], "n2": []}) == [
        (f"t.py@{'2' * 64}", "n1", "n0"),
        (f"t.py@{'2' * 64}", "n1", "n2"),
    ]
