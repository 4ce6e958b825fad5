"""The REST API's egress routes over a FakeNode: policy at create, get, put, log (issue 5)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from space.node.api import EgressEvent, Unavailable
from tests.unit.fakes import Harness, control_app

pytestmark = pytest.mark.anyio

POLICY = {"allow": [{"cidr": "203.0.113.0/24", "ports": [5432]}, {"domain": "PyPI.org"}]}
#: POLICY as the parser writes it: domains first, names lower-cased, default ports.
CANONICAL = {
    "allow": [
        {"domain": "pypi.org", "ports": [80, 443]},
        {"cidr": "203.0.113.0/24", "ports": [5432]},
    ]
}
CLOSED: dict[str, Any] = {"allow": []}
BAD_PORT = {"allow": [{"domain": "pypi.org", "ports": [70000]}]}
BAD_PORT_MESSAGE = "allow[0].ports[0]: 70000 is not a port (1-65535)"


async def _create(h: Harness, key: dict[str, str], **body: Any) -> dict[str, Any]:
    answer = await h.client.post("/v1/sandboxes", json=body, headers=key)
    assert answer.status_code == 201, answer.text
    sandbox: dict[str, Any] = answer.json()
    return sandbox


async def _policy(h: Harness, sid: str, key: dict[str, str]) -> Any:
    answer = await h.client.get(f"/v1/sandboxes/{sid}/egress", headers=key)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _event(n: int) -> EgressEvent:
    return EgressEvent(1_800_000_000.0 + n, "tcp", f"h{n}.example", "203.0.113.9", 443,
                       "allow", "policy", bytes_out=n, bytes_in=2 * n)  # fmt: skip


async def test_a_policy_given_at_create_is_stored_canonical_and_sent_to_the_node(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sandbox = await _create(h, key, egress=POLICY)
        assert sandbox["egress"] == CANONICAL
        assert await _policy(h, sandbox["id"], key) == CANONICAL
        got = await h.client.get(f"/v1/sandboxes/{sandbox['id']}", headers=key)
        assert got.json()["egress"] == CANONICAL
        assert h.node.egress[sandbox["id"]] == CANONICAL


async def test_a_sandbox_created_without_a_policy_has_no_network(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sandbox = await _create(h, key)
        assert sandbox["egress"] == CLOSED
        assert await _policy(h, sandbox["id"], key) == CLOSED
        assert h.node.egress[sandbox["id"]] is None


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (BAD_PORT, BAD_PORT_MESSAGE),
        ({"allow": [{"domain": "a*.example.com"}]}, "allow[0].domain: 'a*.example.com' has a"),
        ({"deny": []}, "egress policy: unknown key 'deny'"),
        ({"allow": [{"cidr": "10.0.0.1/8"}]}, "has host bits set"),
    ],
)
async def test_negative_a_bad_policy_at_create_is_422_with_the_parsers_message(
    tmp_path: Path, policy: dict[str, Any], message: str
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        answer = await h.client.post("/v1/sandboxes", json={"egress": policy}, headers=key)
        assert answer.status_code == 422, answer.text
        assert answer.json()["error"]["code"] == "invalid_argument"
        assert message in answer.json()["error"]["message"]
        assert (await h.client.get("/v1/sandboxes", headers=key)).json()["sandboxes"] == []
        assert h.node.calls == []


async def test_negative_a_policy_that_is_not_an_object_is_422(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        answer = await h.client.post(
            "/v1/sandboxes", json={"egress": ["pypi.org"]}, headers=h.key("t")
        )
        assert answer.status_code == 422, answer.text
        assert h.node.calls == []


async def test_put_replaces_the_policy_and_answers_it_canonical(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        answer = await h.client.put(f"/v1/sandboxes/{sid}/egress", json=POLICY, headers=key)
        assert answer.status_code == 200, answer.text
        assert answer.json() == CANONICAL
        assert await _policy(h, sid, key) == CANONICAL
        assert h.node.egress[sid] == CANONICAL
        closed = await h.client.put(f"/v1/sandboxes/{sid}/egress", json={}, headers=key)
        assert closed.json() == CLOSED and h.node.egress[sid] == CLOSED


async def test_negative_a_bad_put_is_422_and_changes_nothing(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key, egress=POLICY))["id"]
        calls = list(h.node.calls)
        answer = await h.client.put(f"/v1/sandboxes/{sid}/egress", json=BAD_PORT, headers=key)
        assert answer.status_code == 422
        assert answer.json()["error"]["message"] == BAD_PORT_MESSAGE
        assert await _policy(h, sid, key) == CANONICAL
        assert h.node.egress[sid] == CANONICAL and h.node.calls == calls


PRIVATE = {"allow": [{"cidr": "10.254.77.0/30", "ports": [80]}]}


async def test_negative_a_private_range_the_operator_has_not_listed_is_422_at_put_and_create(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key, egress=POLICY))["id"]
        calls = list(h.node.calls)
        answer = await h.client.put(f"/v1/sandboxes/{sid}/egress", json=PRIVATE, headers=key)
        assert answer.status_code == 422, answer.text
        message = answer.json()["error"]["message"]
        assert message.startswith("allow[0].cidr: 10.254.77.0/30 is a private range")
        assert await _policy(h, sid, key) == CANONICAL and h.node.calls == calls
        created = await h.client.post("/v1/sandboxes", json={"egress": PRIVATE}, headers=key)
        assert created.status_code == 422, created.text


async def test_a_private_range_inside_an_operator_range_is_accepted(tmp_path: Path) -> None:
    async with control_app(tmp_path, egress_operator_ranges=("10.254.0.0/16",)) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        answer = await h.client.put(f"/v1/sandboxes/{sid}/egress", json=PRIVATE, headers=key)
        assert answer.status_code == 200, answer.text
        assert h.node.egress[sid] == PRIVATE


async def test_negative_a_node_failing_a_put_answers_its_error_with_the_row_already_changed(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        h.node.fail_next = Unavailable("node down", sandbox_id=sid)
        answer = await h.client.put(f"/v1/sandboxes/{sid}/egress", json=POLICY, headers=key)
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "unavailable"
        # The desired state was recorded first; the node still has the old policy.
        assert await _policy(h, sid, key) == CANONICAL
        assert h.node.egress[sid] is None
        retry = await h.client.put(f"/v1/sandboxes/{sid}/egress", json=POLICY, headers=key)
        assert retry.status_code == 200 and h.node.egress[sid] == CANONICAL


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/egress"), ("PUT", "/egress"), ("GET", "/egress/log")],
)
async def test_negative_another_tenants_sandbox_is_404_on_every_egress_route(
    tmp_path: Path, method: str, path: str
) -> None:
    async with control_app(tmp_path) as h:
        sid = (await _create(h, h.key("owner"), egress=POLICY))["id"]
        calls = list(h.node.calls)
        body = CLOSED if method == "PUT" else None
        answer = await h.client.request(
            method, f"/v1/sandboxes/{sid}{path}", headers=h.key("intruder"), json=body
        )
        assert answer.status_code == 404
        assert answer.json()["error"]["code"] == "not_found"
        assert h.node.calls == calls and h.node.egress[sid] == CANONICAL
        assert await _policy(h, sid, h.key("owner")) == CANONICAL


async def test_negative_a_deleted_sandbox_is_404_on_the_egress_routes(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        await h.client.delete(f"/v1/sandboxes/{sid}", headers=key)
        answer = await h.client.put(f"/v1/sandboxes/{sid}/egress", json=POLICY, headers=key)
        assert answer.status_code == 404
        assert (await h.client.get(f"/v1/sandboxes/{sid}/egress", headers=key)).status_code == 404


async def test_the_log_answers_the_nodes_events_with_every_field(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        answer = await h.client.get(f"/v1/sandboxes/{sid}/egress/log", headers=key)
        assert answer.status_code == 200, answer.text
        first, second = answer.json()["events"]
        assert first == {
            "time": "2027-01-15T08:00:00.500000+00:00",
            "protocol": "tls",
            "host": "pypi.org",
            "address": "151.101.0.223",
            "port": 443,
            "decision": "allow",
            "reason": "policy",
            "bytes_out": 517,
            "bytes_in": 4096,
            "secrets": ["PYPI_TOKEN"],
        }
        assert (second["decision"], second["address"], second["port"]) == ("deny", None, None)
        assert answer.json()["dropped"] == 0


async def test_the_log_answers_how_many_events_the_nodes_audit_dropped(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        h.node.egress_dropped[sid] = 9750
        answer = await h.client.get(f"/v1/sandboxes/{sid}/egress/log", headers=key)
        assert answer.status_code == 200 and answer.json()["dropped"] == 9750


async def _log(h: Harness, sid: str, key: dict[str, str], query: str) -> httpx.Response:
    return await h.client.get(f"/v1/sandboxes/{sid}/egress/log{query}", headers=key)


async def test_the_log_limit_defaults_to_100_and_takes_1_to_1000(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        h.node.egress_events[sid] = [_event(n) for n in range(1200)]
        default = (await _log(h, sid, key, "")).json()["events"]
        assert len(default) == 100 and default[-1]["host"] == "h1199.example"
        assert len((await _log(h, sid, key, "?limit=1")).json()["events"]) == 1
        assert len((await _log(h, sid, key, "?limit=1000")).json()["events"]) == 1000


@pytest.mark.parametrize("limit", ["0", "1001", "-1", "ten"])
async def test_negative_a_log_limit_out_of_range_is_422_before_the_node(
    tmp_path: Path, limit: str
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        calls = list(h.node.calls)
        answer = await _log(h, sid, key, f"?limit={limit}")
        assert answer.status_code == 422
        assert answer.json()["error"]["code"] == "invalid_argument"
        assert h.node.calls == calls


async def test_fork_children_carry_the_parents_policy_to_the_node(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key, egress=POLICY))["id"]
        h.node.egress[sid] = None  # a node whose fork would not copy it
        answer = await h.client.post(f"/v1/sandboxes/{sid}/fork", json={"count": 2}, headers=key)
        assert answer.status_code == 201, answer.text
        for child in answer.json()["sandboxes"]:
            assert child["egress"] == CANONICAL
            assert h.node.egress[child["id"]] == CANONICAL
            assert ("set_egress", child["id"]) in h.node.calls


async def _snapshot_of(h: Harness, key: dict[str, str], policy: object) -> str:
    sid = (await _create(h, key, egress=policy))["id"]
    taken = await h.client.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "s"}, headers=key)
    assert taken.status_code == 201, taken.text
    snapshot_id: str = taken.json()["id"]
    return snapshot_id


async def test_a_sandbox_from_a_snapshot_takes_its_sandboxs_policy_unless_given(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        snap = await _snapshot_of(h, key, POLICY)
        inherited = await _create(h, key, from_snapshot=snap)
        assert inherited["egress"] == CANONICAL
        assert h.node.egress[inherited["id"]] == CANONICAL
        given = await _create(h, key, from_snapshot=snap, egress={"allow": [{"domain": "x.org"}]})
        assert given["egress"] == {"allow": [{"domain": "x.org", "ports": [80, 443]}]}
        closed = await _create(h, key, from_snapshot=snap, egress=None)
        assert closed["egress"] == CLOSED and h.node.egress[closed["id"]] is None
