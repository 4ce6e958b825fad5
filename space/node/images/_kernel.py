"""The guest kernel: Debian's cloud kernel package, fetched and unpacked, never installed.

``linux-image-cloud-amd64`` is a metapackage; the versioned package it depends on holds
/boot/vmlinuz-* and the modules. We ``apt-get download`` that package and unpack it with
``dpkg-deb -x`` into a scratch directory, so the host's own kernel setup is untouched.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import lzma
import os
import re
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from ._command import ImageBuildError, run_command

__all__ = [
    "BOOT_MODULES",
    "KERNEL_METAPACKAGE",
    "ExtractedKernel",
    "KernelPackage",
    "extract_kernel",
    "install_modules",
    "module_load_order",
    "resolve_kernel_package",
]

KERNEL_METAPACKAGE = "linux-image-cloud-amd64"

#: Modules the initramfs needs, in a load order measured to boot under QEMU
#: (docs: shared/DESIGN.md, "Facts about these machines"). Each is either built into
#: the kernel (then skipped) or a module; dependencies from modules.dep are added ahead.
BOOT_MODULES = (
    "virtio_ring",
    "virtio",
    "virtio_pci_legacy_dev",
    "virtio_pci_modern_dev",
    "virtio_pci",
    "virtio_console",
    # The sandbox's NIC (virtio-net-pci). Its dependencies net_failover and failover come
    # from modules.dep; a guest without a NIC loads it anyway and simply has no eth0.
    "virtio_net",
    "virtio_blk",
    # ext4 is built into Debian's cloud kernel; if a kernel ships it as a module it is
    # loaded (with its dependencies and the checksum driver it asks for) from here.
    "crc32c_generic",
    "ext4",
)
# Loaded only when ext4 itself is a module: ext4 requests crc32c through the crypto
# API at mount time, which modules.dep does not record.
_EXT4_ONLY = frozenset({"crc32c_generic"})

#: Where apt's answer is remembered across processes (see resolve_kernel_package).
APT_MEMO_FILE = Path("/var/cache/space/apt-kernel.json")
_APT_MAX_BYTES = 256 * 1024
_APT_ENV = {"LC_ALL": "C"}  # on top of run_command's child_environment()


@dataclasses.dataclass(frozen=True)
class KernelPackage:
    """The versioned kernel package as apt knows it (``sha256`` of the .deb)."""

    name: str
    version: str
    sha256: str


@dataclasses.dataclass(frozen=True)
class ExtractedKernel:
    """An unpacked kernel package: its vmlinuz and its module tree."""

    release: str
    vmlinuz: Path
    module_dir: Path


_resolve_lock = threading.Lock()
_resolved: dict[tuple[str, int], KernelPackage] = {}


def resolve_kernel_package(
    metapackage: str = KERNEL_METAPACKAGE, *, memo_file: Path | None = APT_MEMO_FILE
) -> KernelPackage:
    """Ask apt which kernel package ``metapackage`` pulls in today.

    apt-cache takes about 0.7 s a call here (its binary cache is disabled), so the
    answer is kept in memory and in ``memo_file`` (best effort) until apt's package
    lists change: the key is the lists directory's mtime, which ``apt-get update``
    bumps. Raises ImageBuildError if apt does not know the package.
    """
    key = (metapackage, _apt_lists_mtime_ns())
    with _resolve_lock:
        if key not in _resolved:
            memo = _read_memo(memo_file, key)
            _resolved[key] = memo or _query_apt(metapackage)
            if memo is None:
                _write_memo(memo_file, key, _resolved[key])
        return _resolved[key]


def _read_memo(memo_file: Path | None, key: tuple[str, int]) -> KernelPackage | None:
    if memo_file is None:
        return None
    try:
        data = json.loads(memo_file.read_text())
        if data["key"] == list(key):
            return KernelPackage(**data["package"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write_memo(memo_file: Path | None, key: tuple[str, int], package: KernelPackage) -> None:
    if memo_file is None:
        return
    data = {"key": list(key), "package": dataclasses.asdict(package)}
    tmp = memo_file.with_name(f".{memo_file.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data))
        os.replace(tmp, memo_file)
    except OSError:
        tmp.unlink(missing_ok=True)  # a memo is an optimisation only


def _apt_lists_mtime_ns() -> int:
    try:
        return os.stat("/var/lib/apt/lists").st_mtime_ns
    except OSError:
        return 0


def _query_apt(metapackage: str) -> KernelPackage:
    depends = _apt_output(["apt-cache", "depends", metapackage])
    match = re.search(r"^\s*Depends:\s*(linux-image-\S+)", depends, re.MULTILINE)
    if match is None:
        raise ImageBuildError(
            f"apt does not say which kernel {metapackage} depends on (run apt-get update?)",
            command=["apt-cache", "depends", metapackage],
            output_tail=depends[-2000:],
        )
    name = match.group(1)
    show = _apt_output(["apt-cache", "show", "--no-all-versions", name])
    fields = dict(re.findall(r"^(Version|SHA256):\s*(\S+)", show, re.MULTILINE))
    if "Version" not in fields or "SHA256" not in fields:
        raise ImageBuildError(
            f"apt has no version or checksum for {name}",
            command=["apt-cache", "show", name],
            output_tail=show[-2000:],
        )
    return KernelPackage(name=name, version=fields["Version"], sha256=fields["SHA256"])


def _apt_output(argv: list[str]) -> str:
    # apt-cache's answers here are a few KiB; refuse to parse a truncated one.
    out = run_command(argv, timeout_s=60, env=_APT_ENV, keep_bytes=_APT_MAX_BYTES)
    if len(out.encode()) >= _APT_MAX_BYTES - 1024:
        raise ImageBuildError("apt-cache answered more than expected", command=argv)
    return out


def extract_kernel(
    package: KernelPackage, workdir: Path, progress: Callable[[str], None]
) -> ExtractedKernel:
    """Download ``package`` into ``workdir``, check its sha256 and unpack it there.

    Raises ImageBuildError if apt cannot fetch it, the checksum differs from what apt's
    lists promised (the digest was computed from those) or the package has no kernel.
    """
    progress(f"downloading kernel package {package.name} {package.version}")
    download = workdir / "download"
    download.mkdir()
    argv = ["apt-get", "download", f"{package.name}={package.version}"]
    run_command(argv, timeout_s=600, cwd=download, env=_APT_ENV)
    debs = list(download.glob("*.deb"))
    if len(debs) != 1:
        raise ImageBuildError(f"apt-get download left {len(debs)} .deb files", command=argv)
    if _sha256_file(debs[0]) != package.sha256:
        raise ImageBuildError(f"{debs[0].name}: sha256 differs from apt's package lists")
    progress("unpacking kernel package")
    root = workdir / "kernel"
    run_command(["dpkg-deb", "-x", str(debs[0]), str(root)], timeout_s=300)
    return _locate(root)


def _locate(root: Path) -> ExtractedKernel:
    images = sorted((root / "boot").glob("vmlinuz-*"))
    if len(images) != 1:
        raise ImageBuildError(f"kernel package holds {len(images)} vmlinuz files, expected 1")
    release = images[0].name.removeprefix("vmlinuz-")
    for base in (root / "lib" / "modules", root / "usr" / "lib" / "modules"):
        if (base / release).is_dir():
            module_dir = base / release
            break
    else:
        raise ImageBuildError(f"kernel package has no modules for {release}")
    if not (module_dir / "modules.dep").exists():
        # The package leaves modules.dep to depmod in its postinst, which we never run.
        run_command(["depmod", "-b", str(root), release], timeout_s=120)
    return ExtractedKernel(release=release, vmlinuz=images[0], module_dir=module_dir)


def module_load_order(module_dir: Path, wanted: Sequence[str] = BOOT_MODULES) -> list[Path]:
    """Module files to insmod, dependencies first, for the ``wanted`` module names.

    Names built into the kernel (modules.builtin) are skipped; ``crc32c_generic`` is
    kept only when ext4 is a module. Raises ImageBuildError for a wanted module that is
    neither built in nor shipped.
    """
    builtin = {_module_name(line) for line in _lines(module_dir / "modules.builtin")}
    deps: dict[str, list[str]] = {}
    paths: dict[str, str] = {}
    for line in _lines(module_dir / "modules.dep"):
        target, _, rest = line.partition(":")
        name = _module_name(target)
        paths[name] = target
        deps[name] = [_module_name(d) for d in rest.split()]
    ext4_is_module = "ext4" in paths
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order or name in builtin:
            return
        if name not in paths:
            raise ImageBuildError(f"kernel module {name} is neither built in nor shipped")
        # modules.dep lists the deepest dependency last; modprobe loads from the end.
        for dep in reversed(deps[name]):
            visit(dep)
        order.append(name)

    for name in wanted:
        if name in _EXT4_ONLY and not ext4_is_module:
            continue
        visit(name)
    return [module_dir / paths[name] for name in order]


def install_modules(modules: Sequence[Path], dest: Path) -> list[str]:
    """Copy ``modules`` into ``dest`` as plain ``<name>.ko``; return the names in order.

    Busybox insmod reads only uncompressed modules, so .ko.xz and .ko.zst are
    decompressed here, at build time.
    """
    dest.mkdir(parents=True, exist_ok=True)
    names = []
    for src in modules:
        name = _module_name(src.name)
        target = dest / f"{name}.ko"
        if src.name.endswith(".ko.xz"):
            target.write_bytes(lzma.decompress(src.read_bytes()))
        elif src.name.endswith(".ko.zst"):
            run_command(["zstd", "-q", "-d", "-f", "-o", str(target), str(src)], timeout_s=60)
        elif src.name.endswith(".ko"):
            shutil.copyfile(src, target)
        else:
            raise ImageBuildError(f"unsupported kernel module format: {src.name}")
        names.append(name)
    return names


def _module_name(path: str) -> str:
    base = path.strip().rsplit("/", 1)[-1]
    return base.split(".ko", 1)[0].replace("-", "_")


def _lines(path: Path) -> list[str]:
    try:
        return [line for line in path.read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise ImageBuildError(f"cannot read {path}: {exc}") from exc


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
