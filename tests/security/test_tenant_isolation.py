"""Hostile tenant: every sandbox- or snapshot-scoped endpoint, called with tenant B's key
on tenant A's sandbox or snapshot, answers 404 exactly like a missing id, and changes
nothing; so does naming A's snapshot in a body (restore, create from a snapshot).

The endpoints are taken from the app's OpenAPI document, so a new endpoint is covered the day it
is added (a route that forgets the tenant-scoped lookup fails here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.unit.fakes import Harness, control_app

pytestmark = pytest.mark.anyio

# Valid bodies and queries, so that only the tenant check can make a route answer 404.
_BODIES: dict[str, Any] = {
    "/exec": {"argv": ["echo", "hi"]},
    "/kill": {"signal": 9},
    "/mkdir": {"path": "/new"},
    "/rename": {"src": "/f", "dst": "/g"},
    "/snapshots": {"name": "taken"},
    "/fork": {"count": 2},
    "/timeouts": {"idle_timeout_s": 1, "max_lifetime_s": 1},
    # "/restore" gets the owner's own snapshot: see _request.
}
_QUERY = {"path": "/f", "mode": "644"}
_MISSING_SNAPSHOT = "sn-" + "0" * 24


def _routes(h: Harness, parameter: str) -> list[tuple[str, str]]:
    # The OpenAPI document lists every API route, however routers are nested.
    return [
        (method.upper(), path)
        for path, operations in h.app.openapi()["paths"].items()
        if parameter in path
        for method in sorted(operations)
    ]


def _sandbox_routes(h: Harness) -> list[tuple[str, str]]:
    routes = _routes(h, "{sandbox_id}")
    # sandboxes, lifecycle (pause, hibernate, resume, timeouts, restore, fork),
    # snapshots, exec, processes, files
    assert len(routes) >= 19, routes
    return routes


async def _request(
    h: Harness,
    method: str,
    template: str,
    sandbox_id: str,
    headers: dict[str, str],
    snapshot_id: str = _MISSING_SNAPSHOT,
) -> Any:
    url = template.replace("{sandbox_id}", sandbox_id).replace("{process_id}", "p1")
    body = next((b for suffix, b in _BODIES.items() if template.endswith(suffix)), None)
    if template.endswith("/restore"):
        body = {"snapshot_id": snapshot_id}
    kwargs: dict[str, Any] = {"params": _QUERY, "headers": headers}
    if method == "PUT" and body is not None:
        kwargs["json"] = body
    elif method == "PUT":
        kwargs["content"] = b"overwritten"
    elif method == "POST":
        kwargs["json"] = body or {}
    return await h.client.request(method, url, **kwargs)


def _not_found(answer: Any) -> str:
    """The message of a 404 in our error shape, or E2B's on its routes (space.control.e2b)."""
    body = answer.json()
    if "error" in body:
        assert body["error"]["code"] == "not_found", body
        return str(body["error"]["message"])
    assert body["code"] == 404, body
    return str(body["message"])


def _same_message(foreign: Any, missing: Any, foreign_id: str, missing_id: str) -> bool:
    """Indistinguishable answers, apart from the id itself."""
    ours = _not_found(foreign).replace(foreign_id, "ID")
    theirs = _not_found(missing).replace(missing_id, "ID")
    return bool(ours == theirs)


async def _state_of(h: Harness, sandbox_id: str, headers: dict[str, str]) -> object:
    sandbox = (await h.client.get(f"/v1/sandboxes/{sandbox_id}", headers=headers)).json()
    return sandbox, h.node.snapshot()


