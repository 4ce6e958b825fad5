"""The E2B-shaped control API (issue 20): the routes the e2b 2.x SDK calls, served by
`space serve` beside ``/v1`` with the same tenants and API keys (docs/e2b.md).

A user points the unmodified SDK at SPACE with ``E2B_API_URL`` and ``E2B_API_KEY``.
E2B's names, shapes and error table live in this package alone:

- ``_shapes``: E2B's request and answer bodies, and what each maps to in SPACE;
- ``_network``: internet access and ``network`` as an egress policy;
- ``_errors``: the ``{"code", "message"}`` error shape and its statuses;
- ``_sandboxes``, ``_snapshots``: the routes, on the control-plane functions the ``/v1``
  routes call.

``E2B_ROUTES`` says which paths are E2B's: the edge (space.control.edges) authenticates
them with ``authenticate`` (``X-API-KEY``, before any body is read) and answers its
refusals with ``render_refusal``.
"""

from __future__ import annotations

import re

from fastapi import APIRouter, Request
from starlette.datastructures import Headers
from starlette.types import Scope

from space.control.deps import ControlContext
from space.control.deps import authenticate as authenticate_key
from space.control.e2b import _sandboxes, _snapshots
from space.control.e2b._errors import E2BError, E2BRoute, render_refusal
from space.control.e2b._network import INTERNET
from space.control.e2b._shapes import ENVD_VERSION

__all__ = [
    "E2B_ROUTES",
    "ENVD_VERSION",
    "INTERNET",
    "authenticate",
    "render_refusal",
    "router",
]

#: The path families of E2B's API (a sandbox's own traffic, to envd, is not here): what
#: SPACE does not serve of them answers 404 in E2B's shape, after the key is checked.
_FAMILIES = (
    "/sandboxes",
    "/v2/sandboxes",
    "/snapshots",
    "/templates",
    "/v2/templates",
    "/v3/templates",
    "/volumes",
    "/secrets",
)
#: The paths the edge treats as E2B's.
E2B_ROUTES = re.compile("|".join(f"{re.escape(family)}(/.*)?" for family in _FAMILIES))

router = APIRouter(route_class=E2BRoute)
# /sandboxes/metrics before /sandboxes/{sandbox_id}.
router.include_router(_snapshots.router)
router.include_router(_sandboxes.router)


_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


async def unsupported(request: Request) -> None:
    """Any other E2B route (logs, refreshes, templates, volumes, secrets...): 404 in
    E2B's shape rather than our own (mounted after every other E2B route)."""
    route = f"{request.method} {request.url.path}"
    raise E2BError(404, f"{route[:200]} is not supported by SPACE's E2B API")


for _family in _FAMILIES:
    for _path in (_family, _family + "/{rest:path}"):
        router.add_api_route(_path, unsupported, methods=_METHODS, include_in_schema=False)


async def authenticate(scope: Scope, headers: Headers) -> None:
    """The edge's check of an E2B route: the tenant of the API key (``X-API-KEY``, or a
    bearer key) kept in the request's state. Raises ApiError(unauthenticated)."""
    ctx: ControlContext = scope["app"].state.ctx
    scope.setdefault("state", {})["tenant"] = await authenticate_key(ctx, headers)
