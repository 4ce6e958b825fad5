"""Ready states: a template's VM booted, its start command running, its memory saved.

Private to space.node.agent. Made once per template build and kept beside the template's
subvolume, published by a marker file written last: sandboxes of the template's shape
start from a CoW clone of it instead of booting (space.node.agent._lifecycle wakes it).

A gVisor ready state is the same for gVisor sandboxes (issue 21): one started on the
template's tree, its start command running and ready check passed, its spawner helper
up, then checkpointed (``runsc checkpoint``) with its tree into a subvolume beside the
VM's ready state. Restoring a clone of it is about half a cold gVisor create here
(docs/benchmarks.md), and the start command's own time is not paid again.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING

from space.node.agent._gvisor_trees import boot_gvisor
from space.node.agent._hidden import (
    boot_hidden,
    channel_of,
    hidden_of,
    start_command,
    wait_ready,
    warm_up,
)
from space.node.core.capacity import Claim
from space.node.core.template import Template, ready_paths
from space.node.storage.btrfs import snapshot_subvolume
from space.node.vmm.qemu import guest_cpu

if TYPE_CHECKING:
    from space.node.agent._registry import Registry

__all__ = ["ensure_gvisor_ready", "ensure_ready", "is_ready", "vm_ready"]


def is_ready(template: Template, guest: str = "qemu", *, cpu: str | None = None) -> bool:
    """Whether ``template``'s ready state for ``guest`` is published; given ``cpu``, a
    VM's must have been booted on that CPU (its mark says which)."""
    image, mark = ready_paths(template.volume, guest)
    if not (image.is_dir() and mark.is_file()):
        return False
    return cpu is None or mark.read_text()[:256] == _mark_text(cpu)


def vm_ready(node: Registry, template: Template) -> bool:
    """Whether ``template``'s VM ready state is published and booted on the CPU this
    node's VMs get."""
    return is_ready(template, cpu=guest_cpu(node.accelerator))


def _mark_text(cpu: str | None) -> str:
    return "ready\n" if cpu is None else f"ready cpu={cpu}\n"


async def ensure_ready(node: Registry, template: Template) -> Path:
    """The ready state of ``template``, made now unless it exists; returns its volume.

    A ready state booted on another CPU than this node's VMs get (one an earlier
    version made, space.node.vmm.qemu.TCG_CPU) is made again: its guest would keep the
    routines its kernel chose for that CPU in every sandbox woken from it.

    Raises NodeError (the boot, the start command or the capture failed; nothing of it
    is left then).
    """
    if vm_ready(node, template):
        return template.ready_image
    pool = node.life.pool
    await pool.delete_template_image(template.ready_image)
    vm = await boot_hidden(
        node,
        f"ready-{template.digest[:16]}",
        template.volume,
        template.shape,
        grow=template.pristine,
        ram_in_volume=True,
    )
    try:
        await start_command(channel_of(vm), template, check=True)
        await wait_ready(channel_of(vm), template)
        await warm_up(channel_of(vm))
        await node.life.capture_image(vm, template.ready_image)
        await asyncio.to_thread(_write_mark, template.ready_mark, guest_cpu(node.accelerator))
    except BaseException:
        await asyncio.shield(pool.delete_template_image(template.ready_image))
        raise
    finally:
        await asyncio.shield(node.destroy(vm))
    return template.ready_image


async def ensure_gvisor_ready(node: Registry, template: Template) -> Path:
    """The gVisor ready state of ``template`` (see the module docstring), made now
    unless it exists; returns its volume. Raises NodeError (the start, its ready check
    or the checkpoint failed; nothing of it is left then)."""
    image, mark = template.gvisor_ready_image, template.gvisor_ready_mark
    if is_ready(template, "gvisor"):
        return image
    pool = node.life.pool
    await pool.delete_template_image(image)
    sid = f"ready-gvisor-{template.digest[:16]}"
    vm = hidden_of(node, template, sid, "gvisor")
    spec = vm.record.spec
    try:
        with node.admission.claim({sid: Claim.node_vm(spec.memory_mib, spec.disk_mib)}):
            await boot_gvisor(node, vm, template)
            await warm_up(channel_of(vm))
            await vm.save_state()  # paused, its checkpoint in its volume
            await snapshot_subvolume(vm.volume, image)
            await asyncio.to_thread(_write_mark, mark, None)
    except BaseException:
        await asyncio.shield(pool.delete_template_image(image))
        raise
    finally:
        await asyncio.shield(node.destroy(vm))
    return image


def _write_mark(path: Path, cpu: str | None) -> None:
    """Publish what ``path`` marks: written, fsynced, with its directory."""
    with open(path, "w") as file:
        file.write(_mark_text(cpu))
        file.flush()
        os.fsync(file.fileno())
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