async def test_negative_another_tenants_sandbox_is_404_on_every_endpoint(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        owner, intruder = h.key("tenant-a"), h.key("tenant-b")
        sid = (await h.client.post("/v1/sandboxes", json={}, headers=owner)).json()["id"]
        url = f"/v1/sandboxes/{sid}"
        await h.client.put(f"{url}/files", params={"path": "/f"}, content=b"a", headers=owner)
        await h.client.post(f"{url}/exec", json={"argv": ["echo", "x"]}, headers=owner)
        taken = await h.client.post(f"{url}/snapshots", json={"name": "mine"}, headers=owner)
        snapshot_id = taken.json()["id"]
        before = await _state_of(h, sid, owner)
        calls = list(h.node.calls)
        for method, template in _sandbox_routes(h):
            foreign = await _request(h, method, template, sid, intruder, snapshot_id)
            missing = await _request(h, method, template, "sb-0000", intruder, snapshot_id)
            assert foreign.status_code == 404, (method, template, foreign.text)
            assert _same_message(foreign, missing, sid, "sb-0000")
        assert h.node.calls == calls
        assert await _state_of(h, sid, owner) == before


async def test_negative_another_tenants_sandboxes_are_not_listed(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        owner, intruder = h.key("tenant-a"), h.key("tenant-b")
        sid = (await h.client.post("/v1/sandboxes", json={}, headers=owner)).json()["id"]
        theirs = (await h.client.get("/v1/sandboxes", headers=intruder)).json()["sandboxes"]
        mine = (await h.client.get("/v1/sandboxes", headers=owner)).json()["sandboxes"]
        assert theirs == []
        assert [s["id"] for s in mine] == [sid]


async def _owner_snapshot(h: Harness, owner: dict[str, str]) -> tuple[str, str]:
    sid = (await h.client.post("/v1/sandboxes", json={}, headers=owner)).json()["id"]
    taken = await h.client.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "s"}, headers=owner)
    assert taken.status_code == 201, taken.text
    return sid, str(taken.json()["id"])


async def test_negative_another_tenants_snapshot_is_404_on_every_endpoint(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        owner, intruder = h.key("tenant-a"), h.key("tenant-b")
        sid, snapshot_id = await _owner_snapshot(h, owner)
        routes = _routes(h, "{snapshot_id}")
        assert {method for method, _ in routes} >= {"GET", "DELETE"}, routes
        before = await _state_of(h, sid, owner)
        calls = list(h.node.calls)
        for method, template in routes:
            foreign = await h.client.request(
                method, template.replace("{snapshot_id}", snapshot_id), headers=intruder
            )
            missing = await h.client.request(
                method, template.replace("{snapshot_id}", _MISSING_SNAPSHOT), headers=intruder
            )
            assert foreign.status_code == 404, (method, template, foreign.text)
            assert _same_message(foreign, missing, snapshot_id, _MISSING_SNAPSHOT)
        assert h.node.calls == calls
        assert await _state_of(h, sid, owner) == before
        mine = await h.client.get(f"/v1/snapshots/{snapshot_id}", headers=owner)
        assert mine.status_code == 200


async def test_negative_naming_another_tenants_snapshot_in_a_body_is_404(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        owner, intruder = h.key("tenant-a"), h.key("tenant-b")
        sid, snapshot_id = await _owner_snapshot(h, owner)
        theirs = (await h.client.post("/v1/sandboxes", json={}, headers=intruder)).json()["id"]
        before = await _state_of(h, sid, owner), await _state_of(h, theirs, intruder)
        calls = list(h.node.calls)
        for snapshot in (snapshot_id, _MISSING_SNAPSHOT):
            restore = await h.client.post(
                f"/v1/sandboxes/{theirs}/restore", json={"snapshot_id": snapshot}, headers=intruder
            )
            create = await h.client.post(
                "/v1/sandboxes", json={"from_snapshot": snapshot}, headers=intruder
            )
            for answer in (restore, create):
                assert answer.status_code == 404, answer.text
                message = answer.json()["error"]["message"]
                assert message.replace(snapshot, "ID") == "no snapshot 'ID'"
        assert h.node.calls == calls
        assert (await _state_of(h, sid, owner), await _state_of(h, theirs, intruder)) == before
        listed = await h.client.get("/v1/sandboxes", headers=intruder)
        assert [s["id"] for s in listed.json()["sandboxes"]] == [theirs]


async def test_negative_another_tenants_snapshots_are_not_listed(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        owner, intruder = h.key("tenant-a"), h.key("tenant-b")
        _, snapshot_id = await _owner_snapshot(h, owner)
        theirs = (await h.client.get("/v1/snapshots", headers=intruder)).json()["snapshots"]
        mine = (await h.client.get("/v1/snapshots", headers=owner)).json()["snapshots"]
        assert theirs == []
        assert [s["id"] for s in mine] == [snapshot_id]
