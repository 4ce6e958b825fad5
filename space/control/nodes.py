"""NodeRegistry: the nodes this control plane places sandboxes on, by node id."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from space.control.errors import ApiError
from space.control.schemas import MAX_NODE_TEMPLATES, NodeCapacity
from space.node.api import NodeError, NodeInfo, NodeService, TemplateInfo
from space.node.http.client import RemoteNode, ca_context

__all__ = [
    "LIST_TIMEOUT_S",
    "LOCAL_URL",
    "NodeRegistry",
    "RemoteFactory",
    "capacity_report",
    "remote_factory",
]

log = logging.getLogger(__name__)

#: The ``url`` recorded for a node embedded in the control plane's process.
LOCAL_URL = "local"

#: How long one node may take to list its templates before it is left out.
LIST_TIMEOUT_S = 10.0

#: Builds the NodeService for a remote node from its URL and the node token.
RemoteFactory = Callable[[str, str], NodeService]


def _remote(url: str, token: str) -> NodeService:
    return RemoteNode(url, token)


def remote_factory(ca_file: Path | None) -> RemoteFactory:
    """RemoteNodes that check an https node's certificate with ``ca_file`` (None: the
    system's CAs)."""
    if ca_file is None:
        return _remote
    verify = ca_context(ca_file)
    return lambda url, token: RemoteNode(url, token, verify=verify)


def capacity_report(info: NodeInfo) -> NodeCapacity | None:
    """What a node sends with its heartbeat, from its own ``info`` (None if it reports
    no capacity figures). Called on the node's host: the vCPUs are this host's."""
    figures = info.capacity
    if figures is None:
        return None
    return NodeCapacity(
        vcpus=os.cpu_count() or 1,
        memory_mib=figures.memory_total_mib,
        memory_available_mib=figures.memory_available_mib,
        disk_mib=figures.pool_total_mib,
        disk_free_mib=figures.pool_free_mib,
        guest_types=list(info.guest_types),
        room=figures.room,
        templates=info.templates[:MAX_NODE_TEMPLATES],
        pools={pool.template: pool.size for pool in info.pools[:MAX_NODE_TEMPLATES]},
        archives=info.archives,
    )


class NodeRegistry:
    """NodeService instances by node id: in-process ones and RemoteNodes.

    Nodes given to ``register`` stay their owner's to close; RemoteNodes this registry
    made (``register_remote``, ``get``) are closed by ``aclose``. ``remote_factory``
    lets tests route RemoteNodes through an in-process transport.
    """

    def __init__(self, remote_factory: RemoteFactory = _remote) -> None:
        self._nodes: dict[str, NodeService] = {}
        self._urls: dict[str, str] = {}
        self._owned: dict[str, NodeService] = {}
        self._lost: set[str] = set()
        self._remote_factory = remote_factory
        self._directory: Callable[[str], str | None] = lambda _node_id: None
        self._token = ""

    def use_directory(self, url_of: Callable[[str], str | None], token: str) -> None:
        """Where ``get`` looks up a node it does not know: ``url_of`` gives the URL the
        database records for an id (another replica registered the node since this
        one last looked, space.control.background), reached with the node ``token``."""
        self._directory, self._token = url_of, token

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
        """The node, attached now if the directory knows it (a remote node another
        replica registered), or ApiError(unavailable) if it is not registered."""
        node = self._nodes.get(node_id)
        if node is None:
            node = self._attach(node_id)
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

    def _attach(self, node_id: str) -> NodeService | None:
        """A RemoteNode for the directory's URL of ``node_id``, if it has a remote one.
        Blocks on one query; it happens once per node a replica meets first this way."""
        url = self._directory(node_id)
        if url is None or url == LOCAL_URL:
            return None  # another replica's embedded node is not reachable from here
        node = self._nodes[node_id] = self._owned[node_id] = self._remote_factory(url, self._token)
        self._urls[node_id] = url
        return node

    def url(self, node_id: str) -> str:
        return self._urls[node_id]

    def url_of(self, node_id: str) -> str | None:
        """The node's URL, or None if it is not registered here."""
        return self._urls.get(node_id)

    def embedded(self) -> list[str]:
        """The nodes in this process (this replica heartbeats them), by id."""
        return sorted(n for n, url in self._urls.items() if url == LOCAL_URL)

    @property
    def lost(self) -> frozenset[str]:
        return frozenset(self._lost)

    def ids(self) -> list[str]:
        """The registered nodes not known to be lost, by id: those worth asking."""
        return sorted(self._nodes.keys() - self._lost)

    def set_lost(self, lost: Iterable[str]) -> None:
        """Which nodes the database says are lost (their lease ran out): ``ids`` leaves
        them out; ``get`` still finds them."""
        self._lost = set(lost)

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
