"""Requests addressed to a sandbox (E2B's headers, or a ``<port>-<id>.<domain>`` Host)
are told apart from API requests before anything else reads them."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.datastructures import Headers

from space.control.sandbox_traffic import ENVD_PORT, BadTarget, SandboxTarget, target_of
from tests.unit.fakes import control_app

pytestmark = pytest.mark.anyio

DOMAIN = "sbx.example.com"


def _headers(**values: str) -> Headers:
    return Headers({key.replace("_", "-"): value for key, value in values.items()})


@pytest.mark.parametrize(
    ("headers", "target"),
    [
        (_headers(e2b_sandbox_id="sbx-1", e2b_sandbox_port="8080"), SandboxTarget("sbx-1", 8080)),
        (_headers(e2b_sandbox_id="sbx-1"), SandboxTarget("sbx-1", ENVD_PORT)),
        (_headers(host=f"3000-sbx-1.{DOMAIN}"), SandboxTarget("sbx-1", 3000)),
        (_headers(host=f"3000-sbx-1.{DOMAIN}:8443"), SandboxTarget("sbx-1", 3000)),
        (_headers(host=f"49983-SBX-1.{DOMAIN.upper()}"), SandboxTarget("sbx-1", ENVD_PORT)),
        # Headers win over the Host.
        (
            _headers(host=f"3000-sbx-1.{DOMAIN}", e2b_sandbox_id="sbx-2", e2b_sandbox_port="1"),
            SandboxTarget("sbx-2", 1),
        ),
        # The API's own names under the domain, and other hosts, are the API's.
        (_headers(host=f"sandbox.{DOMAIN}"), None),
        (_headers(host=f"api.{DOMAIN}"), None),
        (_headers(host=f"3000-sbx-1.other.{DOMAIN}"), None),
        (_headers(host="3000-sbx-1.example.org"), None),
        (_headers(host="127.0.0.1:8080"), None),
        (_headers(), None),
    ],
)
def test_a_request_names_its_sandbox_and_port_by_headers_or_host(
    headers: Headers, target: SandboxTarget | None
) -> None:
    assert target_of(headers, DOMAIN) == target


def test_without_a_domain_only_the_headers_route() -> None:
    assert target_of(_headers(host=f"3000-sbx-1.{DOMAIN}"), "") is None


@pytest.mark.parametrize(
    "headers",
    [
        _headers(e2b_sandbox_id="sbx-1", e2b_sandbox_port="0"),
        _headers(e2b_sandbox_id="sbx-1", e2b_sandbox_port="65536"),
        _headers(e2b_sandbox_id="sbx-1", e2b_sandbox_port="80x"),
        _headers(e2b_sandbox_id="sbx-1", e2b_sandbox_port="0080"),
        _headers(e2b_sandbox_id="../etc", e2b_sandbox_port="80"),
        _headers(e2b_sandbox_id="", e2b_sandbox_port="80"),
        _headers(e2b_sandbox_id="x" * 200),
        _headers(host=f"99999-sbx-1.{DOMAIN}"),
        _headers(host=f"-sbx-1.{DOMAIN}"),
        _headers(host=f"80-.{DOMAIN}"),
    ],
)
def test_negative_a_malformed_sandbox_id_or_port_is_refused(headers: Headers) -> None:
    with pytest.raises(BadTarget):
        target_of(headers, DOMAIN)


async def test_negative_sandbox_traffic_never_reaches_the_api(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        sandbox = (await h.client.post("/v1/sandboxes", json={}, headers=h.key("acme"))).json()
        # An API route, addressed to a sandbox: it is not the API's, with or without a key.
        headers = {**h.key("acme"), "E2b-Sandbox-Id": sandbox["id"], "E2b-Sandbox-Port": "8080"}
        # Any port but envd's is space.control.ports': off by default
        # (tests/unit/test_control_ports.py).
        answer = await h.client.get("/v1/sandboxes", headers=headers)
        assert answer.status_code == 403 and "exposes no ports" in answer.json()["message"]
        # envd's port takes the sandbox's envd token, never an API key.
        headers["E2b-Sandbox-Port"] = str(ENVD_PORT)
        answer = await h.client.get("/v1/sandboxes", headers=headers)
        assert answer.status_code == 401
        bad = {"E2b-Sandbox-Id": sandbox["id"], "E2b-Sandbox-Port": "70000"}
        answer = await h.client.get("/v1/sandboxes", headers=bad)
        assert answer.status_code == 400 and answer.json()["code"] == 400
