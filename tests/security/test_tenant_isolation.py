"""Hostile tenant: every sandbox-scoped endpoint, called with tenant B's key on tenant
A's sandbox, answers 404 exactly like a missing id, and changes nothing.

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
}
_QUERY = {"path": "/f", "mode": "644"}


def _sandbox_routes(h: Harness) -> list[tuple[str, str]]:
    # The OpenAPI document lists every API route, however routers are nested.
    routes = [
        (method.upper(), path)
        for path, operations in h.app.openapi()["paths"].items()
        if "{sandbox_id}" in path
        for method in sorted(operations)
    ]
    assert len(routes) >= 13, routes  # sandboxes, exec, processes, files
    return routes


async def _request(
    h: Harness, method: str, template: str, sandbox_id: str, headers: dict[str, str]
) -> Any:
    url = template.replace("{sandbox_id}", sandbox_id).replace("{process_id}", "p1")
    body = next((b for suffix, b in _BODIES.items() if template.endswith(suffix)), None)
    kwargs: dict[str, Any] = {"params": _QUERY, "headers": headers}
    if method == "PUT":
        kwargs["content"] = b"overwritten"
    elif method == "POST":
        kwargs["json"] = body or {}
    return await h.client.request(method, url, **kwargs)


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
        before = await _state_of(h, sid, owner)
        calls = list(h.node.calls)
        for method, template in _sandbox_routes(h):
            foreign = await _request(h, method, template, sid, intruder)
            missing = await _request(h, method, template, "sb-0000", intruder)
            assert foreign.status_code == 404, (method, template, foreign.text)
            assert foreign.json()["error"]["code"] == "not_found"
            # Indistinguishable from a missing id, apart from the id itself.
            assert foreign.json()["error"]["message"].replace(sid, "ID") == missing.json()["error"][
                "message"
            ].replace("sb-0000", "ID")
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
