"""Two nodes on this host for moves (issue 19): each its own data dir and loop-file
btrfs pool, one node key between them, the source's API served on loopback.

Both run on one event loop of this process; the target reaches the source only
through the source's HTTP API (``source_url``), as it would on another host.
``ship_origin`` gives the target a copy of the template subvolume a sandbox came from
by send/receive, so that moves can be incremental: template shipping
(test_template_shipping.py) does that for built templates, but ``base`` is every node's
own and never shipped, so the moves of sandboxes of ``base`` here copy it by hand.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import os
import secrets
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from cryptography import x509

from space.node.agent import Node
from space.node.agent._moves import _origins
from space.node.core.config import ArtifactStoreConfig, NodeConfig
from space.node.core.run import run
from space.node.http.server import create_node_app, node_server
from space.node.storage.streams import adopt_received, receive_stream, send_stream
from tests import logs
from tests.integration.conftest import release_data_dir
from tests.ports import free_port
from tests.tls import write_self_signed

T = TypeVar("T")


@dataclass
class TwoNodes:
    runner: asyncio.Runner
    source: Node
    target: Node
    source_url: str

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.runner.run(coro)


def _config(
    directory: Path, key_file: Path, ca_file: Path, store: ArtifactStoreConfig | None
) -> NodeConfig:
    directory.mkdir(parents=True)
    logs.register(directory)
    return NodeConfig(
        data_dir=directory,
        pool_size_gib=8,
        boot_timeout_s=90.0,
        key_file=key_file,
        peer_ca_file=ca_file,
        artifact_store=store,
        # One cluster: the first node makes the store's master key, the other reads it.
        artifact_key_file=directory.parent / "artifact.key",
    )


@contextlib.contextmanager
def two_nodes(directory: Path, store: ArtifactStoreConfig | None = None) -> Iterator[TwoNodes]:
    """Two started nodes under ``directory`` sharing a node key (and the artifact
    ``store``, if given), the source's node API served over HTTPS on loopback with a
    certificate the target trusts (``peer_ca_file``), as between hosts; on exit both
    shut down and nothing of either is left (asserted)."""
    key_file = directory / "cluster.key"
    directory.mkdir(parents=True, exist_ok=True)
    key_file.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
    key_file.chmod(0o600)
    cert, key = directory / "node-api.crt", directory / "node-api.key"
    loopback = x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
    write_self_signed(cert, key, "source node", [loopback], ca=True)
    configs = [_config(directory / name, key_file, cert, store) for name in ("source", "target")]
    runner = asyncio.Runner()
    nodes: list[Node] = []
    try:
        for config in configs:
            nodes.append(runner.run(Node.start(config)))
        port = free_port()
        app = create_node_app(nodes[0], secrets.token_hex(16))
        server = node_server(app, host="127.0.0.1", port=port, tls=(cert, key))
        serving = runner.get_loop().create_task(server.serve())
        runner.run(_until_started(server))
        try:
            yield TwoNodes(runner, nodes[0], nodes[1], f"https://127.0.0.1:{port}")
        finally:
            server.should_exit = True
            runner.run(asyncio.wait_for(serving, 30))
    finally:
        for node in nodes:
            runner.run(node.shutdown(unmount_pool=True))
        runner.close()
        for config in configs:
            leaked = release_data_dir(config.data_dir)
            assert not leaked, f"left behind by a moves node: {leaked}"


async def _until_started(server: Any) -> None:
    for _ in range(500):
        if server.started:
            return
        await asyncio.sleep(0.01)
    raise TimeoutError("the source's node API did not start")


async def ship_origin(source: Node, target: Node, sandbox_id: str) -> Path | None:
    """Copy the template subvolume the source's sandbox ``sandbox_id`` was cloned from
    into the target's pool by a full send/receive, read-only, beside the target's own
    templates (what template shipping does), once; its path there, None if it has none."""
    sandbox = source._registry.get(sandbox_id)
    volume = source.pool.sandbox_path(sandbox.record.volume)
    origins = _origins(source.pool.root, volume, sandbox.record.template_digest)
    if not origins:
        return None
    origin = sorted(origins.values())[0]
    shipped = target.pool.root / "templates" / origin.parent.name / f"{origin.name}.shipped"
    if shipped.exists():  # shipped for an earlier sandbox of the same origin
        return shipped
    staging = target.pool.root / "incoming" / secrets.token_hex(4)
    staging.mkdir(parents=True)
    received = await receive_stream(
        target.pool.broker,
        target.pool.root,
        staging,
        send_stream(source.pool.broker, origin, None),
        max_bytes=64 << 30,
    )
    # Writable to be moved (a read-only subvolume cannot change its parent directory),
    # then read-only again: its received UUID stays.
    await adopt_received(target.pool.broker, received.path, writable=True)
    received.path.rename(shipped)
    staging.rmdir()
    await run("btrfs", "property", "set", "-ts", str(shipped), "ro", "true")
    return shipped
