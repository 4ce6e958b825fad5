"""A node's templates: the base image, built (or reused) and imported into the pool, and
the templates built from specs (space.node.agent._builder), by name and tag."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from space.node.api import NodeError, SandboxSpec, TemplateInfo, Unavailable
from space.node.core.config import NodeConfig
from space.node.core.keys import NodeKeys
from space.node.images import build_template
from space.node.images._rootfs import Debootstrap
from space.node.storage.btrfs import BtrfsPool, TemplateVolume
from space.node.storage.disks import disk_bytes
from space.node.templates import ReadyCheck

__all__ = [
    "BASE",
    "READY_SHAPE",
    "Shape",
    "Template",
    "image_mib",
    "prepare_template",
    "ready_paths",
]

#: The built-in template's name; it is never built from a spec and never deleted.
BASE = "base"


@dataclass(frozen=True, slots=True)
class Shape:
    cpus: int
    memory_mib: int
    disk_mib: int

    def fits(self, spec: SandboxSpec) -> bool:
        return (spec.cpus, spec.memory_mib, spec.disk_mib) == (
            self.cpus,
            self.memory_mib,
            self.disk_mib,
        )


#: The default shape of a template's sandboxes, and so of its ready state: sandboxes of
#: exactly its template's shape start from the ready state (a memory image fixes cpus
#: and RAM, and a disk a guest wrote is never resized).
READY_SHAPE = Shape(cpus=1, memory_mib=256, disk_mib=2048)


@dataclass(frozen=True, slots=True)
class Template:
    name: str
    tag: str
    volume: TemplateVolume
    kernel_cmdline: str
    #: The smallest disk a sandbox of this template may ask for (its image's size).
    min_disk_mib: int
    #: Whether no guest ever wrote its disk image: only then may the host grow it.
    pristine: bool
    shape: Shape = READY_SHAPE
    base: str = "debian:" + Debootstrap.suite
    created_at: float = 0.0
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    start: str | None = None
    #: Polled after ``start`` before the ready state is saved (space.node.agent._ready).
    ready_check: ReadyCheck | None = None
    #: The ready state's volume (a booted VM's disk and memory), once made.
    ready: Path | None = None
    #: The gVisor ready state's volume (a started gVisor sandbox's tree and
    #: checkpoint), once made.
    gvisor_ready: Path | None = None

    @property
    def digest(self) -> str:
        return self.volume.digest

    @property
    def ready_image(self) -> Path:
        """Where the ready state lives: beside the template's own subvolume."""
        return ready_paths(self.volume)[0]

    @property
    def ready_mark(self) -> Path:
        """Written once the ready state is complete: its publication."""
        return ready_paths(self.volume)[1]

    @property
    def gvisor_ready_image(self) -> Path:
        """Where the gVisor ready state lives: beside the VM's."""
        return ready_paths(self.volume, "gvisor")[0]

    @property
    def gvisor_ready_mark(self) -> Path:
        return ready_paths(self.volume, "gvisor")[1]

    @property
    def gvisor_ready_failed(self) -> Path:
        """Written, with the reason, when making the gVisor ready state failed: not
        tried again for this build."""
        return failed_mark(self.gvisor_ready_image)

    @property
    def ready_spec(self) -> SandboxSpec:
        return SandboxSpec(
            sandbox_id="ready",
            template=f"{self.name}@{self.digest}",
            cpus=self.shape.cpus,
            memory_mib=self.shape.memory_mib,
            disk_mib=self.shape.disk_mib,
        )

    def ready_fits(self, spec: SandboxSpec) -> bool:
        """Whether a sandbox of ``spec`` can start from the ready state."""
        return self.shape.fits(spec)

    def info(self) -> TemplateInfo:
        return TemplateInfo(
            name=self.name,
            tag=self.tag,
            digest=self.digest,
            created_at=self.created_at,
            base=self.base,
            cpus=self.shape.cpus,
            memory_mib=self.shape.memory_mib,
            disk_mib=self.shape.disk_mib,
            env=dict(self.env),
            workdir=self.workdir,
            start=self.start,
            ready=self.ready is not None,
        )


async def prepare_template(
    pool: BtrfsPool, config: NodeConfig, keys: NodeKeys, say: Callable[[str], None]
) -> Template:
    try:
        image = await asyncio.to_thread(
            build_template, BASE, cache_dir=config.image_cache_dir, progress=say
        )
    except NodeError:
        raise
    except Exception as exc:
        raise Unavailable(f"building the base image failed: {exc}") from exc
    volume = await pool.import_template(
        BASE,
        image.digest,
        kernel=image.kernel,
        initrd=image.initrd,
        rootfs=image.rootfs,
        disk_passphrase=keys.disk_passphrase,
    )
    created = volume.path.stat().st_mtime
    return Template(
        name=BASE,
        tag="latest",
        volume=volume,
        kernel_cmdline=image.kernel_cmdline,
        min_disk_mib=image_mib(volume),
        pristine=True,
        created_at=created,
    )


def ready_paths(volume: TemplateVolume, guest: str = "qemu") -> tuple[Path, Path]:
    """A template's ready-state subvolume for ``guest`` and the mark that publishes
    it, beside it."""
    suffix = "ready" if guest == "qemu" else f"{guest}-ready"
    image = volume.path.with_name(f"{volume.digest}.{suffix}")
    return image, image.with_name(f"{image.name}.complete")


def failed_mark(image: Path) -> Path:
    """Beside a ready state's ``image``: why making it failed."""
    return image.with_name(f"{image.name}.failed")


def image_mib(volume: TemplateVolume) -> int:
    """The size of a template's disk (as its guest sees it), in MiB rounded up."""
    return -(-disk_bytes(volume.rootfs) // (1 << 20))
