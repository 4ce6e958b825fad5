"""The E2B-shaped control API (space.control.e2b) over a FakeNode: every route, camelCase
bodies, paging and filters, auth at the edge, and E2B's error shape for every failure."""

from __future__ import annotations

import dataclasses
import urllib.parse
from pathlib import Path
from typing import Any

import httpx
import pytest

from space.control.access_tokens import TokenPurpose, sandbox_token
from space.control.e2b import ENVD_VERSION
from space.control.e2b._network import INTERNET
from space.limits import MAX_JSON_BODY_BYTES
from space.node.api import InsufficientCapacity, Unavailable
from tests.unit.fakes import Harness, control_app

pytestmark = pytest.mark.anyio


def _key(h: Harness, tenant: str = "acme") -> dict[str, str]:
    """E2B's own auth header (the SDK sends X-API-KEY)."""
    return {"X-API-KEY": h.key(tenant)["Authorization"].removeprefix("Bearer ")}


def _e2b_error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"code", "message"}, body
    assert body["code"] == status
    message: str = body["message"]
    return message


async def _create(h: Harness, headers: dict[str, str], **body: Any) -> dict[str, Any]:
    response = await h.client.post(
        "/v2/sandboxes", json={"templateID": "base", **body}, headers=headers
    )
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


async def test_create_answers_e2b_sandbox_with_tokens_and_maps_the_request(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = _key(h)
        created = await _create(
            h, headers, timeout=120, metadata={"k": "v"}, envVars={"A": "1"}, secure=True
        )
        sandbox_id = created["sandboxID"]
        token = h.app.state.ctx.node_token
        assert created == {
            "templateID": "base",
            "sandboxID": sandbox_id,
            "clientID": "local",
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": sandbox_token(token, sandbox_id, TokenPurpose.ENVD),
            "trafficAccessToken": sandbox_token(token, sandbox_id, TokenPurpose.TRAFFIC),
            "domain": None,
        }
        ours = (await h.client.get(f"/v1/sandboxes/{sandbox_id}", headers=headers)).json()
        assert ours["env"] == {"A": "1"} and ours["metadata"] == {"k": "v"}
        assert ours["max_lifetime_s"] == 120 and ours["idle_timeout_s"] is None
        # E2B's default is internet access: public hosts on 80 and 443, by name or address.
        assert len(ours["egress"]["allow"]) == len(INTERNET)
        assert h.node.egress[sandbox_id] == ours["egress"]


async def test_create_maps_auto_pause_and_network_options(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = _key(h)
        paused = await _create(h, headers, timeout=60, autoPause=True)
        ours = (await h.client.get(f"/v1/sandboxes/{paused['sandboxID']}", headers=headers)).json()
        assert ours["max_lifetime_s"] is None and ours["idle_timeout_s"] == 60
        detail = (await h.client.get(f"/sandboxes/{paused['sandboxID']}", headers=headers)).json()
        assert detail["lifecycle"] == {"onTimeout": "pause", "autoResume": False}
        assert detail["allowInternetAccess"] is True
        assert detail["network"] == {"allowOut": [], "denyOut": []}

        closed = await _create(h, headers, allow_internet_access=False)
        ours = (await h.client.get(f"/v1/sandboxes/{closed['sandboxID']}", headers=headers)).json()
        assert ours["egress"] == {"allow": []}

        network = {"allowOut": ["pypi.org", "203.0.113.7"], "denyOut": ["0.0.0.0/0"]}
        listed = await _create(h, headers, network=network)
        ours = (await h.client.get(f"/v1/sandboxes/{listed['sandboxID']}", headers=headers)).json()
        assert ours["egress"] == {
            "allow": [
                {"domain": "pypi.org", "ports": [80, 443]},
                {"cidr": "203.0.113.7/32", "ports": [80, 443]},
            ]
        }
        detail = (await h.client.get(f"/sandboxes/{listed['sandboxID']}", headers=headers)).json()
        assert detail["allowInternetAccess"] is False
        assert detail["network"] == {
            "allowOut": ["pypi.org", "203.0.113.7/32"],
            "denyOut": ["0.0.0.0/0"],
        }


async def test_create_turns_ports_on_with_the_token_unless_public_traffic_is_allowed(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        headers = _key(h)
        for network, public in (
            (None, False),
            ({"allowPublicTraffic": False}, False),
            ({"allowPublicTraffic": True}, True),
        ):
            extra = {} if network is None else {"network": network}
            made = await _create(h, headers, **extra)
            ours = await h.client.get(f"/v1/sandboxes/{made['sandboxID']}", headers=headers)
            ports = ours.json()["ports"]
            assert (ports["enabled"], ports["public"]) == (True, public), network
            # The traffic token E2B's SDK sends to a port is the one our API shows.
            assert made["trafficAccessToken"] == ports["traffic_token"]


async def test_create_reports_the_configured_sandbox_domain(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        h.app.state.ctx.settings = dataclasses.replace(h.settings, sandbox_domain="sb.example")
        created = await _create(h, _key(h))
        assert created["domain"] == "sb.example"


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"templateID": "base", "timeout": 0}, "timeout"),
        ({"templateID": "base", "timeout": "60"}, "timeout"),
        ({"templateID": "base", "unknownField": 1}, "unknownField"),
        ({}, "templateID"),
        ({"templateID": "Bad Name!"}, "template"),
        ({"templateID": "base", "mcp": {"x": {}}}, "mcp"),
        ({"templateID": "base", "autoPause": True, "autoPauseMemory": False}, "autoPauseMemory"),
        ({"templateID": "base", "network": {"denyOut": ["8.8.8.8"]}}, "denyOut"),
        ({"templateID": "base", "network": {"allowOut": ["10.0.0.0/8"]}}, "private"),
        ({"templateID": "base", "network": {"dnsServers": ["1.1.1.1"]}}, "dnsServers"),
        ({"templateID": "base", "metadata": {"k": 1}}, "metadata"),
    ],
)
async def test_negative_a_bad_create_answers_400_in_e2b_shape_and_makes_nothing(
    tmp_path: Path, body: dict[str, Any], words: str
) -> None:
    async with control_app(tmp_path) as h:
        headers = _key(h)
        response = await h.client.post("/v2/sandboxes", json=body, headers=headers)
        assert words in _e2b_error(response, 400)
        assert (await h.client.get("/v2/sandboxes", headers=headers)).json() == []
        assert h.node.boxes == {}


