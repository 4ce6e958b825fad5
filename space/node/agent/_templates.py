"""The templates of a node: builds, listing, deletion, and each build's ready state.

``Node`` delegates the template calls of NodeService here and asks, at start, to remove
builds no tag names and to make each build's ready state (and so start its warm pool,
space.node.agent._pool). Every method raises space.node.api errors only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterable, Callable
from dataclasses import replace

from space.node.agent._builder import Planned, build_layers
from space.node.agent._builds import Builds
from space.node.agent._catalog import Build
from space.node.agent._gvisor_trees import drop_tree
from space.node.agent._pool import Pools
from space.node.agent._ready import ensure_gvisor_ready, ensure_ready, vm_ready
from space.node.agent._registry import Registry
from space.node.api import GUEST_TYPES, BuildStream, InsufficientCapacity, NodeError, TemplateInfo
from space.node.core.template import Template, failed_mark, ready_paths
from space.node.storage.btrfs import TemplateVolume

__all__ = ["Templates"]

log = logging.getLogger(__name__)


class Templates:
    """Templates of the node: built from specs, each with a ready state and a pool."""

    def __init__(self, registry: Registry, pools: Pools) -> None:
        self._registry = registry
        self._pools = pools
        #: The node's templates by name, tag and digest (public: bench/bench_create.py
        #: takes the base template's ready state away to time creates without it).
        self.catalog = registry.catalog
        config = registry.config
        self._builds = Builds(
            registry.catalog,
            config.data_dir / "builds",
            self._build,
            slots=config.build_slots,
            queued_per_owner=config.queued_builds_per_tenant,
        )

    async def build_template(self, context: AsyncIterable[bytes]) -> BuildStream:
        """Build a template from a context archive; see NodeService. The build runs in
        the background, ``build_slots`` at a time per node shared fairly by tenant
        (space.node.agent._build_slots); its log is the returned stream."""
        return await self._builds.start(context)

    async def list_templates(self) -> list[TemplateInfo]:
        return [template.info() for template in self.catalog.tagged()]

    async def delete_template(self, ref: str) -> None:
        """Untag ``ref``; a build no tag names any more loses its pool, ready state,
        gVisor tree and subvolume. Sandboxes made from it keep running (their volumes
        are their own)."""
        for orphan in self.catalog.remove(ref):
            await self._drop_build(orphan)

    async def close(self) -> None:
        """Cancel running builds (their build VMs are removed; tags do not move)."""
        await self._builds.close()

    async def remove_untagged(self, say: Callable[[str], None]) -> None:
        """Delete template subvolumes no tag names: builds cut short or failed."""
        kept = {(t.name, t.digest) for t in self.catalog.builds()}
        for volume in self._registry.pool.templates():
            if (volume.name, volume.digest) not in kept:
                say(f"removing template {volume.name}@{volume.digest[:12]}: no tag names it")
                await self._delete_build_files(volume)

    async def ready_at_start(self, template: Template, say: Callable[[str], None]) -> None:
        """Make (or find) a template's ready state and start its pool; a failure is
        logged and its sandboxes boot instead."""
        if self._registry.config.ready_state and not vm_ready(self._registry, template):
            say(f"template {template.name}: making its ready state (one boot)")
        try:
            await self._make_ready(template)
        except NodeError as exc:
            say(f"template {template.name}: no ready state ({exc}); sandboxes will boot")

    async def adopt(
        self, name: str, tags: list[str], build: Build, say: Callable[[str], None]
    ) -> Template:
        """Take a build received from another node (space.node.agent._shipping, whose
        subvolume is published already): make its ready state here (a failure is said,
        and its sandboxes boot), then point ``tags`` (at least one) at it; a build no
        tag names any more goes, as after a build."""
        await self.ready_at_start(self.catalog.template(name, tags[0], build), say)
        template, orphans = self.catalog.add(name, tags[0], build, more_tags=tuple(tags[1:]))
        for orphan in orphans:
            await self._drop_build(orphan)
        return template

    async def _make_ready(self, template: Template) -> Template:
        """Give ``template`` its ready states (made once per build) and its warm pool
        (a gVisor pool, where that is the node's default guest type, needs no ready
        state: it starts first, whatever becomes of the ready states). The gVisor one,
        where the node offers gVisor, comes first (seconds, against a VM's tens); if
        it fails, which the VM's ready check passing does not rule out, that is
        logged and gVisor sandboxes of the template boot."""
        registry = self._registry
        self._pools.start(template)
        if not registry.config.ready_state:
            return template
        if "gvisor" in registry.guest_types:
            template = await self._make_gvisor_ready(template)
        path = await ensure_ready(registry, template)
        self.catalog.set_ready(template.digest, path)
        ready = replace(template, ready=path)
        self._pools.start(ready)
        return ready

    async def _make_gvisor_ready(self, template: Template) -> Template:
        """``template`` with its gVisor ready state, or as it is if making it fails.
        A failure but the node's lack of room is remembered beside it (with its
        reason), so that a node's later starts do not wait for a ready check that
        cannot pass under gVisor again; a new build tries anew."""
        failed = template.gvisor_ready_failed
        if await asyncio.to_thread(failed.is_file):
            return template
        try:
            image = await ensure_gvisor_ready(self._registry, template)
        except NodeError as exc:
            log.warning("template %s: no gVisor ready state: %s", template.name, exc)
            if not isinstance(exc, InsufficientCapacity):
                await asyncio.to_thread(failed.write_text, f"{exc}\n")
            return template
        self.catalog.set_ready(template.digest, image, "gvisor")
        return replace(template, gvisor_ready=image)

    async def _build(self, planned: Planned, say: Callable[[str], None]) -> Template:
        """The body of a build holding its slot: layers, the template's subvolume, its
        ready state, and only then the tag (whose previous build, if no other tag names
        it, goes)."""
        volume = await build_layers(self._registry, planned, say)
        spec = planned.spec
        # No disk step on the pristine base: the template is the base's image, grown
        # here to its disk (as a build VM would have), since a built template's disk
        # is never grown after.
        base = planned.base
        grow = planned.shape.disk_mib if base.pristine and volume == base.volume else None
        pool = self._registry.pool
        await pool.publish_template(spec.name, planned.digest, volume, grow_mib=grow)
        build = planned.build_record(time.time())
        say(f"making the ready state ({planned.shape.cpus} cpu, {planned.shape.memory_mib} MiB)")
        made = self.catalog.template(spec.name, spec.tag, build)
        try:
            await self._make_ready(made)
        except BaseException:
            # Its ready state failed (a ready check that never passed) or the build was
            # cut short: the build goes (a pool a gVisor node started, its gVisor ready
            # state and tree, its subvolume) unless a tag names it already.
            tagged = {(t.name, t.digest) for t in self.catalog.builds()}
            if (spec.name, planned.digest) not in tagged:
                await asyncio.shield(self._drop_build(made))
            raise
        template, orphans = self.catalog.add(spec.name, spec.tag, build)
        for orphan in orphans:
            await self._drop_build(orphan)
        return template

    async def discard(self, template: Template) -> None:
        """Delete a build no tag names (its pool, ready state and subvolume): one
        received whose adoption failed. Idempotent."""
        await self._drop_build(template)

    async def _drop_build(self, template: Template) -> None:
        await self._pools.drop(template.digest)
        for guest in GUEST_TYPES:
            self.catalog.set_ready(template.digest, None, guest)
        await drop_tree(self._registry, template.digest)
        await self._delete_build_files(template.volume)

    async def _delete_build_files(self, volume: TemplateVolume) -> None:
        """A build's ready states (each mark first: unpublished) and its subvolume."""
        for guest in GUEST_TYPES:
            ready, mark = ready_paths(volume, guest)
            mark.unlink(missing_ok=True)
            failed_mark(ready).unlink(missing_ok=True)
            await self._registry.pool.delete_template_image(ready)
        await self._registry.pool.delete_template(volume)
