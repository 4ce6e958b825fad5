"""Every documented error answer, and every transport failure, becomes one SpaceError leaf."""

from __future__ import annotations

import httpx
import pytest

from space.node.api import InsufficientCapacity as NodeCapacity
from space.sdk import AsyncSandbox
from space.sdk.errors import (
    AuthenticationError,
    Conflict,
    InsufficientCapacity,
    InternalError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SpaceError,
    Timeout,
    Unavailable,
)
from tests.unit._live_api import LiveApi

pytestmark = pytest.mark.anyio

#: A key for the tiny handlers below, which check none.
API_KEY = "sk-test"


# The table of docs/api.md, row by row.
DOCUMENTED = [
    (401, "unauthenticated", AuthenticationError),
    (403, "permission_denied", PermissionDenied),
    (404, "not_found", NotFound),
    (409, "conflict", Conflict),
    (422, "invalid_argument", InvalidArgument),
    (429, "resource_exhausted", ResourceExhausted),
    (503, "capacity", InsufficientCapacity),
    (503, "unavailable", Unavailable),
    (504, "timeout", Timeout),
    (500, "internal", InternalError),
]


@pytest.mark.parametrize(("status", "code", "expected"), DOCUMENTED)
async def test_negative_each_documented_error_answer_raises_its_leaf_with_context(
    status: int, code: str, expected: type[SpaceError]
) -> None:
    # The real API answers few of these on a list: a tiny handler answers each.
    body = {"error": {"code": code, "message": f"server says {code}", "details": {}}}
    transport = httpx.MockTransport(lambda _request: httpx.Response(status, json=body))
    with pytest.raises(expected) as caught:
        await AsyncSandbox.list(api_key=API_KEY, _transport=transport)
    error = caught.value
    assert type(error) is expected
    assert (error.status_code, error.code, error.message) == (status, code, f"server says {code}")
    assert error.operation == "sandbox.list"
    assert f"server says {code}" in str(error) and "status=" in str(error)


async def test_negative_a_create_no_node_has_room_for_raises_insufficient_capacity(
    api: LiveApi,
) -> None:
    api.node.fail_create = NodeCapacity(
        "node has no room", resource="committed_memory", needed=352, available=100
    )
    with pytest.raises(InsufficientCapacity, match="node has no room") as caught:
        await AsyncSandbox.create(**api.connection())
    error = caught.value
    assert isinstance(error, Unavailable)  # ``except Unavailable`` still catches it
    assert (error.status_code, error.code, error.operation) == (503, "capacity", "sandbox.create")
    assert (error.resource, error.retry_after_s) == ("committed_memory", 30)
    assert (error.details["needed"], error.details["available"]) == (352, 100)
    assert error.sandbox_id is None
    assert await AsyncSandbox.list(**api.connection()) == []


async def test_a_capacity_refusal_with_odd_details_has_no_hint_rather_than_a_wrong_one() -> None:
    body = {"error": {"code": "capacity", "message": "full", "details": {"retry_after_s": "x"}}}
    transport = httpx.MockTransport(lambda _request: httpx.Response(503, json=body))
    with pytest.raises(InsufficientCapacity) as caught:
        await AsyncSandbox.list(api_key=API_KEY, _transport=transport)
    assert (caught.value.resource, caught.value.retry_after_s) == (None, None)


async def test_negative_a_wrong_api_key_raises_authentication_error(api: LiveApi) -> None:
    with pytest.raises(AuthenticationError):
        await AsyncSandbox.list(api_key="wrong", _transport=api.transport())


@pytest.mark.parametrize(
    ("status", "expected"), [(502, Unavailable), (418, InternalError), (400, InvalidArgument)]
)
async def test_negative_an_error_without_a_json_body_maps_by_status(
    status: int, expected: type[SpaceError]
) -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(status, text="<html>oops"))
    with pytest.raises(expected, match="oops"):
        await AsyncSandbox.list(api_key=API_KEY, _transport=transport)


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        (httpx.ConnectError("connection refused"), Unavailable),
        (httpx.ReadError("connection reset"), Unavailable),
        (httpx.RemoteProtocolError("peer closed"), Unavailable),
        (httpx.ConnectTimeout("connect timed out"), Timeout),
        (httpx.ReadTimeout("read timed out"), Timeout),
    ],
)
async def test_negative_transport_failures_never_escape_as_httpx_errors(
    failure: httpx.HTTPError, expected: type[SpaceError]
) -> None:
    def fail(request: httpx.Request) -> httpx.Response:
        raise failure

    with pytest.raises(expected) as caught:
        await AsyncSandbox.connect("sbx1", api_key=API_KEY, _transport=httpx.MockTransport(fail))
    assert caught.value.sandbox_id == "sbx1"
    assert isinstance(caught.value.__cause__, httpx.HTTPError)


async def test_negative_an_unreachable_api_url_raises_unavailable() -> None:
    # Port 9 on loopback (discard) has no listener here: a real connection refusal.
    with pytest.raises(Unavailable, match="cannot reach"):
        await AsyncSandbox.list(api_url="http://127.0.0.1:9", api_key=API_KEY)


async def test_negative_a_bad_api_url_scheme_raises_invalid_argument() -> None:
    with pytest.raises(InvalidArgument):
        await AsyncSandbox.list(api_url="ftp://example.invalid", api_key=API_KEY)
