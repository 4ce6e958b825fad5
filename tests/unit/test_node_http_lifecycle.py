"""The node API's lifecycle routes refuse malformed bodies before reaching the node."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from space.node.api import MAX_FORK_CHILDREN
from space.node.http.server import create_node_app
from tests.unit.test_remote_node import TOKEN, LifecycleNode

pytestmark = pytest.mark.anyio

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def http() -> AsyncIterator[tuple[httpx.AsyncClient, LifecycleNode]]:
    node = LifecycleNode()
    transport = httpx.ASGITransport(app=create_node_app(node, TOKEN))
    async with httpx.AsyncClient(transport=transport, base_url="http://node/node/v1") as client:
        yield client, node


def _children(count: int) -> list[str]:
    return [f"sb-child-{n}" for n in range(count)]


_BAD_SNAPSHOT_BODIES: list[object] = [
    {},
    {"snapshot_id": 5},
    {"snapshot_id": ""},
    {"snapshot_id": None},
    {"snapshot_id": ["snap-1"]},
    ["snap-1"],
    "snap-1",
]


@pytest.mark.parametrize("route", ["snapshots", "restore"])
@pytest.mark.parametrize("body", _BAD_SNAPSHOT_BODIES)
async def test_negative_a_snapshot_id_that_is_not_a_string_is_refused(
    http: tuple[httpx.AsyncClient, LifecycleNode], route: str, body: object
) -> None:
    client, node = http
    response = await client.post(f"/sandboxes/sb-1/{route}", json=body, headers=AUTH)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "invalid_argument"
    assert node.recorded == []


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"child_ids": []},
        {"child_ids": _children(MAX_FORK_CHILDREN + 1)},
        {"child_ids": "sb-2"},
        {"child_ids": ["sb-2", 3]},
        {"child_ids": ["sb-2", ""]},
        {"child_ids": ["sb-2", "sb-2"]},
        {"child_ids": {"sb-2": True}},
        ["sb-2"],
    ],
)
async def test_negative_fork_refuses_child_ids_that_are_not_1_to_16_distinct_strings(
    http: tuple[httpx.AsyncClient, LifecycleNode], body: object
) -> None:
    client, node = http
    response = await client.post("/sandboxes/sb-1/fork", json=body, headers=AUTH)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "invalid_argument"
    assert node.recorded == []


async def test_fork_accepts_exactly_the_maximum_number_of_children(
    http: tuple[httpx.AsyncClient, LifecycleNode],
) -> None:
    client, node = http
    body = {"child_ids": _children(MAX_FORK_CHILDREN)}
    response = await client.post("/sandboxes/sb-1/fork", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    assert [s["sandbox_id"] for s in response.json()["sandboxes"]] == body["child_ids"]
    assert node.recorded == [("fork_sandbox", ("sb-1", body["child_ids"]))]


@pytest.mark.parametrize("route", ["snapshots", "restore", "fork"])
async def test_negative_a_body_that_is_not_json_is_refused(
    http: tuple[httpx.AsyncClient, LifecycleNode], route: str
) -> None:
    client, node = http
    response = await client.post(f"/sandboxes/sb-1/{route}", content=b"{", headers=AUTH)
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_argument"
    assert node.recorded == []


@pytest.mark.parametrize("from_snapshot", [5, ["snap-1"], {"id": "snap-1"}])
async def test_negative_create_refuses_a_from_snapshot_that_is_not_a_string(
    http: tuple[httpx.AsyncClient, LifecycleNode], from_snapshot: object
) -> None:
    client, node = http
    body = {"sandbox_id": "sb-1", "from_snapshot": from_snapshot}
    response = await client.post("/sandboxes", json=body, headers=AUTH)
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_argument"
    assert node.recorded == []


async def test_taking_a_snapshot_answers_201_and_deleting_one_204(
    http: tuple[httpx.AsyncClient, LifecycleNode],
) -> None:
    client, _ = http
    taken = await client.post(
        "/sandboxes/sb-1/snapshots", json={"snapshot_id": "snap-1"}, headers=AUTH
    )
    assert taken.status_code == 201 and taken.json()["snapshot_id"] == "snap-1"
    listed = await client.get("/snapshots", headers=AUTH)
    assert [s["snapshot_id"] for s in listed.json()["snapshots"]] == ["snap-1"]
    deleted = await client.delete("/snapshots/snap-1", headers=AUTH)
    assert (deleted.status_code, deleted.content) == (204, b"")


@pytest.mark.parametrize(
    ("method", "url"),
    [
        ("POST", "/sandboxes/sb-1/hibernate"),
        ("GET", "/snapshots"),
        ("GET", "/snapshots/snap-1"),
        ("DELETE", "/snapshots/snap-1"),
    ],
)
async def test_negative_lifecycle_routes_need_the_node_token(
    http: tuple[httpx.AsyncClient, LifecycleNode], method: str, url: str
) -> None:
    client, node = http
    response = await client.request(method, url, headers={"Authorization": "Bearer wrong"})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "unauthenticated"
    assert node.recorded == []
