"""Templates' directory trees for gVisor sandboxes (issue 21): made on a template's
first gVisor sandbox, once per digest, and removed with the template; and the boot of
a gVisor sandbox on one (a create's, a warm pool's).

Private to space.node.agent. A tree is ``<pool>/gvisor/<digest>`` (read-only, root's;
space.node.vmm.gvisor_tree); each gVisor sandbox's volume is a snapshot of it, which
lives on when the tree goes. The base template's tree goes when the base image
changes (its digest is then no template's): ``remove_stale_trees`` at the node's start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from space.node.agent._hidden import start_command, wait_ready
from space.node.agent._registry import Registry
from space.node.api import SandboxState
from space.node.core.capacity import volume_limit_mib
from space.node.core.sandbox import LiveSandbox
from space.node.core.template import Template
from space.node.vmm.gvisor_tree import ensure_tree

__all__ = ["boot_gvisor", "drop_tree", "remove_stale_trees", "tree_for"]

log = logging.getLogger(__name__)


async def tree_for(registry: Registry, template: Template) -> Path:
    """The tree of ``template``, made now if it is not yet (see ensure_tree for what
    is raised; nothing is left of a failed attempt)."""
    tree = registry.pool.tree_path(template.digest)
    async with registry.lock(f"gvisor-tree/{template.digest}"):
        started = time.monotonic()
        made = await ensure_tree(
            registry.run_root,
            tree,
            _image_of(registry, template),
            passphrase=registry.keys.disk_passphrase,
        )
        if made:
            log.info(
                "gVisor tree of template %s@%s made in %.2f s",
                template.name, template.digest[:12], time.monotonic() - started,
            )  # fmt: skip
    return tree


def _image_of(registry: Registry, template: Template) -> Path:
    """The base image's plain copy in the image cache if it is there (no decryption),
    else the template's own disk."""
    plain = registry.config.image_cache_dir / template.digest / "rootfs.img"
    if template.pristine and plain.is_file():
        return plain
    return template.volume.rootfs


async def drop_tree(registry: Registry, digest: str) -> None:
    """Delete the tree of template ``digest`` (its sandboxes keep their volumes);
    idempotent."""
    async with registry.lock(f"gvisor-tree/{digest}"):
        await registry.pool.delete_tree(digest)


async def remove_stale_trees(registry: Registry, say: Callable[[str], None]) -> None:
    """At the node's start: delete the trees of digests no template has (a deleted
    template's whose deletion was cut short, or an older base image's) and whatever
    an unpacking cut short left."""
    kept = {template.digest for template in registry.catalog.builds()}
    for digest in registry.pool.tree_digests():
        if digest not in kept:
            say(f"removing the gVisor tree of {digest[:12]}: no template has it")
            await drop_tree(registry, digest)
        else:
            await registry.pool.delete_unpacking(digest)


async def boot_gvisor(registry: Registry, sandbox: LiveSandbox, template: Template) -> None:
    """Start a gVisor sandbox on a clone of its template's tree; RUNNING once spaced
    said hello, the template's start command runs and its ready check, if it has one,
    passed: what a VM woken from the template's ready state has (a memory image gVisor
    has no use for), reached by running them at create instead."""
    config = registry.config
    registry.store.save(sandbox.record)  # CREATING, before anything exists to clean up
    tree = await tree_for(registry, template)
    await sandbox.launch_gvisor(tree=tree, run_root=registry.run_root)
    # Room for its files and for a saved state (hibernate, snapshots), as a VM's.
    spec = sandbox.record.spec
    await registry.pool.limit(
        sandbox.volume, volume_limit_mib(spec.disk_mib, spec.memory_mib) << 20
    )
    registry.store.save(sandbox.mark(SandboxState.CREATING))  # now with the pid
    channel = await sandbox.connect(hello_timeout_s=config.boot_timeout_s)
    await start_command(channel, template, check=False)
    await wait_ready(channel, template)
    registry.store.save(sandbox.mark(SandboxState.RUNNING))
