"""``GET /v1/pools``: every node's warm pools through the REST API, over FakeNodes."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from space.control import NodeRegistry, background
from space.control.routers import pools as pools_route
from space.control.template_names import tenant_prefix
from space.node.api import NodeError, NodeInfo, PoolInfo, Unavailable, encode
from space.node.http.client import RemoteNode
from tests.unit.fakes import FakeNode, Harness, control_app

pytestmark = pytest.mark.anyio

_BASE = PoolInfo("base", size=2, target=3, min_size=1, max_size=8, hits=3, misses=1)
# Pools of the tenant "t"'s template py:v1 and of another tenant's: nodes name them scoped.
_PY = PoolInfo(
    f"{tenant_prefix('t')}py:v1", size=0, target=1, min_size=0, max_size=2, hits=0, misses=0
)
_THEIRS = replace(_PY, template=f"{tenant_prefix('other')}py:v1")


class _SilentNode(FakeNode):
    """A FakeNode whose ``info`` raises ``error``, or never answers when it is None."""

    def __init__(self, node_id: str, error: NodeError | None) -> None:
        super().__init__(node_id)
        self.error = error
        self.asked = 0

    async def info(self) -> NodeInfo:
        self.asked += 1
        if self.error is not None:
            raise self.error
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def _registry(**nodes: Any) -> NodeRegistry:
    registry = NodeRegistry()
    for node_id, node in nodes.items():
        registry.register(node_id, node)
    return registry


async def _pools(h: Harness, tenant: str = "t") -> list[dict[str, Any]]:
    response = await h.client.get("/v1/pools", headers=h.key(tenant))
    assert response.status_code == 200, response.text
    assert set(response.json()) == {"pools"}
    pools: list[dict[str, Any]] = response.json()["pools"]
    return pools


async def test_every_nodes_pools_of_base_and_the_tenants_templates_are_listed_in_its_names(
    tmp_path: Path,
) -> None:
    first, second = FakeNode("n1"), FakeNode("n2")
    first.pools, second.pools = [_PY, _THEIRS, _BASE], [_BASE]
    async with control_app(tmp_path, first, registry=_registry(n2=second, n1=first)) as h:
        listed = await _pools(h)
    base = {"template": "base", "size": 2, "target": 3, "min_size": 1, "max_size": 8}
    assert listed == [
        {"node_id": "n1", **base, "hits": 3, "misses": 1, "hit_rate": 0.75},
        {"node_id": "n1", "template": "py:v1", "size": 0, "target": 1, "min_size": 0,
         "max_size": 2, "hits": 0, "misses": 0, "hit_rate": None},
        {"node_id": "n2", **base, "hits": 3, "misses": 1, "hit_rate": 0.75},
    ]  # fmt: skip


async def test_a_node_without_pools_lists_none(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        assert await _pools(h) == []


async def test_any_tenant_reads_the_same_pools(tmp_path: Path) -> None:
    node = FakeNode()
    node.pools = [_BASE]
    async with control_app(tmp_path, node) as h:
        assert await _pools(h, "alice") == await _pools(h, "bob")
        assert [pool["template"] for pool in await _pools(h, "bob")] == ["base"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-wrong"}])
async def test_negative_pools_without_a_valid_api_key_are_401_and_ask_no_node(
    tmp_path: Path, headers: dict[str, str]
) -> None:
    node = _SilentNode("local", Unavailable("must not be asked"))
    async with control_app(tmp_path, node) as h:
        node.asked = 0  # its heartbeat at the start asked it
        response = await h.client.get("/v1/pools", headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "unauthenticated"
    assert node.asked == 0


async def test_negative_a_node_that_fails_is_skipped_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good, bad = FakeNode("n1"), _SilentNode("n2", Unavailable("node unreachable"))
    good.pools = [_BASE]
    caplog.set_level(logging.WARNING, logger=pools_route.__name__)
    async with control_app(tmp_path, good, registry=_registry(n1=good, n2=bad)) as h:
        bad.asked = 0  # its heartbeat at the start asked it
        listed = await _pools(h)
    assert [(pool["node_id"], pool["template"]) for pool in listed] == [("n1", "base")]
    assert bad.asked == 1
    assert "skipping node n2: node unreachable" in caplog.text


async def test_negative_a_node_slower_than_the_deadline_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(pools_route, "NODE_INFO_TIMEOUT_S", 0.05)
    monkeypatch.setattr(background, "INFO_TIMEOUT_S", 0.05)  # its heartbeat at the start
    good, hung = FakeNode("n1"), _SilentNode("n2", None)
    good.pools = [_BASE]
    caplog.set_level(logging.WARNING, logger=pools_route.__name__)
    async with control_app(tmp_path, good, registry=_registry(n1=good, n2=hung)) as h:
        listed = await _pools(h)
    assert [pool["node_id"] for pool in listed] == ["n1"]
    assert "skipping node n2: TimeoutError" in caplog.text


async def test_negative_a_remote_node_answering_a_malformed_pool_is_skipped(
    tmp_path: Path,
) -> None:
    good = FakeNode("n1")
    good.pools = [_BASE]
    body = encode(NodeInfo("n2", "tcg", ["base"], 0, [_BASE]))
    body["pools"][0]["hits"] = "many"
    transport = httpx.MockTransport(lambda _: httpx.Response(200, json=body))
    broken = RemoteNode("http://n2", "token", transport=transport)
    try:
        async with control_app(tmp_path, good, registry=_registry(n1=good, n2=broken)) as h:
            listed = await _pools(h)
    finally:
        await broken.aclose()
    assert [pool["node_id"] for pool in listed] == ["n1"]
