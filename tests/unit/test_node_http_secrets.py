"""Secret grants over the node's HTTP API: RemoteNode ↔ create_node_app ↔ FakeNode."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from space.node.api import (
    InvalidArgument,
    NotFound,
    SandboxSpec,
    SecretGrant,
    decode_grants,
    encode_grants,
)
from space.node.http.server import create_node_app
from tests.unit.fakes import FakeNode
from tests.unit.test_remote_node import TOKEN, remote

pytestmark = pytest.mark.anyio

VALUE = "ghp_Z9y8X7w6-never-logged"
PLACEHOLDER = "space_ph_" + "ab" * 16
GRANTS = [
    SecretGrant("GH", VALUE, PLACEHOLDER, ("api.github.com", "*.github.com"), "GH_TOKEN"),
    SecretGrant("API", VALUE + "2", "space_ph_" + "cd" * 16, ("a.example",), None, "header",
                "Authorization", "Bearer {value}"),
]  # fmt: skip


def test_grants_round_trip_through_their_wire_shape_field_for_field() -> None:
    assert decode_grants(encode_grants(GRANTS)) == GRANTS
    assert decode_grants({"grants": []}) == []


async def test_set_secrets_reaches_the_node_and_replaces_the_grants(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    node = FakeNode()
    async with remote(node) as client:
        await client.create_sandbox(SandboxSpec("sb-1"))
        await client.set_secrets("sb-1", GRANTS)
        assert node.grants["sb-1"] == GRANTS
        await client.set_secrets("sb-1", [])
        assert node.grants["sb-1"] == []
    assert VALUE not in caplog.text
    assert all(VALUE not in str(record.args) for record in caplog.records)


async def test_negative_the_nodes_refusal_names_the_grant_but_never_its_value() -> None:
    node = FakeNode()
    bad = SecretGrant("GH", VALUE + "\r\nX: 1", PLACEHOLDER, ("api.github.com",))
    async with remote(node) as client:
        await client.create_sandbox(SandboxSpec("sb-1"))
        with pytest.raises(InvalidArgument) as caught:
            await client.set_secrets("sb-1", [bad])
        with pytest.raises(NotFound):
            await client.set_secrets("sb-404", GRANTS)
    assert "secret 'GH': value holds a control character" in str(caught.value)
    assert VALUE not in str(caught.value) and "sb-1" not in node.grants


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], 'secrets body must be {"grants": [...]}'),
        ({"grants": [VALUE]}, "grants[0] must be an object"),
        ({"grants": [{"name": "A", "value": VALUE, "placeholder": PLACEHOLDER, "x": 1}]},
         "grants[0] must be an object with keys"),
        ({"grants": [{"name": "A", "value": 7, "placeholder": PLACEHOLDER, "hosts": []}]},
         "grants[0].value must be a string"),
        ({"grants": [{"name": "A", "value": VALUE, "placeholder": PLACEHOLDER,
                      "hosts": "a.org"}]}, "grants[0].hosts must be a list of strings"),
        ({"grants": [{"name": "A", "value": VALUE, "placeholder": PLACEHOLDER,
                      "hosts": ["a.org"], "injection": "cookie"}]}, "grants[0].injection"),
        ({"grants": [{"name": "A", "value": VALUE, "placeholder": PLACEHOLDER,
                      "hosts": ["a.org"], "env": 3}]}, "grants[0].env must be a string or null"),
    ],
)  # fmt: skip
async def test_negative_a_malformed_body_is_422_without_quoting_the_value(
    body: Any, message: str
) -> None:
    node = FakeNode()
    await node.create_sandbox(SandboxSpec("sb-1"))
    transport = httpx.ASGITransport(app=create_node_app(node, TOKEN))
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://node/node/v1") as http:
        answer = await http.put("/sandboxes/sb-1/secrets", json=body, headers=headers)
    assert answer.status_code == 422, answer.text
    assert message in answer.json()["error"]["message"] and VALUE not in answer.text
    assert "sb-1" not in node.grants


async def test_negative_set_secrets_needs_the_node_token() -> None:
    node = FakeNode()
    await node.create_sandbox(SandboxSpec("sb-1"))
    transport = httpx.ASGITransport(app=create_node_app(node, TOKEN))
    async with httpx.AsyncClient(transport=transport, base_url="http://node/node/v1") as http:
        answer = await http.put("/sandboxes/sb-1/secrets", json=encode_grants(GRANTS))
    assert answer.status_code == 401 and "sb-1" not in node.grants
