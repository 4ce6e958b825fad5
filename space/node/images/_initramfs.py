"""The guest initramfs: static busybox, the virtio modules and an /init script.

Packed as a newc cpio archive written here in Python (no ``cpio``/``find`` pipeline),
with every timestamp zero and owner root, so the same inputs give the same bytes.
"""

from __future__ import annotations

import gzip
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ._command import ImageBuildError

__all__ = ["BUSYBOX", "BUSYBOX_APPLETS", "CpioEntry", "init_script", "pack_newc", "write_initramfs"]

#: Busybox from Debian's busybox-static package on the host (statically linked).
BUSYBOX = Path("/bin/busybox")

#: Applets the /init script calls; each becomes a symlink to /bin/busybox.
BUSYBOX_APPLETS = (
    "sh",
    "mount",
    "insmod",
    "sleep",
    "usleep",
    "poweroff",
    "switch_root",
)

_DIRS = ("bin", "dev", "lib", "lib/modules", "newroot", "proc", "sys")


@dataclass(frozen=True)
class CpioEntry:
    """One archive member: ``mode`` includes the file type bits; ``data`` is the content
    (the target for a symlink); ``rdev`` is (major, minor) for device nodes."""

    name: str
    mode: int
    data: bytes = b""
    rdev: tuple[int, int] = (0, 0)


def init_script(modules: Sequence[str]) -> str:
    """The initramfs /init for the given module load order."""
    for name in modules:
        if not name.replace("_", "").isalnum():
            raise ImageBuildError(f"unexpected kernel module name {name!r}")
    template = resources.files("space.node.images").joinpath("files/initramfs-init.sh").read_text()
    return template.replace("@MODULES@", " ".join(modules))


def write_initramfs(
    dest: Path, *, busybox: Path, module_files: Sequence[Path], script: str, compress: bool
) -> None:
    """Write the initramfs to ``dest``: gzip'd newc cpio if ``compress``, else plain.

    ``module_files`` are uncompressed ``<name>.ko`` files, stored under /lib/modules.
    Raises ImageBuildError if an input cannot be read.
    """
    try:
        entries = [CpioEntry(d, stat.S_IFDIR | 0o755) for d in _DIRS]
        entries += [
            CpioEntry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1)),
            CpioEntry("dev/null", stat.S_IFCHR | 0o666, rdev=(1, 3)),
            CpioEntry("bin/busybox", stat.S_IFREG | 0o755, busybox.read_bytes()),
            CpioEntry("init", stat.S_IFREG | 0o755, script.encode()),
        ]
        entries += [
            CpioEntry(f"bin/{a}", stat.S_IFLNK | 0o777, b"busybox") for a in BUSYBOX_APPLETS
        ]
        entries += [
            CpioEntry(f"lib/modules/{m.name}", stat.S_IFREG | 0o644, m.read_bytes())
            for m in module_files
        ]
        archive = pack_newc(entries)
        dest.write_bytes(gzip.compress(archive, compresslevel=6, mtime=0) if compress else archive)
    except OSError as exc:
        raise ImageBuildError(f"cannot write initramfs {dest}: {exc}") from exc


def pack_newc(entries: Sequence[CpioEntry]) -> bytes:
    """Serialise ``entries`` as a newc ("070701") cpio archive with its trailer."""
    out = bytearray()
    for ino, entry in enumerate(entries, start=1):
        _append(out, ino, entry)
    _append(out, 0, CpioEntry("TRAILER!!!", 0))
    return bytes(out)


def _append(out: bytearray, ino: int, entry: CpioEntry) -> None:
    name = entry.name.encode() + b"\0"
    nlink = 2 if stat.S_ISDIR(entry.mode) else 1
    fields = (ino, entry.mode, 0, 0, nlink, 0, len(entry.data), 0, 0, *entry.rdev, len(name), 0)
    out += b"070701" + "".join(f"{f:08x}" for f in fields).encode() + name
    out += b"\0" * (-len(out) % 4)
    out += entry.data
    out += b"\0" * (-len(out) % 4)
