"""Ready states: a template's VM booted, its start command running, its memory saved.

Private to space.node.agent. Made once per template build and kept beside the template's
subvolume, published by a marker file written last: sandboxes of the template's shape
start from a CoW clone of it instead of booting (space.node.agent._lifecycle wakes it).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING

from space.node.agent._hidden import boot_hidden, channel_of, start_command, wait_ready, warm_up
from space.node.core.template import Template

if TYPE_CHECKING:
    from space.node.agent._registry import Registry

__all__ = ["ensure_ready", "is_ready"]


def is_ready(template: Template) -> bool:
    return template.ready_image.is_dir() and template.ready_mark.is_file()


async def ensure_ready(node: Registry, template: Template) -> Path:
    """The ready state of ``template``, made now unless it exists; returns its volume.

    Raises NodeError (the boot, the start command or the capture failed; nothing of it
    is left then).
    """
    if is_ready(template):
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
        await asyncio.to_thread(_write_mark, template.ready_mark)
    except BaseException:
        await asyncio.shield(pool.delete_template_image(template.ready_image))
        raise
    finally:
        await asyncio.shield(node.destroy(vm))
    return template.ready_image


def _write_mark(path: Path) -> None:
    """Publish what ``path`` marks: written, fsynced, with its directory."""
    with open(path, "w") as file:
        file.write("ready\n")
        file.flush()
        os.fsync(file.fileno())
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
