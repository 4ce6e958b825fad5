"""Hostile input at the REST API's edge costs nothing (issue 17): the key is checked
before a byte of the body is read, bodies are capped before they are read whole,
``env`` and ``metadata`` are bounded the same at create and at exec, and a refused
create leaves no row and names no node-internal template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from space.control.store.models import SandboxRow
from space.control.template_names import tenant_prefix
from space.limits import ENV, MAX_JSON_BODY_BYTES, METADATA
from space.node.api import ResourceExhausted, Unavailable
from tests.unit._raw_http import CHUNK_BYTES, StreamedBody
from tests.unit.fakes import Harness, control_app

pytestmark = pytest.mark.anyio


def _error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}
    error: dict[str, Any] = body["error"]
    return error


async def _rows(h: Harness) -> int:
    """Sandbox rows in the database, of any state (deleted ones too)."""
    count: int = await h.app.state.ctx.db.run(
        lambda s: s.execute(select(func.count()).select_from(SandboxRow)).scalar_one()
    )
    return count


@pytest.mark.parametrize("headers", [{}, {"X-API-Key": "sk_space_nope"}])
async def test_negative_a_huge_body_without_a_valid_key_is_refused_unread(
    tmp_path: Path, headers: dict[str, str]
) -> None:
    async with control_app(tmp_path) as h:
        body = StreamedBody(512 << 20, fill=b"{")  # not JSON either: the key decides first
        answer = await h.client.post("/v1/sandboxes", content=body, headers=headers)
        assert answer.status_code == 401 and _error(answer)["code"] == "unauthenticated"
        assert body.sent == 0
        assert answer.headers["connection"] == "close"


async def test_negative_a_huge_body_without_the_node_token_is_refused_unread(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        body = StreamedBody(64 << 20)
        answer = await h.client.post("/v1/nodes", content=body, headers=h.key("acme"))
        assert answer.status_code == 401 and body.sent == 0


async def test_negative_a_keyless_request_to_an_unknown_route_answers_401(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        answer = await h.client.get("/v1/nowhere")
        assert answer.status_code == 401


async def test_negative_a_declared_body_over_the_cap_is_413_unread(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        content = b" " * (MAX_JSON_BODY_BYTES + 1)
        answer = await h.client.post("/v1/sandboxes", content=content, headers=h.key("acme"))
        assert answer.status_code == 413
        error = _error(answer)
        assert error["code"] == "resource_exhausted"
        assert error["details"] == {
            "limit_bytes": MAX_JSON_BODY_BYTES,
            "observed_bytes": MAX_JSON_BODY_BYTES + 1,
        }
        assert await _rows(h) == 0


async def test_negative_a_streamed_body_over_the_cap_is_413_read_no_further(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        body = StreamedBody(64 << 20)  # chunked: no Content-Length to refuse by
        answer = await h.client.post("/v1/sandboxes", content=body, headers=h.key("acme"))
        assert answer.status_code == 413 and answer.headers["connection"] == "close"
        assert MAX_JSON_BODY_BYTES < body.sent <= MAX_JSON_BODY_BYTES + CHUNK_BYTES


async def test_a_json_body_of_exactly_the_cap_is_read(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        content = b"{}".ljust(MAX_JSON_BODY_BYTES, b" ")
        headers = {**h.key("acme"), "Content-Type": "application/json"}
        answer = await h.client.post("/v1/sandboxes", content=content, headers=headers)
        assert answer.status_code == 201, answer.text


async def test_a_file_upload_streams_past_the_json_cap(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        sid = (await h.client.post("/v1/sandboxes", json={}, headers=key)).json()["id"]
        body = StreamedBody(2 * MAX_JSON_BODY_BYTES, fill=b"x")
        answer = await h.client.put(
            f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/f"}, content=body, headers=key
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["size"] == 2 * MAX_JSON_BODY_BYTES


def _env_of_bytes(total: int) -> dict[str, str]:
    """An env of ``total`` bytes of names and values, no value over the limit."""
    env: dict[str, str] = {}
    left = total
    while left:
        name = f"V{len(env):04d}"
        value = "v" * min(ENV.value_bytes, left - len(name))
        env[name] = value
        left -= len(name) + len(value)
    return env


_BAD_ENVS = [
    pytest.param({"A\0B": "x"}, id="nul-in-name"),
    pytest.param({"A=B": "x"}, id="equals-in-name"),
    pytest.param({"": "x"}, id="empty-name"),
    pytest.param({"A": "x\0"}, id="nul-in-value"),
    pytest.param({"A": "v" * (ENV.value_bytes + 1)}, id="value-over-limit"),
    pytest.param({"N" * (ENV.key_bytes + 1): "x"}, id="name-over-limit"),
    pytest.param({f"V{i}": "" for i in range(ENV.entries + 1)}, id="too-many"),
    pytest.param(_env_of_bytes(ENV.total_bytes + 1), id="total-over-limit"),
]


@pytest.mark.parametrize("env", _BAD_ENVS)
async def test_negative_a_bad_env_is_refused_alike_at_create_and_at_exec(
    tmp_path: Path, env: dict[str, str]
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        created = await h.client.post("/v1/sandboxes", json={"env": env}, headers=key)
        assert created.status_code == 422 and await _rows(h) == 0
        sid = (await h.client.post("/v1/sandboxes", json={}, headers=key)).json()["id"]
        body = {"cmd": "true", "env": env}
        executed = await h.client.post(f"/v1/sandboxes/{sid}/exec", json=body, headers=key)
        assert executed.status_code == 422
        assert _error(executed)["message"] == _error(created)["message"]
        assert not [c for c in h.node.calls if c[0] == "exec"]


async def test_an_env_at_the_limits_is_accepted(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        env = _env_of_bytes(ENV.total_bytes)
        answer = await h.client.post("/v1/sandboxes", json={"env": env}, headers=h.key("acme"))
        assert answer.status_code == 201, answer.text
        assert answer.json()["env"] == env


async def test_negative_metadata_over_its_limits_is_refused(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        full = {f"k{i}": "" for i in range(METADATA.entries)}
        assert (
            await h.client.post("/v1/sandboxes", json={"metadata": full}, headers=key)
        ).is_success
        over = {**full, "one-more": ""}
        answer = await h.client.post("/v1/sandboxes", json={"metadata": over}, headers=key)
        assert answer.status_code == 422 and "metadata" in _error(answer)["message"]
        big = {"k": "v" * (METADATA.value_bytes + 1)}
        answer = await h.client.post("/v1/sandboxes", json={"metadata": big}, headers=key)
        assert answer.status_code == 422 and await _rows(h) == 1


async def test_negative_an_unknown_template_leaves_no_row_and_no_node_name(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        body = {"template": "no-such-template", "metadata": {"k": "v"}, "env": {"A": "b"}}
        answer = await h.client.post("/v1/sandboxes", json=body, headers=key)
        assert answer.status_code == 404
        error = _error(answer)
        assert "no-such-template" in error["message"]
        assert tenant_prefix("acme") not in answer.text and "sandbox_id" not in error["details"]
        assert await _rows(h) == 0
        assert (await h.client.get("/v1/sandboxes", headers=key)).json()["sandboxes"] == []


async def test_negative_a_node_refusal_leaves_no_row(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        h.node.fail_create = ResourceExhausted("too many sandboxes")
        answer = await h.client.post("/v1/sandboxes", json={}, headers=h.key("acme"))
        assert answer.status_code == 429 and "sandbox_id" not in _error(answer)["details"]
        assert await _rows(h) == 0


async def test_a_node_failure_keeps_the_row_in_error(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        h.node.fail_create = Unavailable("boot failed")
        answer = await h.client.post("/v1/sandboxes", json={}, headers=h.key("acme"))
        assert answer.status_code == 503 and _error(answer)["details"]["sandbox_id"]
        assert await _rows(h) == 1
