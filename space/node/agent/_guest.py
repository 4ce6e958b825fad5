"""The guest operations of a node: each goes to the sandbox's guest channel.

``Node`` delegates exec, processes and files to ``GuestOps``. A PAUSED or HIBERNATED
sandbox is resumed first, transparently, and a channel that broke while QEMU lives is
reopened (``channel``, public for benchmarks that time the channel itself). Every
method raises space.node.api errors only.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable
from dataclasses import replace

from space.node.agent._registry import Registry
from space.node.agent._sandboxes import Sandboxes
from space.node.api import (
    ExecRequest,
    ExecStream,
    FileReader,
    FileStat,
    PortTunnel,
    ProcessInfo,
    ProcessSelector,
    PtySize,
    SandboxState,
    Unavailable,
    WatchStream,
)
from space.node.channel import GuestChannel
from space.node.network.trust import TRUST_ENV

__all__ = ["GuestOps"]

log = logging.getLogger(__name__)


class GuestOps:
    """Exec, processes and files of the node's sandboxes."""

    def __init__(self, registry: Registry, sandboxes: Sandboxes) -> None:
        self._registry = registry
        self._sandboxes = sandboxes

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecStream:
        record = self._registry.get(sandbox_id).record
        env = {**TRUST_ENV, **record.template_env, **record.spec.env, **request.env}
        request = replace(request, env=env, cwd=request.cwd or record.workdir)
        return await (await self.channel(sandbox_id)).exec(request)

    async def attach(self, sandbox_id: str, process: str | ProcessSelector) -> ExecStream:
        return await (await self.channel(sandbox_id)).attach(process)

    async def list_processes(self, sandbox_id: str) -> list[ProcessInfo]:
        return await (await self.channel(sandbox_id)).list_processes()

    async def kill_process(self, sandbox_id: str, process_id: str, signal: int = 9) -> None:
        await (await self.channel(sandbox_id)).kill_process(process_id, signal)

    async def write_stdin(
        self, sandbox_id: str, process_id: str, data: bytes, *, eof: bool = False
    ) -> int:
        return await (await self.channel(sandbox_id)).write_stdin(process_id, data, eof=eof)

    async def resize_pty(self, sandbox_id: str, process_id: str, size: PtySize) -> None:
        await (await self.channel(sandbox_id)).resize_pty(process_id, size)

    async def open_port(self, sandbox_id: str, port: int) -> PortTunnel:
        return await (await self.channel(sandbox_id)).open_port(port)

    async def read_file(self, sandbox_id: str, path: str, user: str = "user") -> FileReader:
        return await (await self.channel(sandbox_id)).read_file(path, user)

    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        data: AsyncIterable[bytes],
        *,
        user: str = "user",
        mode: int = 0o644,
    ) -> FileStat:
        channel = await self.channel(sandbox_id)
        return await channel.write_file(path, data, user=user, mode=mode)

    async def watch_dir(
        self, sandbox_id: str, path: str, *, recursive: bool = False, user: str = "user"
    ) -> WatchStream:
        channel = await self.channel(sandbox_id)
        return await channel.watch_dir(path, recursive=recursive, user=user)

    async def list_dir(self, sandbox_id: str, path: str, user: str = "user") -> list[FileStat]:
        return await (await self.channel(sandbox_id)).list_dir(path, user)

    async def stat(self, sandbox_id: str, path: str, user: str = "user") -> FileStat:
        return await (await self.channel(sandbox_id)).stat(path, user)

    async def make_dir(self, sandbox_id: str, path: str, user: str = "user") -> FileStat:
        return await (await self.channel(sandbox_id)).make_dir(path, user)

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        await (await self.channel(sandbox_id)).remove(path, recursive=recursive)

    async def rename(self, sandbox_id: str, src: str, dst: str, user: str = "user") -> FileStat:
        return await (await self.channel(sandbox_id)).rename(src, dst, user)

    async def channel(self, sandbox_id: str) -> GuestChannel:
        """The sandbox's open channel, reconnecting once if it broke but QEMU lives.

        A PAUSED or HIBERNATED sandbox is resumed first (under its lock), transparently.
        """
        sandbox = self._registry.get(sandbox_id)
        asleep = (SandboxState.PAUSED, SandboxState.HIBERNATED)
        if sandbox.record.state in asleep:
            async with sandbox.lock:
                sandbox = self._registry.get(sandbox_id)
                if sandbox.record.state in asleep:
                    log.info("sandbox %s: resuming it for a guest operation", sandbox_id)
                    await self._sandboxes.switch_locked(sandbox, SandboxState.RUNNING)
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
            channel = await sandbox.connect(hello_timeout_s=self._registry.config.boot_timeout_s)
            await self._registry.life.settle_identity(sandbox)
            return channel
