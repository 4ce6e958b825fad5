"""The one error installer both HTTP APIs use (space.node.api.http_errors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from space.control import ControlSettings, NodeRegistry, create_app
from space.control.errors import ApiError
from space.node.api import NodeError, NotFound, Unavailable
from space.node.api.http_errors import install_error_handlers
from space.node.http.server import create_node_app

pytestmark = pytest.mark.anyio


class _Body(BaseModel):
    count: int


def _app(*, handlers_parse_bodies: bool = False) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app, ApiError, handlers_parse_bodies=handlers_parse_bodies)

    @app.get("/node-error")
    async def node_error() -> None:
        raise NotFound("no sandbox 'sb-1'", sandbox_id="sb-1")

    @app.get("/api-error")
    async def api_error() -> None:
        raise ApiError("conflict", "it is paused", state="paused")

    @app.get("/retry/{seconds}")
    async def retry(seconds: str) -> None:
        hint: object = {"5": 5, "0": 0, "true": True, "text": "soon"}[seconds]
        raise ApiError("capacity", "no room", retry_after_s=hint)

    @app.post("/typed")
    async def typed(body: _Body) -> int:
        return body.count

    @app.post("/parsed")
    async def parsed() -> None:
        _Body.model_validate({"count": "many"}, strict=True)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret detail")

    return app


async def _call(app: FastAPI, method: str, path: str, **kw: Any) -> tuple[int, dict[str, Any]]:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        answer = await client.request(method, path, **kw)
    return answer.status_code, answer.json()["error"]


async def test_coded_errors_answer_their_code_status_message_and_details() -> None:
    assert await _call(_app(), "GET", "/node-error") == (
        404,
        {"code": "not_found", "message": "no sandbox 'sb-1'", "details": {"sandbox_id": "sb-1"}},
    )
    assert await _call(_app(), "GET", "/api-error") == (
        409,
        {"code": "conflict", "message": "it is paused", "details": {"state": "paused"}},
    )


@pytest.mark.parametrize(
    ("hint", "header"), [("5", "5"), ("0", None), ("true", None), ("text", None)]
)
async def test_a_retry_hint_in_the_details_answers_a_retry_after_header_if_it_is_seconds(
    hint: str, header: str | None
) -> None:
    transport = httpx.ASGITransport(app=_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        answer = await client.get(f"/retry/{hint}")
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "capacity"
    assert answer.headers.get("Retry-After") == header


async def test_negative_a_malformed_body_answers_422_naming_the_field() -> None:
    status, error = await _call(_app(), "POST", "/typed", json={"count": "x"})
    assert status == 422 and error["code"] == "invalid_argument"
    assert [e["field"] for e in error["details"]["errors"]] == ["count"]


async def test_a_body_parsed_by_the_handler_is_the_requests_fault_only_where_handlers_parse() -> (
    None
):
    status, error = await _call(_app(handlers_parse_bodies=True), "POST", "/parsed")
    assert (status, error["code"]) == (422, "invalid_argument")
    status, error = await _call(_app(), "POST", "/parsed")
    assert (status, error["code"]) == (500, "internal")


async def test_negative_unknown_routes_and_crashes_keep_status_and_hide_the_text() -> None:
    assert (await _call(_app(), "GET", "/nowhere"))[0] == 404
    status, error = await _call(_app(), "GET", "/boom")
    assert (status, error["code"]) == (500, "internal") and "secret" not in error["message"]


async def test_both_apps_answer_a_node_error_in_the_same_shape(tmp_path: Path) -> None:
    class Down:
        async def get_sandbox(self, sandbox_id: str) -> None:
            raise Unavailable("the VM is down", sandbox_id=sandbox_id)

    node_app = create_node_app(Down(), "token")  # type: ignore[arg-type]
    status, error = await _call(
        node_app, "GET", "/node/v1/sandboxes/sb-1", headers={"Authorization": "Bearer token"}
    )
    assert (status, error) == (
        503,
        {"code": "unavailable", "message": "the VM is down", "details": {"sandbox_id": "sb-1"}},
    )
    control = create_app(ControlSettings(data_dir=tmp_path), NodeRegistry())
    for kind in (RequestValidationError, StarletteHTTPException, Exception):
        assert control.exception_handlers[kind] is node_app.exception_handlers[kind], kind
    # The control plane's NodeError handler is the same answer, its text without
    # node-internal names (space.control.node_text; tests/unit/test_internal_names.py).
    assert control.exception_handlers[NodeError] is not node_app.exception_handlers[NodeError]
