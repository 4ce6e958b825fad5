"""The REST API's edge (issue 17): which key each route needs, and which routes stream.

space.node.api.http_edges.Edges (shared with a node's own API) checks the key from the
headers before a byte of the body is read and caps the body at MAX_JSON_BODY_BYTES.
Here: ``/v1/nodes`` needs the node token, every other ``/v1/`` route an API key (the
tenant is kept in the request's state, where deps.Tenant reads it); the two streamed
routes (a file upload and a template build context) keep their own streamed caps.
E2B's control routes (space.control.e2b.E2B_ROUTES) need an API key too, and their
refusals take E2B's error shape.
"""

from __future__ import annotations

import re

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from space.control import e2b
from space.control.deps import ControlContext, authenticate
from space.control.errors import ApiError
from space.node.api.http_edges import Edges, StreamedRoute, require_bearer

__all__ = ["STREAMED_ROUTES", "control_edges"]

STREAMED_ROUTES: tuple[StreamedRoute, ...] = (
    ("PUT", re.compile(r"/v1/sandboxes/[^/]+/files")),
    ("POST", re.compile(r"/v1/templates")),
)
_NODE_ROUTES = "/v1/nodes"


def control_edges(app: ASGIApp) -> ASGIApp:
    """The edge middleware of the REST API around ``app`` (for ``app.add_middleware``):
    E2B's routes pass E2B's edge, every other path ours."""
    ours = Edges(
        app, authenticate=_authenticate, streamed_routes=STREAMED_ROUTES, coded=(ApiError,)
    )
    theirs = Edges(app, authenticate=e2b.authenticate, coded=(ApiError,), render=e2b.render_refusal)

    async def edges(scope: Scope, receive: Receive, send: Send) -> None:
        e2b_route = scope["type"] == "http" and e2b.E2B_ROUTES.fullmatch(scope["path"])
        await (theirs if e2b_route else ours)(scope, receive, send)

    return edges


async def _authenticate(scope: Scope, headers: Headers) -> None:
    """Check the key a ``/v1/`` route needs and keep the tenant in the request's state.
    Raises Refused or ApiError (unauthenticated)."""
    path: str = scope["path"]
    if not path.startswith("/v1/"):
        return
    ctx: ControlContext = scope["app"].state.ctx
    if path == _NODE_ROUTES or path.startswith(_NODE_ROUTES + "/"):
        require_bearer(headers, ctx.node_token, "node token")
        return
    scope.setdefault("state", {})["tenant"] = await authenticate(ctx, headers)
