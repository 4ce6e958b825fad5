"""The guest root filesystem: a cached debootstrap tree, customised, as an ext4 image.

debootstrap is the slow step (about 40 s), so its result is cached on its own, keyed
by its inputs only (suite, variant, packages, mirror): changing the guest daemon
reuses it. Every build unpacks that tree into a staging directory, adds the user, the
guest daemon and the host name, and turns it into an image with ``mkfs.ext4 -d``.
The host never mounts the image.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ._cache import ensure_entry, remove_tree
from ._command import ImageBuildError, run_command

__all__ = [
    "DEFAULT_MIRROR",
    "Debootstrap",
    "GuestSource",
    "apt_mirror",
    "build_rootfs_image",
    "ensure_debootstrap",
    "guest_sources",
    "parse_mirror",
]

DEFAULT_MIRROR = "http://deb.debian.org/debian"
ROOTFS_SIZE_BYTES = 1 << 30  # sparse; the node may grow a pristine copy with resize2fs
GUEST_UID = 1000
_SOURCES_FILES = (
    Path("/etc/apt/sources.list.d/debian.sources"),
    Path("/etc/apt/sources.list"),
)
# Trimmed from the image: the guest has no apt network access and no one reads docs.
_PRUNE = (
    "var/cache/apt",
    "var/lib/apt/lists",
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "var/log",
)
_REPO_SPACE = Path(__file__).resolve().parents[2]  # .../space


@dataclass(frozen=True)
class Debootstrap:
    """Everything that decides what debootstrap produces."""

    suite: str = "bookworm"
    variant: str = "minbase"
    include: tuple[str, ...] = ("python3", "ca-certificates")
    mirror: str = DEFAULT_MIRROR

    def key(self) -> str:
        """Hex sha256 of the inputs (the cache key of the tree)."""
        fields = {"suite": self.suite, "variant": self.variant, "mirror": self.mirror}
        fields["include"] = ",".join(sorted(self.include))
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class GuestSource:
    """One guest daemon file: its path under the image's ``space`` package, and bytes."""

    relpath: str
    data: bytes


def parse_mirror(sources_text: str, *, deb822: bool) -> str | None:
    """The first plain Debian mirror URI in an apt sources file, or None.

    ``deb822`` selects the .sources format (``URIs:`` fields) over one-line
    ``deb URI suite ...`` entries. Security mirrors are skipped: they do not carry
    the release itself.
    """
    if deb822:
        uris = [uri for stanza in _deb822_stanzas(sources_text) for uri in stanza]
    else:
        uris = []
        for line in sources_text.splitlines():
            # Drop "[arch=amd64 signed-by=...]" options, then: deb URI suite components
            words = re.sub(r"\[[^\]]*\]", " ", line.split("#", 1)[0]).split()
            if len(words) >= 2 and words[0] == "deb":
                uris.append(words[1])
    for uri in uris:
        if uri.startswith(("http://", "https://")) and "security" not in uri:
            return uri.rstrip("/")
    return None


def _deb822_stanzas(text: str) -> list[list[str]]:
    """URIs of each enabled binary ("Types: deb") stanza of a .sources file."""
    found = []
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            key, sep, value = line.partition(":")
            if sep and not line.startswith(("#", " ", "\t")):
                fields[key.strip().lower()] = value.strip()
        if "deb" in fields.get("types", "").split() and fields.get("enabled", "yes") != "no":
            found.append(fields.get("uris", "").split())
    return found


def apt_mirror(files: Iterable[Path] = _SOURCES_FILES) -> str:
    """The mirror this machine's apt uses (falls back to deb.debian.org)."""
    for path in files:
        try:
            text = path.read_text()
        except OSError:
            continue
        mirror = parse_mirror(text, deb822=path.suffix == ".sources")
        if mirror:
            return mirror
    return DEFAULT_MIRROR


def guest_sources(space_dir: Path = _REPO_SPACE) -> list[GuestSource]:
    """The guest daemon's files as shipped: space/protocol/*.py and space/guest/**/*.py,
    plus an empty space/__init__.py (the repository's own imports the SDK)."""
    files = [GuestSource("__init__.py", b"")]
    paths = sorted(space_dir.glob("protocol/*.py")) + sorted(space_dir.glob("guest/**/*.py"))
    for path in paths:
        if "__pycache__" not in path.parts:
            files.append(GuestSource(path.relative_to(space_dir).as_posix(), path.read_bytes()))
    return files


