"""The node agent's core: sandboxes as QEMU VMs on btrfs snapshots of a template.

``Node`` implements space.node.api.NodeService by delegating to its services, each
handed what it needs when the node is made: ``Sandboxes`` (lifecycle), ``GuestOps``
(exec, processes, files), ``Snapshots``, ``Templates`` (builds, ready states),
``Pools`` (warm pools), ``Egress`` (policies, secrets, audit logs), ``Moves`` and
``Shipping`` (hibernated sandboxes and built templates to and from other nodes,
issue 19) and ``MetricsKeeper`` (each sandbox's recent metrics samples). They share
one ``Registry`` (space.node.agent._registry): the live sandboxes, their locks and
stores.

Every transition is written to ``data_dir/sandboxes/<id>.json`` before it is
acknowledged; ``Node.start`` re-adopts every VM that survived the previous node
process (QEMU outlives it) and cleans up the rest, so nothing leaks and nothing is lost.
``close`` leaves VMs running for the next start; ``shutdown`` deletes them all.

Every method raises space.node.api.errors leaves only.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import TYPE_CHECKING

from space.node.agent._archives import Archives
from space.node.agent._catalog import Catalog
from space.node.agent._egress import Egress, SandboxNetwork
from space.node.agent._guest import GuestOps
from space.node.agent._gvisor_trees import remove_stale_trees
from space.node.agent._metrics import MetricsKeeper
from space.node.agent._moves import Moves
from space.node.agent._pool import Pools
from space.node.agent._recovery import recover
from space.node.agent._registry import Registry
from space.node.agent._sandboxes import Sandboxes
from space.node.agent._shipping import Shipping
from space.node.agent._snapshots import Snapshots
from space.node.agent._templates import Templates
from space.node.api import (
    BuildStream,
    EgressLog,
    ExecRequest,
    ExecStream,
    ExportTicket,
    FileReader,
    FileStat,
    ImportResult,
    NodeError,
    NodeInfo,
    PortTunnel,
    ProcessInfo,
    ProcessSelector,
    PtySize,
    SandboxMetrics,
    SandboxSpec,
    SandboxStatus,
    SecretGrant,
    SnapshotInfo,
    TemplateImport,
    TemplateInfo,
    TemplateTicket,
    WatchStream,
)
from space.node.artifacts import SealedStore, open_artifact_store
from space.node.core.config import NodeConfig, resolve_node_id
from space.node.core.data_dir import secure_data_dir
from space.node.core.keys import NodeKeys
from space.node.core.template import prepare_template
from space.node.egress.audit import AuditLog
from space.node.network.gateway_client import GatewayProcess
from space.node.privileged import Scope, broker_for, start_broker
from space.node.storage.btrfs import BtrfsPool
from space.node.vmm.accel import Accelerator, detect_accelerator
from space.node.vmm.jail import jail_for

if TYPE_CHECKING:
    from space.node.http.client import RemoteNode

__all__ = ["Node"]


class Node:
    """The sandboxes of one host. Start with ``await Node.start(config)``."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        node_id: str,
        pool: BtrfsPool,
        catalog: Catalog,
        accel: Accelerator,
        gateway: GatewayProcess,
        keys: NodeKeys,
        store: SealedStore | None = None,
    ) -> None:
        self.config = config
        self.node_id = node_id
        self.pool = pool
        self.accelerator: Accelerator = accel
        self._gateway = gateway
        self._boot_id = secrets.token_hex(8)
        network = SandboxNetwork(
            gateway,
            audit=AuditLog(config.data_dir / "egress" / "audit"),
            ca_dir=config.data_dir / "egress" / "ca",
            run_root=config.effective_run_dir,
            bounds=config.egress_bounds,
        )
        self._registry = Registry(
            config, pool=pool, catalog=catalog, accel=accel, network=network, keys=keys
        )
        self.pools = Pools(self._registry)
        self.snapshots = Snapshots(self._registry)
        self.sandboxes = Sandboxes(self._registry, snapshots=self.snapshots, pools=self.pools)
        self.guest = GuestOps(self._registry, self.sandboxes)
        self.metrics = MetricsKeeper(self._registry)
        self.templates = Templates(self._registry, self.pools)
        self.egress = Egress(self._registry)
        self.moves = Moves(self._registry, self._peer, keys.key_id)
        self.shipping = Shipping(self._registry, self.templates, self._peer, keys.key_id)
        self.archives = Archives(self._registry, store, keys.key_id)

    # startup and shutdown

    @classmethod
    async def start(
        cls, config: NodeConfig, *, progress: Callable[[str], None] | None = None
    ) -> Node:
        """Prepare pool, base template and accelerator, then re-adopt surviving VMs.

        Raises Unavailable if the pool, the image build or the import fails. Blocks for
        the first image build (minutes); later starts reuse the cached image.
        """
        say = progress or (lambda _msg: None)
        secure_data_dir(config.data_dir)  # 0700, also an existing one (issue 18)
        secure_data_dir(config.effective_run_dir)  # the VMs' sockets: root's alone
        keys = NodeKeys.load(config.effective_key_file, create=True)
        node_id = resolve_node_id(config)
        store = await _open_store(config, say)
        broker = await start_broker(broker_scope(config))
        try:
            pool = await BtrfsPool.open(
                pool_path=config.pool_path,
                data_dir=config.data_dir,
                size_gib=config.pool_size_gib,
                broker=broker,
            )
        except BaseException:
            await broker.close()
            raise
        gateway: GatewayProcess | None = None
        try:
            gateway = await GatewayProcess.start(
                config.data_dir / "egress",
                config.effective_resolvers,
                config.effective_upstream_ca,
                config.egress_bounds,
                broker=broker,
            )
            template = await prepare_template(pool, config, keys, say)
            accel = await detect_accelerator(
                config.accel,
                data_dir=config.data_dir,
                run_root=config.effective_run_dir,
                kernel=template.volume.kernel,
                initrd=template.volume.initrd,
                kernel_digest=template.digest,
                qemu_binary=config.qemu_binary,
            )
            say(f"accelerator: {accel}")
            catalog = Catalog(template, pool, config.data_dir / "templates")
            for problem in catalog.load():
                say(problem)
            node = cls(
                config,
                node_id=node_id,
                pool=pool,
                catalog=catalog,
                accel=accel,
                gateway=gateway,
                keys=keys,
                store=store,
            )
            await node._start(say)
        except BaseException:
            if gateway is not None:
                await gateway.abandon()
            with contextlib.suppress(NodeError):
                await pool.close(unmount=pool.fresh_mount)
            await broker.close()
            raise
        return node

    async def _start(self, say: Callable[[str], None]) -> None:
        """Take over what the previous node process left, then the network and templates."""
        registry = self._registry
        await recover(registry, say)
        await self.moves.sweep()
        await registry.network.at_start(registry.sandboxes.values(), say)
        await self.templates.remove_untagged(say)
        await remove_stale_trees(registry, say)
        for built in registry.catalog.builds():
            await self.templates.ready_at_start(built, say)

    async def close(self, *, unmount_pool: bool = False) -> None:
        """Disconnect from every VM but leave them running (the next start re-adopts them),
        and the egress gateway with them (it ends if no sandbox is left to serve).

        Warm pool VMs (no tenant data) are deleted. ``unmount_pool`` also unmounts a
        loop-file pool; only for tests and tools, and only once no VM uses it any more.
        """
        await self.templates.close()
        await self.pools.close()
        sandboxes = self._registry.sandboxes
        for sandbox in list(sandboxes.values()):
            await sandbox.disconnect()
        sandboxes.clear()
        await self._gateway.close()
        jail_for(self._registry.run_root).close()
        with contextlib.suppress(OSError):
            self._registry.run_root.rmdir()  # only once empty: VMs left running keep their dirs
        try:
            await self.pool.close(unmount=unmount_pool)
        finally:
            await broker_for(self._registry.run_root).close()

    async def shutdown(self, *, unmount_pool: bool = False) -> None:
        """Delete every sandbox and snapshot, then ``close``. For tests and demos."""
        for sandbox_id in list(self._registry.sandboxes):
            await self.delete_sandbox(sandbox_id)
        for snapshot in self._registry.snapshots.load_all()[0]:
            await self.delete_snapshot(snapshot.snapshot_id)
        await self.close(unmount_pool=unmount_pool)

    async def info(self) -> NodeInfo:
        """Identity, load, warm pools and the capacity figures admission decides from
        (None if the host cannot be measured; the rest is still answered)."""
        try:
            capacity = self._registry.admission.info()
        except NodeError:
            capacity = None
        return NodeInfo(
            node_id=self.node_id,
            accelerator=self.accelerator,
            templates=sorted({template.name for template in self._registry.catalog.tagged()}),
            sandboxes=len(self._registry.sandboxes),
            pools=self.pools.infos(),
            boot_id=self._boot_id,
            capacity=capacity,
            archives=self.archives.enabled,
            egress_decisions=await self._gateway.decisions(),
            guest_types=list(self._registry.guest_types),
        )

    # sandboxes (each service documents its calls: raises, idempotence, persistence)

    async def create_sandbox(self, spec: SandboxSpec) -> SandboxStatus:
        return await self.sandboxes.create_sandbox(spec)

    async def delete_sandbox(self, sandbox_id: str) -> None:
        await self.sandboxes.delete_sandbox(sandbox_id)

    async def pause_sandbox(self, sandbox_id: str) -> SandboxStatus:
        return await self.sandboxes.pause_sandbox(sandbox_id)

    async def resume_sandbox(self, sandbox_id: str) -> SandboxStatus:
        return await self.sandboxes.resume_sandbox(sandbox_id)

    async def hibernate_sandbox(self, sandbox_id: str) -> SandboxStatus:
        return await self.sandboxes.hibernate_sandbox(sandbox_id)

    async def restore_sandbox(self, sandbox_id: str, snapshot_id: str) -> SandboxStatus:
        return await self.sandboxes.restore_sandbox(sandbox_id, snapshot_id)

    async def fork_sandbox(self, sandbox_id: str, child_ids: list[str]) -> list[SandboxStatus]:
        return await self.sandboxes.fork_sandbox(sandbox_id, child_ids)

    async def get_sandbox(self, sandbox_id: str) -> SandboxStatus:
        return await self.sandboxes.get_sandbox(sandbox_id)

    async def list_sandboxes(self) -> list[SandboxStatus]:
        return await self.sandboxes.list_sandboxes()

    # snapshots

    async def snapshot_sandbox(self, sandbox_id: str, snapshot_id: str) -> SnapshotInfo:
        return await self.snapshots.snapshot_sandbox(sandbox_id, snapshot_id)

    async def list_snapshots(self) -> list[SnapshotInfo]:
        return await self.snapshots.list_snapshots()

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return await self.snapshots.get_snapshot(snapshot_id)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self.snapshots.delete_snapshot(snapshot_id)

    # the guest: exec, processes, files

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecStream:
        return await self.guest.exec(sandbox_id, request)

    async def attach(self, sandbox_id: str, process: str | ProcessSelector) -> ExecStream:
        return await self.guest.attach(sandbox_id, process)

    async def list_processes(self, sandbox_id: str) -> list[ProcessInfo]:
        return await self.guest.list_processes(sandbox_id)

    async def kill_process(self, sandbox_id: str, process_id: str, signal: int = 9) -> None:
        await self.guest.kill_process(sandbox_id, process_id, signal)

    async def write_stdin(
        self, sandbox_id: str, process_id: str, data: bytes, *, eof: bool = False
    ) -> int:
        return await self.guest.write_stdin(sandbox_id, process_id, data, eof=eof)

    async def resize_pty(self, sandbox_id: str, process_id: str, size: PtySize) -> None:
        await self.guest.resize_pty(sandbox_id, process_id, size)

    async def watch_dir(
        self, sandbox_id: str, path: str, *, recursive: bool = False, user: str = "user"
    ) -> WatchStream:
        return await self.guest.watch_dir(sandbox_id, path, recursive=recursive, user=user)

    async def read_file(self, sandbox_id: str, path: str, user: str = "user") -> FileReader:
        return await self.guest.read_file(sandbox_id, path, user)

    async def open_port(self, sandbox_id: str, port: int) -> PortTunnel:
        return await self.guest.open_port(sandbox_id, port)

    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        data: AsyncIterable[bytes],
        *,
        user: str = "user",
        mode: int = 0o644,
    ) -> FileStat:
        return await self.guest.write_file(sandbox_id, path, data, user=user, mode=mode)

    async def list_dir(self, sandbox_id: str, path: str, user: str = "user") -> list[FileStat]:
        return await self.guest.list_dir(sandbox_id, path, user)

    async def stat(self, sandbox_id: str, path: str, user: str = "user") -> FileStat:
        return await self.guest.stat(sandbox_id, path, user)

    async def make_dir(self, sandbox_id: str, path: str, user: str = "user") -> FileStat:
        return await self.guest.make_dir(sandbox_id, path, user)

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        await self.guest.remove(sandbox_id, path, recursive=recursive)

    async def rename(self, sandbox_id: str, src: str, dst: str, user: str = "user") -> FileStat:
        return await self.guest.rename(sandbox_id, src, dst, user)

    async def sandbox_metrics(self, sandbox_id: str) -> list[SandboxMetrics]:
        return await self.metrics.sandbox_metrics(sandbox_id, self.guest.channel)

    # egress

    async def set_egress(self, sandbox_id: str, policy: dict[str, object] | None) -> None:
        await self.egress.set_egress(sandbox_id, policy)

    async def egress_log(self, sandbox_id: str, *, limit: int = 100) -> EgressLog:
        return await self.egress.egress_log(sandbox_id, limit=limit)

    async def set_secrets(self, sandbox_id: str, grants: list[SecretGrant]) -> None:
        await self.egress.set_secrets(sandbox_id, grants)

    # moves and template shipping (issue 19)

    def _peer(self, url: str, ticket: str) -> RemoteNode:
        """Another node's API, for a move's or a template's stream (its ticket the
        credential)."""
        from space.node.http.client import RemoteNode, ca_context  # the HTTP layer sits above

        return RemoteNode(url, ticket, verify=ca_context(self.config.peer_ca_file))

    async def export_sandbox(self, sandbox_id: str) -> ExportTicket:
        return await self.moves.export(sandbox_id)

    def stream_export(
        self, sandbox_id: str, ticket: str, parent: str | None
    ) -> AsyncIterator[bytes]:
        return self.moves.stream(sandbox_id, ticket, parent)

    async def import_sandbox(self, ticket: ExportTicket, source_url: str) -> ImportResult:
        return await self.moves.import_(ticket, source_url)

    async def finish_export(self, sandbox_id: str, ticket: str, *, moved: bool) -> None:
        await self.moves.finish(sandbox_id, ticket, moved=moved)

    # archives (issue 19)

    async def archive_snapshot(self, snapshot_id: str) -> None:
        await self.archives.archive_snapshot(snapshot_id)

    async def fetch_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return await self.archives.fetch_snapshot(snapshot_id)

    async def archive_sandbox(self, sandbox_id: str) -> SandboxStatus:
        return await self.archives.archive_sandbox(sandbox_id)

    async def import_archive(self, sandbox_id: str, archive: str) -> ImportResult:
        return await self.archives.import_archive(sandbox_id, archive)

    async def delete_archive(self, name: str) -> None:
        await self.archives.delete_archive(name)

    async def export_template(self, ref: str) -> TemplateTicket:
        return await self.shipping.export(ref)

    def stream_template(self, digest: str, ticket: str, parent: str | None) -> AsyncIterator[bytes]:
        return self.shipping.stream(digest, ticket, parent)

    async def import_template(self, ticket: TemplateTicket, source_url: str) -> TemplateImport:
        return await self.shipping.import_(ticket, source_url)

    # templates

    async def build_template(self, context: AsyncIterable[bytes]) -> BuildStream:
        return await self.templates.build_template(context)

    async def list_templates(self) -> list[TemplateInfo]:
        return await self.templates.list_templates()

    async def delete_template(self, ref: str) -> None:
        await self.templates.delete_template(ref)


async def _open_store(config: NodeConfig, say: Callable[[str], None]) -> SealedStore | None:
    """The node's artifact store, checked at once: its master key loads (made if
    absent) and the backend answers with our credentials. Raises what they raise
    (KeyFileError, InvalidArgument, PermissionDenied, Unavailable): a node that was told
    to keep archives does not start without them."""
    store = open_artifact_store(config)
    if store is not None and config.artifact_store is not None:
        await store.list("space-probe/")  # a missing bucket is NotFound here, not on a HEAD
        say(f"artifact store: {config.artifact_store.kind}, reachable")
    return store


def broker_scope(config: NodeConfig, owner: tuple[int, int] | None = None) -> Scope:
    """What the node's root broker may touch: the data dir, the pool and the VMs' run
    directories, and the namespaces and cgroups of this node (by its run root), for the
    agent running as ``owner`` (uid, gid; None: this process's)."""
    run_root = config.effective_run_dir
    roots = (config.data_dir.resolve(), config.effective_pool_path.resolve(), run_root)
    return Scope(run_root, roots, owner or (os.geteuid(), os.getegid()))
