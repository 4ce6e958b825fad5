"""The ``base`` template: what goes into its three artifacts, and how they are built.

Every input of every artifact is hashed into the template's digest, so a cache entry
is reused exactly when nothing that went into it changed: the kernel package (version
and .deb checksum), the busybox binary, the initramfs script and module list, the
debootstrap inputs, the guest daemon sources, the files we add to the tree, the
kernel command line and BUILDER_VERSION (bump it whenever this code changes what it
produces).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ._cache import ensure_entry, read_manifest, remove_tree
from ._command import ImageBuildError
from ._initramfs import BUSYBOX, BUSYBOX_APPLETS, init_script, write_initramfs
from ._kernel import (
    BOOT_MODULES,
    KernelPackage,
    extract_kernel,
    install_modules,
    module_load_order,
    resolve_kernel_package,
)
from ._rootfs import (
    ROOTFS_SIZE_BYTES,
    Debootstrap,
    GuestSource,
    apt_mirror,
    build_rootfs_image,
    ensure_debootstrap,
    guest_sources,
)

__all__ = ["BUILDER_VERSION", "KERNEL_CMDLINE", "TemplateInputs", "build_entry", "inputs_for"]

BUILDER_VERSION = "1"

#: What the VMM passes with -append. ttyS0 is the console the node logs; panic=-1
#: reboots at once on a panic (with QEMU's -no-reboot that ends the VM instead of
#: hanging); quiet keeps the slow emulated serial port from pacing the boot.
KERNEL_CMDLINE = "console=ttyS0 panic=-1 quiet"

# Measured under TCG (2026-11-30): switch_root after 2.3-2.7 s wall with the 2.3 MB
# plain archive and with its 1.1 MB gzip alike, so we skip the emulated decompression.
_COMPRESS_INITRD = False

_ASSETS = ("initramfs-init.sh", "space-init.sh", "hosts")
TEMPLATES = ("base",)


@dataclass(frozen=True)
class TemplateInputs:
    """Everything one template's artifacts are made from (see the module docstring)."""

    name: str
    kernel: KernelPackage
    busybox_sha256: str
    debootstrap: Debootstrap
    sources: tuple[GuestSource, ...]
    assets_sha256: dict[str, str] = field(hash=False)

    def digest(self) -> str:
        """Hex sha256 over all inputs; equal digests mean interchangeable artifacts."""
        description = {
            "builder_version": BUILDER_VERSION,
            "template": self.name,
            "kernel": [self.kernel.name, self.kernel.version, self.kernel.sha256],
            "busybox": self.busybox_sha256,
            "applets": list(BUSYBOX_APPLETS),
            "modules": list(BOOT_MODULES),
            "compress_initrd": _COMPRESS_INITRD,
            "debootstrap": self.debootstrap.key(),
            "sources": [[s.relpath, hashlib.sha256(s.data).hexdigest()] for s in self.sources],
            "assets": self.assets_sha256,
            "cmdline": KERNEL_CMDLINE,
            "rootfs_size": ROOTFS_SIZE_BYTES,
        }
        return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()


def inputs_for(name: str) -> TemplateInputs:
    """Collect the inputs of template ``name`` (cheap: apt-cache once, then hashes).

    Raises TemplateNotFound for an unknown name and ImageBuildError if an input is
    unavailable (no busybox, apt does not know the kernel).
    """
    from . import TemplateNotFound  # the public module defines the public error

    if name not in TEMPLATES:
        raise TemplateNotFound(f"unknown template {name!r} (known: {', '.join(TEMPLATES)})")
    try:
        busybox = hashlib.sha256(BUSYBOX.read_bytes()).hexdigest()
        sources = tuple(guest_sources())
    except OSError as exc:
        raise ImageBuildError(f"cannot read an input of template {name!r}: {exc}") from exc
    files = resources.files("space.node.images")
    assets = {
        a: hashlib.sha256(files.joinpath(f"files/{a}").read_bytes()).hexdigest() for a in _ASSETS
    }
    return TemplateInputs(
        name=name,
        kernel=resolve_kernel_package(),
        busybox_sha256=busybox,
        debootstrap=Debootstrap(mirror=apt_mirror()),
        sources=sources,
        assets_sha256=assets,
    )


def build_entry(inputs: TemplateInputs, cache_dir: Path, progress: Callable[[str], None]) -> Path:
    """The cache directory holding vmlinuz, initrd.img and rootfs.img for ``inputs``."""
    digest = inputs.digest()
    entry = cache_dir / digest
    if read_manifest(entry, digest) is not None:
        return entry

    def build(tmp: Path) -> dict[str, object]:
        work = tmp / "work"
        work.mkdir()
        try:
            modules = _build_boot(inputs, tmp, work, progress)
            base = ensure_debootstrap(cache_dir / "debootstrap", inputs.debootstrap, progress)
            build_rootfs_image(
                base,
                tmp / "rootfs.img",
                workdir=work,
                sources=list(inputs.sources),
                progress=progress,
            )
        finally:
            remove_tree(work)
        return {
            "template": inputs.name,
            "builder_version": BUILDER_VERSION,
            "kernel_package": [inputs.kernel.name, inputs.kernel.version],
            "modules": modules,
            "kernel_cmdline": KERNEL_CMDLINE,
            "debootstrap": inputs.debootstrap.key(),
        }

    return ensure_entry(cache_dir, digest, build)


def _build_boot(
    inputs: TemplateInputs, tmp: Path, work: Path, progress: Callable[[str], None]
) -> list[str]:
    kernel = extract_kernel(inputs.kernel, work, progress)
    shutil.copyfile(kernel.vmlinuz, tmp / "vmlinuz")
    names = install_modules(module_load_order(kernel.module_dir), work / "modules")
    progress(f"packing initramfs ({len(names)} modules: {' '.join(names)})")
    if hashlib.sha256(BUSYBOX.read_bytes()).hexdigest() != inputs.busybox_sha256:
        raise ImageBuildError(f"{BUSYBOX} changed while the image was being built")
    write_initramfs(
        tmp / "initrd.img",
        busybox=BUSYBOX,
        module_files=[work / "modules" / f"{n}.ko" for n in names],
        script=init_script(names),
        compress=_COMPRESS_INITRD,
    )
    return names
