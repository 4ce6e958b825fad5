"""Requests addressed to a sandbox rather than to the API (issue 20).

Two ways to address port ``P`` of sandbox ``ID`` on the control plane's own listener:

- the headers ``E2b-Sandbox-Id: ID`` and ``E2b-Sandbox-Port: P``: what the E2B SDK sends
  to ``E2B_SANDBOX_URL`` (and to ``sandbox.<domain>``);
- the Host ``P-ID.<sandbox_domain>`` when ``ControlSettings.sandbox_domain`` is set: what
  E2B's ``get_host(P)`` names, for wildcard DNS and TLS pointing at the control plane.

Headers win over the Host. Port ``ENVD_PORT`` is E2B's in-sandbox daemon, which the
control plane translates to spaced (space.control.e2b); any other port is a server in
the sandbox, reached through spaced (space.control.ports). Each of the two handlers
authenticates the request itself with the sandbox's token
(space.control.access_tokens): the id alone opens nothing, and an unknown id is answered
exactly like a known one with a wrong token, so ids cannot be probed. Only a request
that carries the envd token of a sandbox that is gone hears so (502, ``gone_message``),
which E2B's SDK needs to tell a killed sandbox from a wrong token.

Everything else passes through to the API untouched.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocketClose

from space.control.access_tokens import TokenPurpose, check_token
from space.control.deps import ControlContext
from space.control.store import repo
from space.control.store.repo import SandboxRecord

__all__ = [
    "ENVD_PORT",
    "UNAUTHORIZED_MESSAGE",
    "BadTarget",
    "SandboxHandler",
    "SandboxTarget",
    "SandboxTraffic",
    "gone_message",
    "refuse",
    "target_of",
]

#: The port E2B's SDK addresses the in-sandbox daemon (envd) at.
ENVD_PORT = 49983
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
_PORT_RE = re.compile(r"[1-9][0-9]{0,4}")


@dataclass(frozen=True)
class SandboxTarget:
    sandbox_id: str
    port: int


#: Serves one request (HTTP or WebSocket) for a port of a sandbox; the record is the
#: sandbox the request names, not yet authenticated.
SandboxHandler = Callable[
    [ControlContext, SandboxRecord, int, Scope, Receive, Send], Awaitable[None]
]


class BadTarget(Exception):
    """A request that addresses a sandbox, but not in a form we accept."""


def target_of(headers: Headers, domain: str) -> SandboxTarget | None:
    """The sandbox and port a request addresses, or None for a request to the API.

    Raises BadTarget for a malformed id or port (never a guess at what was meant).
    """
    sandbox_id = headers.get("e2b-sandbox-id")
    if sandbox_id is not None:
        return SandboxTarget(_checked_id(sandbox_id), _port(headers.get("e2b-sandbox-port")))
    if not domain:
        return None
    host = headers.get("host", "").lower()
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    suffix = "." + domain
    if not name.endswith(suffix):
        return None
    label = name[: -len(suffix)]
    port, dash, sandbox_id = label.partition("-")
    if not dash or "." in label:
        return None  # sandbox.<domain>, api.<domain> and the like are the API's
    return SandboxTarget(_checked_id(sandbox_id), _port(port))


def _checked_id(text: str) -> str:
    if not _ID_RE.fullmatch(text):
        raise BadTarget(f"sandbox id {text[:64]!r} is malformed")
    return text


def _port(text: str | None) -> int:
    if text is None:
        return ENVD_PORT
    if not _PORT_RE.fullmatch(text) or int(text) > 65535:
        raise BadTarget(f"port {text[:16]!r} is not a number from 1 to 65535")
    return int(text)


class SandboxTraffic:
    """ASGI middleware: requests addressed to a sandbox go to ``envd`` (its ENVD_PORT)
    or ``ports`` (any other port); either may be None while that part is off, which
    answers 502."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        envd: SandboxHandler | None = None,
        ports: SandboxHandler | None = None,
    ) -> None:
        self.app = app
        self.envd = envd
        self.ports = ports

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        ctx: ControlContext = scope["app"].state.ctx
        try:
            target = target_of(Headers(scope=scope), ctx.settings.sandbox_domain)
        except BadTarget as exc:
            await refuse(scope, receive, send, 400, str(exc))
            return
        if target is None:
            await self.app(scope, receive, send)
            return
        handler = self.envd if target.port == ENVD_PORT else self.ports
        if handler is None:
            await refuse(scope, receive, send, 502, f"port {target.port} is not served here")
            return
        record = await ctx.db.read(lambda s: repo.sandbox_by_id(s, target.sandbox_id))
        if record is None and target.port == ENVD_PORT and _proves_envd(ctx, target, scope):
            # Whoever holds the sandbox's own token may learn that it is gone: E2B's SDK
            # reads this as "no longer running" (is_running() False).
            await refuse(scope, receive, send, 502, gone_message(target.sandbox_id))
            return
        if record is None:
            # The same answer as a wrong token for a sandbox that exists (handlers
            # refuse with UNAUTHORIZED_MESSAGE), so ids cannot be probed.
            await refuse(scope, receive, send, 401, UNAUTHORIZED_MESSAGE)
            return
        await handler(ctx, record, target.port, scope, receive, send)


def _proves_envd(ctx: ControlContext, target: SandboxTarget, scope: Scope) -> bool:
    given = Headers(scope=scope).get("x-access-token")
    return check_token(ctx.node_token, target.sandbox_id, TokenPurpose.ENVD, given)


def gone_message(sandbox_id: str) -> str:
    """What a sandbox that no longer runs is said to be: E2B's SDK looks for "was not
    found" to raise SandboxNotRunningException."""
    return f"sandbox {sandbox_id} was not found"


#: What a request with a wrong or missing sandbox token, or for no sandbox, is told.
UNAUTHORIZED_MESSAGE = "missing or wrong access token for this sandbox"


async def refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str) -> None:
    """Answer ``status`` with E2B's error shape (``{"code", "message"}``); a WebSocket
    is closed before it is accepted (policy violation) instead."""
    if scope["type"] == "websocket":
        await WebSocketClose(code=1008, reason=message[:120])(scope, receive, send)
        return
    response = JSONResponse({"code": status, "message": message}, status_code=status)
    await response(scope, receive, send)