def ensure_debootstrap(
    cache_root: Path, spec: Debootstrap, progress: Callable[[str], None]
) -> Path:
    """The cached tarball of debootstrap's result for ``spec``, built on first use."""

    def build(tmp: Path) -> dict[str, object]:
        progress(f"debootstrap {spec.suite} {spec.variant} from {spec.mirror} (about 40 s)")
        target = tmp / "root"
        argv = [
            "debootstrap",
            f"--variant={spec.variant}",
            f"--include={','.join(spec.include)}",
            spec.suite,
            str(target),
            spec.mirror,
        ]
        try:
            run_command(argv, timeout_s=1200)
            progress("saving debootstrap result to the cache")
            tar = ["tar", "--numeric-owner", "--xattrs", "-C", str(target), "-cf"]
            run_command([*tar, str(tmp / "base.tar"), "."], timeout_s=600)
        finally:
            remove_tree(target)
        return {"debootstrap": spec.__dict__ | {"include": list(spec.include)}}

    return ensure_entry(cache_root, spec.key(), build) / "base.tar"


def build_rootfs_image(
    base_tar: Path,
    dest: Path,
    *,
    workdir: Path,
    sources: list[GuestSource],
    progress: Callable[[str], None],
) -> None:
    """Write the ext4 image ``dest`` from the cached tree plus our customisations."""
    staging = workdir / "rootfs"
    staging.mkdir()
    try:
        progress("unpacking the base system")
        run_command(
            ["tar", "--numeric-owner", "--xattrs", "-xpf", str(base_tar), "-C", str(staging)],
            timeout_s=600,
        )
        progress("installing the guest daemon")
        customise(staging, sources)
        progress("creating the ext4 root filesystem image")
        _make_ext4(staging, dest)
    finally:
        remove_tree(staging)


def customise(root: Path, sources: list[GuestSource]) -> None:
    """Apply the template's changes to an unpacked tree ``root`` (no chroot, no mounts)."""
    try:
        for rel in _PRUNE:
            _empty_dir(root / rel)
        _add_user(root)
        _install_sources(root, sources)
        _write(root / "usr/lib/space/init", _asset("space-init.sh"), 0o755)
        _write(root / "etc/hostname", b"space\n", 0o644)
        _write(root / "etc/hosts", _asset("hosts"), 0o644)
        # Empty: the guest (or a fork) sets a fresh identity at boot.
        _write(root / "etc/machine-id", b"", 0o444)
    except OSError as exc:
        raise ImageBuildError(f"cannot customise the guest tree: {exc}") from exc


def _add_user(root: Path) -> None:
    uid = GUEST_UID
    _append_line(root / "etc/passwd", f"user:x:{uid}:{uid}:SPACE user:/home/user:/bin/sh")
    _append_line(root / "etc/group", f"user:x:{uid}:")
    _append_line(root / "etc/shadow", "user:!:::::::")
    if (root / "etc/gshadow").exists():
        _append_line(root / "etc/gshadow", "user:!::")
    home = root / "home/user"
    home.mkdir(parents=True, exist_ok=True)
    os.chown(home, uid, uid)
    home.chmod(0o755)


def _append_line(path: Path, line: str) -> None:
    name = line.split(":", 1)[0]
    existing = path.read_text()
    if any(entry.split(":", 1)[0] == name for entry in existing.splitlines()):
        raise ImageBuildError(f"{path.name} of the base system already has an entry {name!r}")
    path.write_text(
        existing + ("" if existing.endswith("\n") or not existing else "\n") + line + "\n"
    )


def _install_sources(root: Path, sources: list[GuestSource]) -> None:
    package = root / "usr/lib/space/python/space"
    for source in sources:
        _write(package / source.relpath, source.data, 0o644)


def _write(path: Path, data: bytes, mode: int) -> None:
    _make_dirs(path.parent)
    path.unlink(missing_ok=True)
    path.write_bytes(data)
    path.chmod(mode)
    os.chown(path, 0, 0)


def _make_dirs(path: Path) -> None:
    """mkdir -p with every new directory 0755: these are the guest's, and the server's
    umask (077, issue 18) would make them root-only inside the guest."""
    if path.is_dir():
        return
    _make_dirs(path.parent)
    path.mkdir(exist_ok=True)
    path.chmod(0o755)


def _empty_dir(path: Path) -> None:
    if not path.is_dir() or path.is_symlink():
        return
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def _asset(name: str) -> bytes:
    return resources.files("space.node.images").joinpath(f"files/{name}").read_bytes()


def _make_ext4(staging: Path, dest: Path) -> None:
    with open(dest, "wb") as f:
        f.truncate(ROOTFS_SIZE_BYTES)
    run_command(
        ["mkfs.ext4", "-q", "-F", "-L", "space-root", "-d", str(staging), str(dest)],
        timeout_s=600,
    )
