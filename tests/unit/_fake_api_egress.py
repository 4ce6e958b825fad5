"""The fake API's egress routes, from docs/api.md ("Egress"), for FakeApi.

A policy is checked for shape only (an object whose ``allow`` is a list of rule objects
with ports 1-65535) and made canonical as the server does for these tests' policies:
ports sorted, default ports [80, 443] added. A sandbox's log answers
``FakeApi.egress_events[sid]`` (wire dicts), else CANNED_EVENTS.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

if TYPE_CHECKING:
    from tests.unit.test_sdk_fake_api import FakeApi

__all__ = ["CANNED_EVENTS", "canonical", "create_policy", "egress_routes"]

CANNED_EVENTS: list[dict[str, Any]] = [
    {"time": "2026-11-30T12:00:01.250000+00:00", "protocol": "tls", "host": "pypi.org",
     "address": "151.101.0.223", "port": 443, "decision": "allow", "reason": "policy",
     "bytes_out": 517, "bytes_in": 4096, "secrets": ["PYPI_TOKEN"]},
    {"time": "2026-11-30T12:00:02+00:00", "protocol": "dns", "host": "evil.example",
     "address": None, "port": None, "decision": "deny", "reason": "no rule for host",
     "bytes_out": 0, "bytes_in": 0, "secrets": []},
]  # fmt: skip


def canonical(policy: Any) -> dict[str, Any] | str:
    """The canonical policy, or the error message the server would give."""
    if not isinstance(policy, dict) or not isinstance(policy.get("allow", []), list):
        return "egress policy: expected an object with a list 'allow'"
    rules = []
    for i, rule in enumerate(policy.get("allow", [])):
        ports = rule.get("ports", [80, 443]) if isinstance(rule, dict) else None
        if not isinstance(ports, list):
            return f"allow[{i}]: expected an object with 'domain' or 'cidr'"
        for j, port in enumerate(ports):
            if not isinstance(port, int) or not 1 <= port <= 65535:
                return f"allow[{i}].ports[{j}]: {port} is not a port (1-65535)"
        rules.append({**rule, "ports": sorted(ports)})
    return {"allow": rules}


def create_policy(fake: FakeApi, body: dict[str, Any]) -> dict[str, Any] | str:
    """A new sandbox's policy: the body's, else its snapshot's sandbox's, else closed."""
    if "egress" not in body and body.get("from_snapshot") in fake.snapshots:
        parent = fake.sandboxes.get(fake.snapshots[body["from_snapshot"]]["sandbox_id"], {})
        return canonical(parent.get("egress") or {"allow": []})
    return canonical(body.get("egress") or {"allow": []})


def egress_routes(fake: FakeApi, base: str) -> list[Route]:
    return [
        Route(base + "/{sid}/egress", functools.partial(_get, fake), methods=["GET"]),
        Route(base + "/{sid}/egress", functools.partial(_put, fake), methods=["PUT"]),
        Route(base + "/{sid}/egress/log", functools.partial(_log, fake), methods=["GET"]),
    ]


def _error(status: int, code: str, message: str) -> Response:
    return JSONResponse({"error": {"code": code, "message": message, "details": {}}}, status)


async def _get(fake: FakeApi, request: Request) -> Response:
    sandbox = fake.sandboxes.get(request.path_params["sid"])
    if sandbox is None:
        return _error(404, "not_found", "no such sandbox")
    return JSONResponse(sandbox["egress"])


async def _put(fake: FakeApi, request: Request) -> Response:
    sandbox = fake.sandboxes.get(request.path_params["sid"])
    if sandbox is None:
        return _error(404, "not_found", "no such sandbox")
    policy = canonical(await request.json())
    if isinstance(policy, str):
        return _error(422, "invalid_argument", policy)
    sandbox["egress"] = policy
    return JSONResponse(policy)


async def _log(fake: FakeApi, request: Request) -> Response:
    sid = request.path_params["sid"]
    if sid not in fake.sandboxes:
        return _error(404, "not_found", "no such sandbox")
    limit = request.query_params.get("limit", "100")
    if not limit.isdigit() or not 1 <= int(limit) <= 1000:
        return _error(422, "invalid_argument", f"limit: must be 1 to 1000, got {limit}")
    events = fake.egress_events.get(sid, CANNED_EVENTS)
    return JSONResponse({"events": events[-int(limit) :]})
