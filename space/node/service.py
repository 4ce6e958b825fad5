"""The node agent's core: sandboxes as QEMU VMs on btrfs snapshots of a template.

``Node`` implements space.node.interface.NodeService. Every transition is written to
``data_dir/sandboxes/<id>.json`` before it is acknowledged; ``Node.start`` re-adopts
every VM that survived the previous node process (QEMU outlives it) and cleans up the
rest, so nothing leaks and nothing is lost. ``close`` leaves VMs running for the next
start; ``shutdown`` deletes them all.

Every method raises space.node.errors leaves only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shutil
import time
import weakref
from collections.abc import AsyncIterable, Callable
from dataclasses import replace
from pathlib import Path

from space.node._sandbox import (
    LiveSandbox,
    kill_strays,
    not_allowed,
    settled,
    vm_config_for,
    with_console,
)
from space.node._template import Template, prepare_template
from space.node.channel import GuestChannel
from space.node.config import NodeConfig, resolve_node_id
from space.node.errors import (
    Conflict,
    InvalidArgument,
    NodeError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from space.node.interface import (
    ExecRequest,
    ExecStream,
    FileReader,
    FileStat,
    NodeInfo,
    ProcessInfo,
    SandboxSpec,
    SandboxState,
    SandboxStatus,
)
from space.node.state import SandboxRecord, StateStore
from space.node.storage.btrfs import BtrfsPool
from space.node.vmm.accel import Accelerator, detect_accelerator
from space.node.vmm.qemu import QemuVM

__all__ = ["Node"]

log = logging.getLogger(__name__)

#: Persisted states whose VM a restarted node takes over (others are cleaned up).
_ADOPTABLE = (SandboxState.CREATING, SandboxState.RUNNING, SandboxState.PAUSED)
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_LIMITS = {"cpus": (1, 8), "memory_mib": (128, 16384), "disk_mib": (1, 65536)}


class Node:
    """The sandboxes of one host. Start with ``await Node.start(config)``."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        node_id: str,
        pool: BtrfsPool,
        templates: dict[str, Template],
        accel: Accelerator,
    ) -> None:
        self.config = config
        self.node_id = node_id
        self.pool = pool
        self.accelerator: Accelerator = accel
        self._templates = templates
        self._store = StateStore(config.data_dir / "sandboxes")
        self._run_root = config.effective_run_dir
        self._sandboxes: dict[str, LiveSandbox] = {}
        # Per-id locks that outlive a sandbox only while someone waits on them.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._tasks: set[asyncio.Task[None]] = set()

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
        node_id = resolve_node_id(config)
        pool = await BtrfsPool.open(
            pool_path=config.pool_path, data_dir=config.data_dir, size_gib=config.pool_size_gib
        )
        try:
            template = await prepare_template(pool, config, say)
            accel = await detect_accelerator(
                config.accel,
                data_dir=config.data_dir,
                kernel=template.volume.kernel,
                initrd=template.volume.initrd,
                kernel_digest=template.image.digest,
                qemu_binary=config.qemu_binary,
            )
            say(f"accelerator: {accel}")
            node = cls(
                config, node_id=node_id, pool=pool, templates={"base": template}, accel=accel
            )
            await node._readopt(say)
        except BaseException:
            with contextlib.suppress(NodeError):
                await pool.close(unmount=pool.fresh_mount)
            raise
        return node

    async def close(self, *, unmount_pool: bool = False) -> None:
        """Disconnect from every VM but leave them running (the next start re-adopts them).

        ``unmount_pool`` also unmounts a loop-file pool; only for tests and tools, and
        only once no VM uses the pool any more.
        """
        for sandbox in list(self._sandboxes.values()):
            await sandbox.disconnect()
        self._sandboxes.clear()
        with contextlib.suppress(OSError):
            self._run_root.rmdir()  # only once empty: VMs left running keep their dirs
        await self.pool.close(unmount=unmount_pool)

    async def shutdown(self, *, unmount_pool: bool = False) -> None:
        """Delete every sandbox, then ``close``. For tests and demos."""
        for sandbox_id in list(self._sandboxes):
            await self.delete_sandbox(sandbox_id)
        await self.close(unmount_pool=unmount_pool)

    async def info(self) -> NodeInfo:
        return NodeInfo(
            node_id=self.node_id,
            accelerator=self.accelerator,
            templates=sorted(self._templates),
            sandboxes=len(self._sandboxes),
        )

    # lifecycle

    async def create_sandbox(self, spec: SandboxSpec) -> SandboxStatus:
        """Boot a sandbox; returns once its guest daemon said hello (state RUNNING).

        Idempotent: the same spec for an existing id returns its status; a different
        spec raises Conflict. Raises InvalidArgument (resources out of range), NotFound
        (template), ResourceExhausted (max_sandboxes), Unavailable/Timeout (boot failed;
        the message carries the console tail). On failure or cancellation nothing of the
        sandbox remains.
        """
        template = self._validate(spec)
        lock = self._lock(spec.sandbox_id)
        async with lock:
            existing = self._sandboxes.get(spec.sandbox_id)
            if existing is not None:
                if existing.record.spec != spec:
                    raise Conflict(
                        "a sandbox with this id and another spec exists", sandbox_id=spec.sandbox_id
                    )
                return existing.record.status()
            if len(self._sandboxes) >= self.config.max_sandboxes:
                raise ResourceExhausted(
                    f"node has {len(self._sandboxes)} sandboxes, the limit is "
                    f"{self.config.max_sandboxes}",
                    sandbox_id=spec.sandbox_id,
                )
            record = SandboxRecord(
                spec=spec,
                state=SandboxState.CREATING,
                created_at=time.time(),
                template_digest=template.image.digest,
                run_dir=str(self._run_root / spec.sandbox_id),
            )
            sandbox = self._live(record, template.image.kernel_cmdline, lock)
            self._sandboxes[spec.sandbox_id] = sandbox
            try:
                await self._boot(sandbox, template)
            except BaseException as exc:
                tail = sandbox.console_tail()
                await asyncio.shield(self._destroy(sandbox))
                error = with_console(exc, spec.sandbox_id, tail)
                if error is exc:
                    raise
                raise error from exc
            return sandbox.record.status()

    async def _boot(self, sandbox: LiveSandbox, template: Template) -> None:
        spec = sandbox.record.spec
        self._store.save(sandbox.record)  # CREATING, before anything exists to clean up
        await self.pool.create_sandbox_volume(
            spec.sandbox_id, template.volume, disk_mib=spec.disk_mib
        )
        sandbox.vm = await QemuVM.launch(sandbox.config, qemu_binary=self.config.qemu_binary)
        self._store.save(sandbox.mark(SandboxState.CREATING))  # now with the pid
        await sandbox.connect(hello_timeout_s=self.config.boot_timeout_s)
        self._store.save(sandbox.mark(SandboxState.RUNNING))
        sandbox.watch(self._on_vm_exit, self.config.console_max_bytes)

    async def delete_sandbox(self, sandbox_id: str) -> None:
        """Stop the VM and remove volume, sockets and state; idempotent (unknown ids too)."""
        _check_id(sandbox_id)
        async with self._lock(sandbox_id):
            sandbox = self._sandboxes.get(sandbox_id)
            if sandbox is None:
                await self._remove_leftovers(sandbox_id)
                return
            await asyncio.shield(self._destroy(sandbox))

    async def pause_sandbox(self, sandbox_id: str) -> SandboxStatus:
        """Stop the sandbox's vCPUs, keeping its memory; returns its status (PAUSED).

        Idempotent (a PAUSED sandbox's status comes back as is). PAUSED is persisted
        after QEMU confirmed and before returning. Raises NotFound, Conflict naming the
        state (neither running nor paused), Unavailable (QMP failed: still RUNNING). A
        cancellation waits for QEMU's answer (at most the QMP timeout), so the record
        and the VM agree.
        """
        return await self._switch(sandbox_id, SandboxState.PAUSED)

    async def resume_sandbox(self, sandbox_id: str) -> SandboxStatus:
        """Restart a PAUSED sandbox's vCPUs; returns its status (RUNNING).

        Idempotent, persisted and raising as ``pause_sandbox``. The guest's clock stood
        still while paused: it runs behind by the paused time until the guest syncs it.
        """
        return await self._switch(sandbox_id, SandboxState.RUNNING)

    async def _switch(self, sandbox_id: str, target: SandboxState) -> SandboxStatus:
        _check_id(sandbox_id)
        async with self._lock(sandbox_id):
            sandbox = self._get(sandbox_id)
            await self._switch_locked(sandbox, target)
            return sandbox.record.status()

    async def _switch_locked(self, sandbox: LiveSandbox, target: SandboxState) -> None:
        """RUNNING <-> PAUSED, persisted once QEMU confirmed; the caller holds the lock."""
        state = sandbox.record.state
        if state == target:
            return
        if state not in (SandboxState.RUNNING, SandboxState.PAUSED):
            raise not_allowed("pause" if target == SandboxState.PAUSED else "resume", sandbox)
        action = sandbox.pause if target == SandboxState.PAUSED else sandbox.resume

        async def switch() -> None:
            await action()
            self._store.save(sandbox.mark(target))

        await settled(switch())

    async def get_sandbox(self, sandbox_id: str) -> SandboxStatus:
        return self._get(sandbox_id).record.status()

    async def list_sandboxes(self) -> list[SandboxStatus]:
        return [s.record.status() for s in self._sandboxes.values()]

    # guest operations: each goes to the sandbox's channel

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecStream:
        sandbox = self._get(sandbox_id)
        if sandbox.record.spec.env:
            request = replace(request, env={**sandbox.record.spec.env, **request.env})
        return await (await self._channel(sandbox_id)).exec(request)

    async def attach(self, sandbox_id: str, process_id: str) -> ExecStream:
        return await (await self._channel(sandbox_id)).attach(process_id)

    async def list_processes(self, sandbox_id: str) -> list[ProcessInfo]:
        return await (await self._channel(sandbox_id)).list_processes()

    async def kill_process(self, sandbox_id: str, process_id: str, signal: int = 9) -> None:
        await (await self._channel(sandbox_id)).kill_process(process_id, signal)

    async def read_file(self, sandbox_id: str, path: str, user: str = "user") -> FileReader:
        return await (await self._channel(sandbox_id)).read_file(path, user)

    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        data: AsyncIterable[bytes],
        *,
        user: str = "user",
        mode: int = 0o644,
    ) -> FileStat:
        channel = await self._channel(sandbox_id)
        return await channel.write_file(path, data, user=user, mode=mode)

    async def list_dir(self, sandbox_id: str, path: str, user: str = "user") -> list[FileStat]:
        return await (await self._channel(sandbox_id)).list_dir(path, user)

    async def stat(self, sandbox_id: str, path: str, user: str = "user") -> FileStat:
        return await (await self._channel(sandbox_id)).stat(path, user)

    async def make_dir(self, sandbox_id: str, path: str, user: str = "user") -> FileStat:
        return await (await self._channel(sandbox_id)).make_dir(path, user)

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        await (await self._channel(sandbox_id)).remove(path, recursive=recursive)

    async def rename(self, sandbox_id: str, src: str, dst: str, user: str = "user") -> FileStat:
        return await (await self._channel(sandbox_id)).rename(src, dst, user)

    # internals

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is not None:
            return sandbox.lock
        lock = self._locks.get(sandbox_id)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[sandbox_id] = lock
        return lock

    def _get(self, sandbox_id: str) -> LiveSandbox:
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is None:
            raise NotFound(f"no sandbox {sandbox_id!r} on this node", sandbox_id=sandbox_id)
        return sandbox

    async def _channel(self, sandbox_id: str) -> GuestChannel:
        """The sandbox's open channel, reconnecting once if it broke but QEMU lives.

        A PAUSED sandbox is resumed first (under its lock), transparently.
        """
        sandbox = self._get(sandbox_id)
        if sandbox.record.state == SandboxState.PAUSED:
            async with sandbox.lock:
                sandbox = self._get(sandbox_id)
                if sandbox.record.state == SandboxState.PAUSED:
                    log.info("sandbox %s: resuming it for a guest operation", sandbox_id)
                    await self._switch_locked(sandbox, SandboxState.RUNNING)
        if sandbox.record.state != SandboxState.RUNNING:
            raise Unavailable(
                f"sandbox is {sandbox.record.state.value}: {sandbox.record.error or ''}".strip(),
                sandbox_id=sandbox_id,
            )
        channel = sandbox.channel
        if channel is not None and not channel.closed:
            return channel
        async with sandbox.lock:
            if sandbox.channel is not None and not sandbox.channel.closed:
                return sandbox.channel
            log.info("sandbox %s: guest channel closed, reconnecting", sandbox_id)
            return await sandbox.connect(hello_timeout_s=self.config.boot_timeout_s)

    def _live(self, record: SandboxRecord, base_cmdline: str, lock: asyncio.Lock) -> LiveSandbox:
        sid = record.sandbox_id
        config = vm_config_for(
            record,
            volume=self.pool.sandbox_path(sid),
            base_cmdline=base_cmdline,
            accel=self.accelerator,
            console_log=self._console_log(sid),
        )
        return LiveSandbox(record=record, config=config, lock=lock)

    def _validate(self, spec: SandboxSpec) -> Template:
        _check_id(spec.sandbox_id)
        for name, (low, high) in _LIMITS.items():
            value = getattr(spec, name)
            if not isinstance(value, int) or not low <= value <= high:
                raise InvalidArgument(
                    f"{name} must be within {low}..{high}, got {value!r}",
                    sandbox_id=spec.sandbox_id,
                )
        template = self._templates.get(spec.template)
        if template is None:
            raise NotFound(
                f"no template {spec.template!r} on this node", sandbox_id=spec.sandbox_id
            )
        if spec.disk_mib < template.min_disk_mib:
            raise InvalidArgument(
                f"disk_mib must be at least the template's {template.min_disk_mib}, "
                f"got {spec.disk_mib}",
                sandbox_id=spec.sandbox_id,
            )
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in spec.env.items()):
            raise InvalidArgument("env must map strings to strings", sandbox_id=spec.sandbox_id)
        return template

    async def _destroy(self, sandbox: LiveSandbox) -> None:
        """Take a sandbox apart completely; logs (never raises) what it cannot remove."""
        sid = sandbox.sandbox_id
        try:
            await sandbox.teardown()
        except NodeError as exc:
            log.error("sandbox %s: stopping its VM failed: %s", sid, exc)
        await self._remove_leftovers(sid)
        self._sandboxes.pop(sid, None)

    async def _remove_leftovers(self, sandbox_id: str) -> None:
        """Remove volume, run dir, console logs and state of a sandbox whose VM is gone."""
        try:
            await self.pool.delete_sandbox_volume(sandbox_id)
        except NodeError as exc:
            log.error("sandbox %s: deleting its volume failed: %s", sandbox_id, exc)
        shutil.rmtree(self._run_root / sandbox_id, ignore_errors=True)
        console = self._console_log(sandbox_id)
        for path in (console, console.with_suffix(".old")):
            path.unlink(missing_ok=True)
        self._store.remove(sandbox_id)

    def _console_log(self, sandbox_id: str) -> Path:
        return self._store.directory / f"{sandbox_id}.console.log"

    def _on_vm_exit(self, sandbox: LiveSandbox) -> None:
        """QEMU exited without being asked: the sandbox goes to ERROR (kept for inspection)."""
        tail = sandbox.console_tail()
        log.warning(
            "sandbox %s: qemu exited unexpectedly; console tail:\n%s", sandbox.sandbox_id, tail
        )
        error = f"VM exited unexpectedly; console tail: {tail[-500:]}"
        self._store.save(sandbox.mark(SandboxState.ERROR, error=error))
        task = asyncio.get_running_loop().create_task(sandbox.disconnect())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _readopt(self, say: Callable[[str], None]) -> None:
        """Re-adopt every persisted sandbox whose QEMU still runs; clean up the rest."""
        records, bad = self._store.load_all()
        expected = {r.sandbox_id: r.vmm_pid for r in records}
        await kill_strays(self._run_root, expected, say)
        for path in bad:
            say(f"removing unreadable state file {path.name}")
            await self._remove_leftovers(path.stem)
        for record in records:
            await self._readopt_one(record, say)
        known = set(self._sandboxes)
        orphans = set(self.pool.sandbox_ids())
        orphans |= {p.name.split(".console.")[0] for p in self._store.directory.glob("*.console.*")}
        for sid in sorted(orphans - known):
            say(f"removing leftovers of sandbox {sid}")
            await self._remove_leftovers(sid)

    async def _readopt_one(self, record: SandboxRecord, say: Callable[[str], None]) -> None:
        sid = record.sandbox_id
        template = self._templates.get(record.spec.template)
        cmdline = template.image.kernel_cmdline if template else ""
        sandbox = self._live(record, cmdline, self._lock(sid))
        pid = record.vmm_pid
        if pid is None or record.state not in _ADOPTABLE:
            say(f"sandbox {sid}: {record.state.value} without a VM; cleaning up")
            await self._destroy(sandbox)
            return
        try:
            sandbox.vm = await QemuVM.adopt(sandbox.config, pid)
            state = await self._adopted_state(sandbox)
        except (NodeError, OSError) as exc:
            say(f"sandbox {sid}: cannot re-adopt ({exc}); cleaning up")
            await self._destroy(sandbox)
            return
        self._sandboxes[sid] = sandbox
        self._store.save(sandbox.mark(state))
        sandbox.watch(self._on_vm_exit, self.config.console_max_bytes)
        say(f"sandbox {sid}: re-adopted qemu pid {pid} ({state.value})")

    async def _adopted_state(self, sandbox: LiveSandbox) -> SandboxState:
        """PAUSED or RUNNING as QEMU itself says, whatever the record says.

        The node may have died between QMP ``stop``/``cont`` and persisting the state.
        A paused guest cannot answer HELLO: its channel opens on the resume.
        """
        if await sandbox.vm_is_paused():
            return SandboxState.PAUSED
        await sandbox.connect(hello_timeout_s=self.config.boot_timeout_s)
        return SandboxState.RUNNING


def _check_id(sandbox_id: str) -> None:
    if not isinstance(sandbox_id, str) or not _ID_RE.match(sandbox_id):
        raise InvalidArgument(
            f"invalid sandbox id {sandbox_id!r}: want [A-Za-z0-9_.-], at most 63", sandbox_id=None
        )
