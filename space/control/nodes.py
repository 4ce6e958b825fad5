"""NodeRegistry: the nodes this control plane places sandboxes on, by node id."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from space.control.errors import ApiError
from space.node.api import NodeError, NodeService, TemplateInfo
from space.node.http.client import RemoteNode

__all__ = ["LIST_TIMEOUT_S", "LOCAL_URL", "NodeRegistry", "RemoteFactory"]

log = logging.getLogger(__name__)

#: The ``url`` recorded for a node embedded in the control plane's process.
LOCAL_URL = "local"

#: How long one node may take to list its templates before it is left out.
LIST_TIMEOUT_S = 10.0

#: Builds the NodeService for a remote node from its URL and the node token.
RemoteFactory = Callable[[str, str], NodeService]


def _remote(url: str, token: str) -> NodeService:
    return RemoteNode(url, token)


class NodeRegistry:
    """NodeService instances by node id: in-process ones and RemoteNodes.

    Nodes given to ``register`` stay their owner's to close; RemoteNodes this registry
    made (``register_remote``) are closed by ``aclose``. ``remote_factory`` lets tests
    route RemoteNodes through an in-process transport.
    """

    def __init__(self, remote_factory: RemoteFactory = _remote) -> None:
        self._nodes: dict[str, NodeService] = {}
        self._urls: dict[str, str] = {}
        self._owned: dict[str, NodeService] = {}
        self._remote_factory = remote_factory

    def register(self, node_id: str, node: NodeService, *, url: str = LOCAL_URL) -> None:
        """Add (or replace) a node the caller owns; ``url`` is what the database records."""
        self._nodes[node_id] = node
        self._urls[node_id] = url

    async def register_remote(self, node_id: str, url: str, token: str) -> None:
        """Add (or replace) a node agent on another host, reached at ``url`` with ``token``.

        Raises ApiError(conflict) when ``node_id`` names an embedded node.
        """
        if self._urls.get(node_id) == LOCAL_URL:
            raise ApiError(
                "conflict", f"node id {node_id!r} is the embedded node's", node_id=node_id
            )
        if self._urls.get(node_id) == url:
            return
        old = self._owned.pop(node_id, None)
        node = self._remote_factory(url, token)
        self._nodes[node_id] = node
        self._urls[node_id] = url
        self._owned[node_id] = node
        if isinstance(old, RemoteNode):
            await old.aclose()

    def get(self, node_id: str) -> NodeService:
        """The node, or ApiError(unavailable) if it is not registered (any more)."""
        node = self._nodes.get(node_id)
        if node is None:
            raise ApiError("unavailable", f"node {node_id!r} is not registered", node_id=node_id)
        return node

    async def templates(self, node_id: str) -> list[TemplateInfo]:
        """The node's templates; none (and a warning logged) if it is not registered,
        fails or does not answer within LIST_TIMEOUT_S, so one node cannot hold up a
        listing or a count over all of them."""
        try:
            async with asyncio.timeout(LIST_TIMEOUT_S):
                return await self.get(node_id).list_templates()
        except (NodeError, ApiError, TimeoutError) as exc:
            log.warning("templates: skipping node %s: %s", node_id, str(exc) or type(exc).__name__)
            return []

    def url(self, node_id: str) -> str:
        return self._urls[node_id]

    def ids(self) -> list[str]:
        return sorted(self._nodes)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._nodes

    async def aclose(self) -> None:
        """Close the RemoteNodes this registry made (idempotent)."""
        owned, self._owned = self._owned, {}
        for node_id, node in owned.items():
            self._nodes.pop(node_id, None)
            self._urls.pop(node_id, None)
            if isinstance(node, RemoteNode):
                await node.aclose()
