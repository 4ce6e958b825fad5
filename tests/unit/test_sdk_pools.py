"""The SDK's view of the nodes' warm pools (``GET /v1/pools``) against the real API."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from space.control.template_names import tenant_prefix
from space.node.api import PoolInfo as NodePoolInfo
from space.sdk import AsyncSandbox, PoolInfo, Sandbox
from space.sdk.errors import AuthenticationError, InternalError
from tests.unit._live_api import TENANT, LiveApi
from tests.unit._sdk_calls import connection as _connection

pytestmark = pytest.mark.anyio

#: A well-formed Pool object as the API sends it.
WIRE_POOL: dict[str, Any] = {
    "node_id": "n1",
    "template": "base",
    "size": 2,
    "target": 3,
    "min_size": 1,
    "max_size": 8,
    "hits": 3,
    "misses": 1,
    "hit_rate": 0.75,
}
POOL = PoolInfo("n1", "base", 2, 3, 1, 8, 3, 1, 0.75)
#: The same pool as a node reports it, and as the API then answers it.
NODE_POOL = NodePoolInfo("base", 2, 3, 1, 8, hits=3, misses=1)
LOCAL_POOL = PoolInfo("local", "base", 2, 3, 1, 8, 3, 1, 0.75)


async def test_list_pools_gets_every_pool_in_the_order_answered(api: LiveApi) -> None:
    api.node.pools = [NODE_POOL, NodePoolInfo(f"{tenant_prefix(TENANT)}py:v1", 2, 3, 1, 8, 0, 0)]
    pools = await AsyncSandbox.list_pools(**_connection(api))
    assert pools == [LOCAL_POOL, PoolInfo("local", "py:v1", 2, 3, 1, 8, 0, 0, None)]
    assert [(method, path) for method, path, _ in api.requests] == [("GET", "/v1/pools")]


async def test_list_pools_with_no_pools_is_empty(api: LiveApi) -> None:
    assert await AsyncSandbox.list_pools(**_connection(api)) == []


def test_sync_list_pools_blocks_for_the_same_answer(sync_api: LiveApi) -> None:
    sync_api.node.pools = [NODE_POOL]
    assert Sandbox.list_pools(**_connection(sync_api)) == [LOCAL_POOL]


def test_pool_info_is_frozen() -> None:
    with pytest.raises(AttributeError):
        POOL.size = 4  # type: ignore[misc]


@pytest.mark.parametrize("rate", [0, 1, 0.5])
def test_a_hit_rate_of_any_json_number_from_0_to_1_parses_as_a_float(rate: float) -> None:
    parsed = PoolInfo.from_wire(WIRE_POOL | {"hit_rate": rate})
    assert parsed.hit_rate == rate and isinstance(parsed.hit_rate, float)


async def test_negative_list_pools_with_a_wrong_key_is_an_authentication_error(
    api: LiveApi,
) -> None:
    api.node.pools = [NODE_POOL]
    with pytest.raises(AuthenticationError):
        await AsyncSandbox.list_pools(**_connection(api) | {"api_key": "sk-wrong"})


@pytest.mark.parametrize(
    "change",
    [
        {"node_id": ""},
        {"template": None},
        {"size": "2"},
        {"target": -1},
        {"hits": True},
        {"misses": 1.0},
        {"hit_rate": 1.5},
        {"hit_rate": -0.1},
        {"hit_rate": "0.75"},
        {"hit_rate": False},
    ],
)
def test_negative_a_malformed_pool_is_an_internal_error(change: dict[str, Any]) -> None:
    with pytest.raises(InternalError, match="malformed pool"):
        PoolInfo.from_wire(WIRE_POOL | change)


@pytest.mark.parametrize("missing", sorted(WIRE_POOL))
def test_negative_a_pool_missing_a_field_is_an_internal_error(missing: str) -> None:
    body = {key: value for key, value in WIRE_POOL.items() if key != missing}
    with pytest.raises(InternalError, match="malformed pool"):
        PoolInfo.from_wire(body)


@pytest.mark.parametrize("pools", [None, "n1", {"n1": WIRE_POOL}, [["n1"]]])
async def test_negative_a_malformed_pools_answer_is_an_internal_error(pools: Any) -> None:
    # The real API cannot answer this: a tiny handler plays a broken server.
    transport = httpx.MockTransport(lambda _request: httpx.Response(200, json={"pools": pools}))
    with pytest.raises(InternalError):
        await AsyncSandbox.list_pools(api_key="sk-test", _transport=transport)
