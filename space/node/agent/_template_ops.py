"""The template operations of a node: builds, listing, deletion, ready states, pools.

Private to space.node.agent.node: ``Node`` inherits them. Every method raises
space.node.api.errors leaves only.
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterable, Callable
from dataclasses import replace
from pathlib import Path

from space.node.agent._builds import Builds
from space.node.agent._catalog import Catalog
from space.node.agent._lifecycle import Lifecycle, Registry
from space.node.agent._pool import WarmPool, hand_over, make_pool_vm
from space.node.agent._ready import ensure_ready
from space.node.api import BuildStream, NodeError, TemplateInfo
from space.node.core.config import NodeConfig
from space.node.core.sandbox import LiveSandbox
from space.node.core.state import StateStore
from space.node.core.template import Template, ready_paths
from space.node.storage.btrfs import BtrfsPool, TemplateVolume

__all__ = ["TemplateOps"]


class TemplateOps(ABC):
    """Templates of the node: built from specs, each with a ready state and a pool."""

    config: NodeConfig
    pool: BtrfsPool
    _catalog: Catalog
    _builds: Builds
    _life: Lifecycle
    _store: StateStore
    #: Warm pools by template digest.
    _pools: dict[str, WarmPool]
    #: Bounds the VMs starting at once (a pool hit starts none).
    _starts: asyncio.Semaphore

    @abstractmethod
    def _registry(self) -> Registry: ...

    @abstractmethod
    async def _destroy(self, sandbox: LiveSandbox) -> None: ...

    async def build_template(self, context: AsyncIterable[bytes]) -> BuildStream:
        """Build a template from a context archive; see NodeService. The build runs in
        the background, one at a time per node; its log is the returned stream."""
        return await self._builds.start(context)

    async def list_templates(self) -> list[TemplateInfo]:
        return [template.info() for template in self._catalog.tagged()]

    async def delete_template(self, ref: str) -> None:
        """Untag ``ref``; a build no tag names any more loses its pool, ready state and
        subvolume. Sandboxes made from it keep running (their volumes are their own)."""
        for orphan in self._catalog.remove(ref):
            await self._drop_build(orphan)

    async def _drop_build(self, template: Template) -> None:
        warm = self._pools.pop(template.digest, None)
        if warm is not None:
            await warm.close()
        self._catalog.set_ready(template.digest, None)
        await self._delete_build_files(template.volume)

    async def _delete_build_files(self, volume: TemplateVolume) -> None:
        """A build's ready state (its mark first: unpublished) and its subvolume."""
        ready, mark = ready_paths(volume)
        mark.unlink(missing_ok=True)
        await self.pool.delete_template_image(ready)
        await self.pool.delete_template(volume)

    async def _remove_untagged_templates(self, say: Callable[[str], None]) -> None:
        """Delete template subvolumes no tag names: builds cut short or failed."""
        kept = {(t.name, t.digest) for t in self._catalog.builds()}
        for volume in self.pool.templates():
            if (volume.name, volume.digest) not in kept:
                say(f"removing template {volume.name}@{volume.digest[:12]}: no tag names it")
                await self._delete_build_files(volume)

    async def _ready_at_start(self, template: Template, say: Callable[[str], None]) -> None:
        """Make (or find) a template's ready state and start its pool; a failure is
        logged and its sandboxes boot instead."""
        if self.config.ready_state and not template.ready_mark.is_file():
            say(f"template {template.name}: making its ready state (one boot)")
        try:
            await self._make_ready(template)
        except NodeError as exc:
            say(f"template {template.name}: no ready state ({exc}); sandboxes will boot")

    async def _make_ready(self, template: Template) -> Template:
        """Give ``template`` its ready state (made once per build) and its warm pool."""
        if not self.config.ready_state:
            return template
        path = await ensure_ready(self._registry(), template)
        self._catalog.set_ready(template.digest, path)
        ready = replace(template, ready=path)
        self._start_pool(ready)
        return ready

    def _start_pool(self, template: Template) -> None:
        config = self.config
        if config.warm_pool_max <= 0 or template.ready is None or template.digest in self._pools:
            return
        warm = WarmPool(
            f"{template.name}:{template.tag}" if template.tag else template.name,
            make=lambda: make_pool_vm(self._registry(), template),
            destroy=self._destroy,
            min_size=config.warm_pool_min,
            max_size=config.warm_pool_max,
        )
        self._pools[template.digest] = warm
        warm.start()

    async def _from_ready_state(self, sandbox: LiveSandbox, ready: Path) -> None:
        """A pool VM handed over if one waits, else a clone of the ready state woken."""
        warm = self._pools.get(sandbox.record.template_digest)
        pooled = warm.take() if warm is not None else None
        if pooled is None:
            async with self._starts:
                await self._life.create_from_image(sandbox, ready)
            return
        try:
            await hand_over(self._registry(), pooled, sandbox)
        except BaseException:  # the caller destroys the sandbox, VM included
            with contextlib.suppress(NodeError):
                await self.pool.delete_sandbox_volume(pooled.record.volume)
            self._store.remove(pooled.sandbox_id)
            raise
