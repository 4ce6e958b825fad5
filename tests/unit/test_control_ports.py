"""Port exposure on the control plane (issue 20, space.control.ports) over a FakeNode,
whose open_port reaches a real HTTP server on the host's loopback: who may (off, token,
public), the refusals, the setting through create, PUT, fork and from_snapshot, and the
proxying of requests and answers."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from space.control.access_tokens import TokenPurpose, sandbox_token
from space.control.ports import (
    MAX_REQUEST_BODY_BYTES,
    MAX_TUNNELS_PER_SANDBOX,
    MAX_TUNNELS_PER_TENANT,
    PortProxy,
)
from space.control.sandbox_traffic import UNAUTHORIZED_MESSAGE
from space.sdk import AsyncSandbox, InvalidArgument
from tests.unit.fakes import Harness, control_app
from tests.unit.test_guest_ports import free_port

pytestmark = pytest.mark.anyio

DOMAIN = "sandbox.example.test"


class _Handler(http.server.SimpleHTTPRequestHandler):
    def do_POST(self) -> None:
        size = int(self.headers.get("content-length", "0"))
        body = self.rfile.read(size)
        answer = b"got " + body + b" at " + self.path.encode()
        self.send_response(201)
        self.send_header("content-length", str(len(answer)))
        self.send_header("x-seen-host", self.headers.get("host", ""))
        self.send_header("x-seen-token", self.headers.get("x-space-traffic-token", "-"))
        self.send_header("x-seen-envd-token", self.headers.get("x-access-token", "-"))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def http_server(root: Path) -> Iterator[int]:
    handler = lambda *a: _Handler(*a, directory=str(root))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


async def _sandbox(h: Harness, **body: Any) -> dict[str, Any]:
    answer = await h.client.post("/v1/sandboxes", json=body, headers=h.key("acme"))
    assert answer.status_code == 201, answer.text
    return dict(answer.json())


def _to(sandbox: dict[str, Any], port: int, token: str | None = None) -> dict[str, str]:
    headers = {"E2b-Sandbox-Id": sandbox["id"], "E2b-Sandbox-Port": str(port)}
    return headers | ({"X-Space-Traffic-Token": token} if token else {})


async def test_ports_are_off_by_default_and_the_record_says_how_to_reach_them(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path, sandbox_domain=DOMAIN) as h:
        plain = await _sandbox(h)
        assert plain["ports"] == {
            "enabled": False,
            "public": False,
            "domain": DOMAIN,
            "traffic_token": None,
        }
        exposed = await _sandbox(h, ports={"enabled": True})
        token = sandbox_token(h.app.state.ctx.node_token, exposed["id"], TokenPurpose.TRAFFIC)
        assert exposed["ports"] == {
            "enabled": True,
            "public": False,
            "domain": DOMAIN,
            "traffic_token": token,
        }
        got = await h.client.get(f"/v1/sandboxes/{exposed['id']}", headers=h.key("acme"))
        assert got.json()["ports"]["traffic_token"] == token
        # Another tenant sees neither the sandbox nor its token.
        other = await h.client.get(f"/v1/sandboxes/{exposed['id']}", headers=h.key("other"))
        assert other.status_code == 404 and token not in other.text


async def test_http_reaches_the_server_by_headers_and_by_host_with_the_token(
    tmp_path: Path,
) -> None:
    (tmp_path / "www").mkdir()
    big = bytes(range(256)) * (4 * 4096)  # 4 MiB
    (tmp_path / "www" / "big.bin").write_bytes(big)
    async with control_app(tmp_path, sandbox_domain=DOMAIN) as h:
        with http_server(tmp_path / "www") as port:
            sandbox = await _sandbox(h, ports={"enabled": True})
            token = sandbox["ports"]["traffic_token"]
            answer = await h.client.get("/big.bin", headers=_to(sandbox, port, token))
            assert answer.status_code == 200 and answer.content == big
            host = {"Host": f"{port}-{sandbox['id']}.{DOMAIN}", "e2b-traffic-access-token": token}
            # e2b-code-interpreter sends the envd token to its port too: never to the guest.
            envd = {"X-Access-Token": "the-envd-token"}
            answer = await h.client.post("/echo?x=1", content=b"hello", headers=host | envd)
            assert answer.status_code == 201
            assert answer.content == b"got hello at /echo?x=1"
            assert answer.headers["x-seen-host"] == host["Host"]
            assert answer.headers["x-seen-token"] == "-"  # our headers stay with us
            assert answer.headers["x-seen-envd-token"] == "-"
            assert ("open_port", sandbox["id"]) in h.node.calls


async def test_negative_wrong_missing_or_foreign_tokens_and_unknown_sandboxes_are_401(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        with http_server(tmp_path) as port:
            one = await _sandbox(h, ports={"enabled": True})
            two = await _sandbox(h, ports={"enabled": True})
            for headers in (
                _to(one, port),
                _to(one, port, "wrong"),
                _to(one, port, two["ports"]["traffic_token"]),
                _to({"id": "sbx-unknown"}, port, one["ports"]["traffic_token"]),
            ):
                answer = await h.client.get("/", headers=headers)
                assert answer.status_code == 401, headers
                assert answer.json() == {"code": 401, "message": UNAUTHORIZED_MESSAGE}
            assert h.node.opened == []  # nothing reached the sandbox


async def test_negative_ports_off_is_403_and_enabling_then_disabling_applies(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        with http_server(tmp_path) as port:
            sandbox = await _sandbox(h)
            answer = await h.client.get("/", headers=_to(sandbox, port))
            assert answer.status_code == 403 and "exposes no ports" in answer.json()["message"]
            url = f"/v1/sandboxes/{sandbox['id']}/ports"
            public = await h.client.put(
                url, json={"enabled": True, "public": True}, headers=h.key("acme")
            )
            assert public.json()["ports"]["public"] is True
            assert public.json()["ports"]["traffic_token"] is None
            assert (await h.client.get("/", headers=_to(sandbox, port))).status_code == 200
            off = await h.client.put(url, json={"enabled": False}, headers=h.key("acme"))
            assert off.json()["ports"]["enabled"] is False
            assert (await h.client.get("/", headers=_to(sandbox, port))).status_code == 403
            bad = await h.client.put(url, json={"public": True}, headers=h.key("acme"))
            assert bad.status_code == 422
            foreign = await h.client.put(url, json={"enabled": True}, headers=h.key("other"))
            assert foreign.status_code == 404


async def test_negative_nothing_listening_is_502_and_a_body_over_the_cap_is_413(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        sandbox = await _sandbox(h, ports={"enabled": True, "public": True})
        answer = await h.client.get("/", headers=_to(sandbox, free_port()))
        assert answer.status_code == 502 and "nothing listens" in answer.json()["message"]
        declared = {"content-length": str(MAX_REQUEST_BODY_BYTES + 1)}
        answer = await h.client.post("/", headers=_to(sandbox, 8080) | declared, content=b"")
        assert answer.status_code == 413


async def test_forks_keep_the_setting_and_a_paused_sandbox_is_resumed_by_traffic(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        with http_server(tmp_path) as port:
            sandbox = await _sandbox(h, ports={"enabled": True, "public": True})
            fork = await h.client.post(f"/v1/sandboxes/{sandbox['id']}/fork", headers=h.key("acme"))
            child = fork.json()["sandboxes"][0]
            assert child["ports"]["public"] is True
            paused = await h.client.post(
                f"/v1/sandboxes/{sandbox['id']}/pause", headers=h.key("acme")
            )
            assert paused.json()["state"] == "paused"
            assert (await h.client.get("/", headers=_to(sandbox, port))).status_code == 200
            now = await h.client.get(f"/v1/sandboxes/{sandbox['id']}", headers=h.key("acme"))
            assert now.json()["state"] == "running"


async def test_the_sdk_exposes_ports_and_names_the_host_of_a_port(tmp_path: Path) -> None:
    async with control_app(tmp_path, sandbox_domain=DOMAIN) as h:
        key = h.key("acme")["Authorization"].removeprefix("Bearer ")
        transport = httpx.ASGITransport(app=h.app)
        with http_server(tmp_path) as port:
            sandbox = await AsyncSandbox.create(
                expose_ports=True, api_key=key, _transport=transport
            )
            try:
                host = sandbox.get_host(port)
                assert host == f"{port}-{sandbox.sandbox_id}.{DOMAIN}"
                token = sandbox.traffic_token
                assert token is not None
                headers = {"Host": host, "X-Space-Traffic-Token": token}
                assert (await h.client.get("/", headers=headers)).status_code == 200
                info = await sandbox.set_ports("public")
                assert info.ports.public and sandbox.traffic_token is None
                assert (await h.client.get("/", headers={"Host": host})).status_code == 200
                await sandbox.set_ports(False)
                assert (await h.client.get("/", headers={"Host": host})).status_code == 403
                with pytest.raises(InvalidArgument):
                    sandbox.get_host(0)
            finally:
                await sandbox.kill()
                await sandbox.close()


async def test_negative_connections_past_the_per_sandbox_or_tenant_bound_are_429(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        with http_server(tmp_path) as port:
            sandbox = await _sandbox(h, ports={"enabled": True, "public": True})
            (proxy,) = [m.kwargs["ports"] for m in h.app.user_middleware if "ports" in m.kwargs]
            assert isinstance(proxy, PortProxy)
            proxy.open_by_sandbox[sandbox["id"]] = MAX_TUNNELS_PER_SANDBOX  # as if all open
            answer = await h.client.get("/", headers=_to(sandbox, port))
            assert answer.status_code == 429 and "connections to sandbox" in answer.text
            del proxy.open_by_sandbox[sandbox["id"]]
            proxy.open_by_tenant["acme"] = MAX_TUNNELS_PER_TENANT
            answer = await h.client.get("/", headers=_to(sandbox, port))
            assert answer.status_code == 429 and "tenant's sandboxes" in answer.text
            del proxy.open_by_tenant["acme"]
            assert (await h.client.get("/", headers=_to(sandbox, port))).status_code == 200
            assert not proxy.open_by_sandbox and not proxy.open_by_tenant  # released
