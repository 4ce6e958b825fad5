"""A node's templates: the base image built (or reused) and imported into the pool."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from space.node.config import NodeConfig
from space.node.errors import NodeError, Unavailable
from space.node.images import GuestImage, build_template
from space.node.storage.btrfs import BtrfsPool, TemplateVolume

__all__ = ["Template", "prepare_template"]


@dataclass(frozen=True, slots=True)
class Template:
    image: GuestImage
    volume: TemplateVolume
    #: The smallest disk a sandbox of this template may ask for (the image's size).
    min_disk_mib: int


async def prepare_template(
    pool: BtrfsPool, config: NodeConfig, say: Callable[[str], None]
) -> Template:
    try:
        image = await asyncio.to_thread(
            build_template, "base", cache_dir=config.image_cache_dir, progress=say
        )
    except NodeError:
        raise
    except Exception as exc:
        raise Unavailable(f"building the base image failed: {exc}") from exc
    volume = await pool.import_template(
        "base", image.digest, kernel=image.kernel, initrd=image.initrd, rootfs=image.rootfs
    )
    size = volume.rootfs.stat().st_size
    return Template(image=image, volume=volume, min_disk_mib=-(-size // (1 << 20)))
