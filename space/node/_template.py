"""A node's templates: the base image built (or reused) and imported into the pool."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from space.node.config import NodeConfig
from space.node.errors import NodeError, Unavailable
from space.node.images import GuestImage, build_template
from space.node.interface import SandboxSpec
from space.node.storage.btrfs import BtrfsPool, TemplateVolume

__all__ = ["READY_SHAPE", "Template", "prepare_template"]


#: The shape of a template's ready state: sandboxes of exactly this shape start from
#: it (a memory image fixes cpus and RAM, and a disk a guest wrote is never resized).
READY_SHAPE = {"cpus": 1, "memory_mib": 256, "disk_mib": 2048}


@dataclass(frozen=True, slots=True)
class Template:
    image: GuestImage
    volume: TemplateVolume
    #: The smallest disk a sandbox of this template may ask for (the image's size).
    min_disk_mib: int
    #: The ready state's volume (a booted VM's disk and memory), once made.
    ready: Path | None = None

    @property
    def ready_image(self) -> Path:
        """Where the ready state lives: beside the template's own subvolume."""
        return self.volume.path.with_name(f"{self.volume.digest}.ready")

    @property
    def ready_mark(self) -> Path:
        """Written once the ready state is complete: its publication."""
        return self.volume.path.with_name(f"{self.volume.digest}.ready.complete")

    @property
    def ready_spec(self) -> SandboxSpec:
        shape = READY_SHAPE
        return SandboxSpec(
            sandbox_id="ready",
            template=self.volume.name,
            cpus=shape["cpus"],
            memory_mib=shape["memory_mib"],
            disk_mib=shape["disk_mib"],
        )

    def ready_fits(self, spec: SandboxSpec) -> bool:
        """Whether a sandbox of ``spec`` can start from the ready state."""
        return all(getattr(spec, key) == value for key, value in READY_SHAPE.items())


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