async def test_negative_an_unknown_template_answers_404_in_e2b_shape(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        response = await h.client.post(
            "/v2/sandboxes", json={"templateID": "no-such-template"}, headers=_key(h)
        )
        assert "no-such-template" in _e2b_error(response, 404)


async def test_negative_requests_without_a_good_key_answer_401_before_the_body(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        for headers in ({}, {"X-API-KEY": "sk_space_nope"}):
            response = await h.client.post("/v2/sandboxes", content=b"{not json", headers=headers)
            _e2b_error(response, 401)
            _e2b_error(await h.client.get("/sandboxes/sb-x", headers=headers), 401)
            _e2b_error(await h.client.get("/v2/sandboxes/sb-x/logs", headers=headers), 401)
        assert h.node.boxes == {}


async def test_negative_a_body_over_the_cap_answers_413_in_e2b_shape(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        big = b'{"templateID": "base", "metadata": {"k": "' + b"x" * MAX_JSON_BODY_BYTES + b'"}}'
        response = await h.client.post("/v2/sandboxes", content=big, headers=_key(h))
        _e2b_error(response, 413)
        assert h.node.boxes == {}


async def test_negative_malformed_json_answers_400(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = {**_key(h), "Content-Type": "application/json"}
        response = await h.client.post("/v2/sandboxes", content=b"{nope", headers=headers)
        _e2b_error(response, 400)


async def test_get_answers_the_detail_and_unknown_or_foreign_ids_404(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = _key(h)
        created = await _create(h, headers, metadata={"a": "b"})
        sandbox_id = created["sandboxID"]
        detail = (await h.client.get(f"/sandboxes/{sandbox_id}", headers=headers)).json()
        assert detail["sandboxID"] == sandbox_id
        assert detail["templateID"] == "base"
        assert detail["state"] == "running"
        assert detail["metadata"] == {"a": "b"}
        assert detail["envdVersion"] == ENVD_VERSION
        assert detail["envdAccessToken"] == created["envdAccessToken"]
        assert {"startedAt", "endAt", "cpuCount", "memoryMB", "diskSizeMB"} <= set(detail)
        _e2b_error(await h.client.get("/sandboxes/sb-nope", headers=headers), 404)
        other = _key(h, "other")
        _e2b_error(await h.client.get(f"/sandboxes/{sandbox_id}", headers=other), 404)
        _e2b_error(await h.client.delete(f"/sandboxes/{sandbox_id}", headers=other), 404)


async def test_kill_deletes_and_a_second_kill_answers_404(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = _key(h)
        sandbox_id = (await _create(h, headers))["sandboxID"]
        response = await h.client.delete(f"/sandboxes/{sandbox_id}", headers=headers)
        assert response.status_code == 204
        assert sandbox_id not in h.node.boxes
        _e2b_error(await h.client.delete(f"/sandboxes/{sandbox_id}", headers=headers), 404)


async def test_list_filters_by_state_metadata_and_template_and_pages(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = _key(h)
        ids = []
        for i in range(5):
            h.clock.now += 1
            meta = {"team": "a" if i % 2 == 0 else "b", "odd key&=": "v /%"}
            ids.append((await _create(h, headers, metadata=meta))["sandboxID"])
        await h.client.post(f"/sandboxes/{ids[0]}/pause", headers=headers)

        async def page(**params: Any) -> tuple[list[str], str | None]:
            response = await h.client.get("/v2/sandboxes", params=params, headers=headers)
            assert response.status_code == 200, response.text
            return [s["sandboxID"] for s in response.json()], response.headers.get("x-next-token")

        assert (await page())[0] == ids
        assert (await page(state="paused"))[0] == [ids[0]]
        assert (await page(state="running"))[0] == ids[1:]
        assert (await page(state="running,paused"))[0] == ids
        assert (await page(order="desc"))[0] == ids[::-1]
        assert (await page(template="base"))[0] == ids
        assert (await page(template="other"))[0] == []
        # The SDK quotes keys and values, then url-encodes the pairs.
        quoted = {urllib.parse.quote(k): urllib.parse.quote(v) for k, v in {"team": "a"}.items()}
        assert (await page(metadata=urllib.parse.urlencode(quoted)))[0] == ids[0::2]
        odd = {urllib.parse.quote("odd key&="): urllib.parse.quote("v /%")}
        assert (await page(metadata=urllib.parse.urlencode(odd)))[0] == ids

        first, token = await page(limit=2)
        assert first == ids[:2] and token
        second, token = await page(limit=2, nextToken=token)
        assert second == ids[2:4] and token
        third, token = await page(limit=2, nextToken=token)
        assert third == ids[4:] and token is None
        back, token = await page(limit=3, order="desc")
        rest, _ = await page(limit=3, order="desc", nextToken=token)
        assert back + rest == ids[::-1]
        assert [
            s["sandboxID"] for s in (await h.client.get("/sandboxes", headers=headers)).json()
        ] == ids[1:]


@pytest.mark.parametrize(
    "params",
    [{"state": "stopped"}, {"limit": 0}, {"limit": 101}, {"nextToken": "!!"}, {"order": "up"}],
)
async def test_negative_bad_list_parameters_answer_400(
    tmp_path: Path, params: dict[str, Any]
) -> None:
    async with control_app(tmp_path) as h:
        response = await h.client.get("/v2/sandboxes", params=params, headers=_key(h))
        _e2b_error(response, 400)


async def test_set_timeout_sets_the_end_from_now(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = _key(h)
        sandbox_id = (await _create(h, headers, timeout=60))["sandboxID"]
        h.clock.now += 100
        response = await h.client.post(
            f"/sandboxes/{sandbox_id}/timeout", json={"timeout": 30}, headers=headers
        )
        assert response.status_code == 204
        ours = (await h.client.get(f"/v1/sandboxes/{sandbox_id}", headers=headers)).json()
        assert ours["max_lifetime_s"] == 130
        bad = await h.client.post(
            f"/sandboxes/{sandbox_id}/timeout", json={"timeout": -1}, headers=headers
        )
        _e2b_error(bad, 400)
        missing = await h.client.post(
            "/sandboxes/sb-x/timeout", json={"timeout": 5}, headers=headers
        )
        _e2b_error(missing, 404)


async def test_pause_then_connect_resumes_and_extends_the_timeout(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = _key(h)
        sandbox_id = (await _create(h, headers, timeout=60))["sandboxID"]
        paused = await h.client.post(f"/sandboxes/{sandbox_id}/pause", headers=headers)
        assert paused.status_code == 204
        assert h.node.boxes[sandbox_id].status.state.value == "paused"
        again = await h.client.post(f"/sandboxes/{sandbox_id}/pause", headers=headers)
        _e2b_error(again, 409)  # the SDK's "already paused"
        detail = (await h.client.get(f"/sandboxes/{sandbox_id}", headers=headers)).json()
        assert detail["state"] == "paused"

        connected = await h.client.post(
            f"/v2/sandboxes/{sandbox_id}/connect", json={"timeout": 600}, headers=headers
        )
        assert connected.status_code == 201, connected.text
        assert connected.json()["sandboxID"] == sandbox_id
        assert h.node.boxes[sandbox_id].status.state.value == "running"
        ours = (await h.client.get(f"/v1/sandboxes/{sandbox_id}", headers=headers)).json()
        assert ours["max_lifetime_s"] == 600
        # Connecting to a running one answers 200 and never shortens its timeout.
        running = await h.client.post(
            f"/v2/sandboxes/{sandbox_id}/connect", json={"timeout": 10}, headers=headers
        )
        assert running.status_code == 200
        ours = (await h.client.get(f"/v1/sandboxes/{sandbox_id}", headers=headers)).json()
        assert ours["max_lifetime_s"] == 600
        reboot = await h.client.post(
            f"/v2/sandboxes/{sandbox_id}/connect", json={"memory": False}, headers=headers
        )
        _e2b_error(reboot, 400)
        missing = await h.client.post("/v2/sandboxes/sb-x/connect", json={}, headers=headers)
        _e2b_error(missing, 404)


async def test_hibernated_shows_as_paused_and_resume_wakes_it(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = _key(h)
        sandbox_id = (await _create(h, headers))["sandboxID"]
        await h.client.post(f"/v1/sandboxes/{sandbox_id}/hibernate", headers=headers)
        detail = (await h.client.get(f"/sandboxes/{sandbox_id}", headers=headers)).json()
        assert detail["state"] == "paused"
        _e2b_error(await h.client.post(f"/sandboxes/{sandbox_id}/pause", headers=headers), 409)
        resumed = await h.client.post(
            f"/sandboxes/{sandbox_id}/resume", json={"timeout": 60}, headers=headers
        )
        assert resumed.status_code == 201, resumed.text
        assert h.node.boxes[sandbox_id].status.state.value == "running"
        _e2b_error(await h.client.post(f"/sandboxes/{sandbox_id}/resume", headers=headers), 409)


async def test_metrics_of_one_and_of_many_sandboxes_in_e2b_shape(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = _key(h)
        first = (await _create(h, headers))["sandboxID"]
        second = (await _create(h, headers))["sandboxID"]
        samples = (await h.client.get(f"/sandboxes/{first}/metrics", headers=headers)).json()
        assert len(samples) == 1
        assert set(samples[0]) == {
            "timestamp", "timestampUnix", "cpuCount", "cpuUsedPct",
            "memUsed", "memTotal", "memCache", "diskUsed", "diskTotal",
        }  # fmt: skip
        assert samples[0]["cpuUsedPct"] == 10.0
        many = await h.client.get(
            "/sandboxes/metrics",
            params={"sandbox_ids": f"{first},{second},sb-nope"},
            headers=headers,
        )
        assert many.status_code == 200, many.text
        assert set(many.json()["sandboxes"]) == {first, second}
        _e2b_error(await h.client.get("/sandboxes/sb-nope/metrics", headers=headers), 404)


async def test_fork_snapshot_create_from_it_and_delete_it(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = _key(h)
        parent = (await _create(h, headers, metadata={"m": "1"}))["sandboxID"]
        forked = await h.client.post(
            f"/sandboxes/{parent}/fork", json={"count": 2, "timeout": 90}, headers=headers
        )
        assert forked.status_code == 201, forked.text
        children = [r["sandbox"]["sandboxID"] for r in forked.json()]
        assert len(set(children)) == 2 and parent not in children
        child = (await h.client.get(f"/v1/sandboxes/{children[0]}", headers=headers)).json()
        assert child["metadata"] == {"m": "1"}
        assert child["expires_at"] is not None

        snap = await h.client.post(
            f"/sandboxes/{parent}/snapshots", json={"name": "s1"}, headers=headers
        )
        assert snap.status_code == 201, snap.text
        snapshot_id = snap.json()["snapshotID"]
        assert snap.json()["names"] == ["s1"]
        listed = await h.client.get("/snapshots", params={"sandboxID": parent}, headers=headers)
        assert [s["snapshotID"] for s in listed.json()] == [snapshot_id]

        restored = await _create(h, headers, templateID=snapshot_id)
        assert restored["sandboxID"] in h.node.boxes

        deleted = await h.client.delete(f"/templates/{snapshot_id}", headers=headers)
        assert deleted.status_code == 204
        assert (await h.client.get("/snapshots", headers=headers)).json() == []
        _e2b_error(await h.client.delete(f"/templates/{snapshot_id}", headers=headers), 404)
        _e2b_error(await h.client.delete("/templates/sn-" + "0" * 24, headers=headers), 404)
        _e2b_error(await h.client.delete("/templates/base", headers=headers), 404)


async def test_negative_unsupported_routes_answer_404_in_e2b_shape(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = _key(h)
        sandbox_id = (await _create(h, headers))["sandboxID"]
        for method, path in [
            ("GET", f"/v2/sandboxes/{sandbox_id}/logs"),
            ("GET", f"/sandboxes/{sandbox_id}/logs"),
            ("POST", f"/sandboxes/{sandbox_id}/refreshes"),
            ("GET", "/templates/base/files"),
            ("GET", "/templates"),
            ("POST", "/v3/templates"),
            ("GET", "/volumes"),
            ("DELETE", "/secrets/x"),
        ]:
            response = await h.client.request(method, path, json={}, headers=headers)
            assert "not supported" in _e2b_error(response, 404)
        # Our own API keeps its own shape.
        ours = await h.client.get("/v1/sandboxes/sb-nope", headers=headers)
        assert ours.status_code == 404 and set(ours.json()) == {"error"}


async def test_an_error_sandbox_is_hidden_from_e2b_but_can_be_killed(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = _key(h)
        h.node.fail_create = Unavailable("the VM did not boot")
        failed = await h.client.post("/v2/sandboxes", json={"templateID": "base"}, headers=headers)
        _e2b_error(failed, 503)
        assert failed.headers["Should-Retry"] == "false"  # the SDK would make another
        h.node.fail_create = None
        (ours,) = (await h.client.get("/v1/sandboxes", headers=headers)).json()["sandboxes"]
        assert ours["state"] == "error"
        assert (await h.client.get("/v2/sandboxes", headers=headers)).json() == []
        hidden = await h.client.get(f"/sandboxes/{ours['id']}", headers=headers)
        assert "error" in _e2b_error(hidden, 404)
        killed = await h.client.delete(f"/sandboxes/{ours['id']}", headers=headers)
        assert killed.status_code == 204
        assert (await h.client.get("/v1/sandboxes", headers=headers)).json()["sandboxes"] == []


async def test_negative_no_room_answers_503_with_retry_after_and_keeps_nothing(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        headers = _key(h)
        h.node.fail_create = InsufficientCapacity("no memory", resource="memory", retry_after_s=7)
        refused = await h.client.post("/v2/sandboxes", json={"templateID": "base"}, headers=headers)
        _e2b_error(refused, 503)  # the SDK's ServiceBusyException, after its retries
        assert refused.headers["Retry-After"] == "7"
        assert "Should-Retry" not in refused.headers
        assert (await h.client.get("/v1/sandboxes", headers=headers)).json()["sandboxes"] == []


async def test_update_network_replaces_the_egress_policy(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = _key(h)
        sandbox_id = (await _create(h, headers))["sandboxID"]
        url = f"/sandboxes/{sandbox_id}/network"
        body = {"allowOut": ["pypi.org"], "denyOut": ["0.0.0.0/0"]}
        response = await h.client.put(url, json=body, headers=headers)
        assert response.status_code == 204, response.text
        pypi_only = {"allow": [{"domain": "pypi.org", "ports": [80, 443]}]}
        assert h.node.egress[sandbox_id] == pypi_only
        closed = await h.client.put(url, json={"allow_internet_access": False}, headers=headers)
        assert closed.status_code == 204
        assert h.node.egress[sandbox_id] == {"allow": []}
        bad = await h.client.put(url, json={"egressProxy": {"address": "p:1"}}, headers=headers)
        assert "egressProxy" in _e2b_error(bad, 400)
        assert h.node.egress[sandbox_id] == {"allow": []}  # nothing changed
