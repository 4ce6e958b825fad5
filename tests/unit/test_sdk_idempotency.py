"""The SDK's ``idempotency_key`` on create and fork (issue 19), against the real API."""

from __future__ import annotations

import pytest

from space.sdk import Sandbox
from space.sdk.errors import InvalidArgument
from tests.unit._live_api import LiveApi
from tests.unit._sdk_calls import create as _create

pytestmark = pytest.mark.anyio


async def test_sdk_create_with_a_key_twice_returns_one_sandbox(api: LiveApi) -> None:
    first = await _create(api, idempotency_key="job-42", metadata={"job": "42"})
    again = await _create(api, idempotency_key="job-42", metadata={"job": "42"})
    try:
        assert again.sandbox_id == first.sandbox_id
        assert list(api.node.boxes) == [first.sandbox_id]
        sent = [h.get("idempotency-key") for m, p, h in api.requests if p == "/v1/sandboxes"]
        assert sent == ["job-42", "job-42"]
    finally:
        await first.close()
        await again.close()


async def test_sdk_fork_with_a_key_twice_returns_the_same_children(api: LiveApi) -> None:
    parent = await _create(api)
    children = await parent.fork(2, idempotency_key="fork-a")
    again = await parent.fork(2, idempotency_key="fork-a")
    try:
        assert [c.sandbox_id for c in again] == [c.sandbox_id for c in children]
        assert len(api.node.boxes) == 3
        with pytest.raises(InvalidArgument, match="another request"):
            await parent.fork(1, idempotency_key="fork-a")
    finally:
        for sandbox in (parent, *children, *again):
            await sandbox.close()


@pytest.mark.parametrize("key", ["", "k" * 256, "tab\there", "é"])
async def test_negative_sdk_refuses_a_bad_key_before_sending(api: LiveApi, key: str) -> None:
    sent = len(api.requests)
    with pytest.raises(InvalidArgument, match="idempotency_key"):
        await _create(api, idempotency_key=key)
    assert len(api.requests) == sent and api.node.boxes == {}


def test_the_sync_sandbox_takes_the_key_too(sync_api: LiveApi) -> None:
    first = Sandbox.create(idempotency_key="sync-1", **sync_api.connection())
    again = Sandbox.create(idempotency_key="sync-1", **sync_api.connection())
    try:
        assert again.sandbox_id == first.sandbox_id
    finally:
        first.close()
        again.close()
