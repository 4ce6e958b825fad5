"""A content-addressed build cache: one directory per digest, built once, never edited.

An entry ``<root>/<digest>/`` is complete exactly when its ``manifest.json`` names that
digest and every file it lists exists with the recorded size. Builds happen in a temp
directory beside the entry (same filesystem) under an exclusive ``fcntl`` lock per
digest, and are renamed into place atomically, so a reader sees either nothing or a
whole entry. A second builder of the same digest waits on the lock and then reuses the
first one's result. Interrupted builds leave only ``.<digest>.tmp-*`` directories, which
the next builder of that digest removes while holding the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from ._command import ImageBuildError, run_command

__all__ = ["MANIFEST_NAME", "ensure_entry", "prune", "read_manifest", "remove_tree"]

MANIFEST_NAME = "manifest.json"

#: Build step: fills the given empty directory and returns manifest extras (JSON-able).
BuildStep = Callable[[Path], dict[str, object]]


def ensure_entry(root: Path, digest: str, build: BuildStep) -> Path:
    """Return ``root/digest``, building it with ``build`` unless a complete one exists.

    Idempotent and safe to call concurrently from threads or processes. ``build``
    receives an empty directory to fill; the manifest (digest, file sizes and the
    dict ``build`` returns) is written after it returns. If ``build`` raises, its
    directory is removed and the exception propagates; no entry appears.
    Raises ImageBuildError when the cache directory itself cannot be used.
    """
    final = root / digest
    if read_manifest(final, digest) is not None:
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _locked(root / f".{digest}.lock"):
            if read_manifest(final, digest) is not None:
                return final
            _clear_leftovers(root, digest, final)
            _build_into(root, digest, final, build)
    except OSError as exc:
        raise ImageBuildError(f"image cache {root}: {exc}") from exc
    return final


def read_manifest(entry: Path, digest: str) -> dict[str, object] | None:
    """The manifest of a complete entry for ``digest``, or None if it is absent or partial."""
    try:
        manifest = json.loads((entry / MANIFEST_NAME).read_text())
        files = manifest["files"]
        if manifest.get("digest") != digest or not isinstance(files, dict):
            return None
        for name, size in files.items():
            if (entry / name).stat().st_size != size:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return manifest if isinstance(manifest, dict) else None


def prune(root: Path, *, template: str, keep: str, spare: int = 1) -> list[str]:
    """Delete complete entries of ``template`` other than ``keep``, sparing the ``spare``
    most recent; return the digests deleted.

    Every change to the guest daemon makes a new ~180 MB entry, so without this the cache
    grows with each build. Nodes copy an image into their own pool, so an old entry is
    needed only by a build of it in progress: each deletion holds that digest's lock.
    """
    entries = []
    for entry in root.iterdir() if root.is_dir() else ():
        manifest = read_manifest(entry, entry.name)
        if entry.name != keep and manifest is not None and manifest.get("template") == template:
            entries.append(entry)
    entries.sort(key=lambda e: e.stat().st_mtime, reverse=True)
    deleted = []
    for entry in entries[spare:]:
        with _locked(root / f".{entry.name}.lock"):
            remove_tree(entry)
        deleted.append(entry.name)
    return deleted


def remove_tree(path: Path) -> None:
    """Delete ``path`` recursively, refusing to cross into anything mounted below it.

    A crashed debootstrap can leave /proc or a bind mount of /dev inside its target;
    deleting through those would damage the host. Such mounts are detached first, and
    if one cannot be, ImageBuildError is raised and nothing is deleted.
    """
    if not path.exists():
        return
    for mount_point in reversed(_mounts_under(path)):
        with contextlib.suppress(ImageBuildError):
            run_command(["umount", "--lazy", mount_point], timeout_s=30)
    if _mounts_under(path):
        raise ImageBuildError(f"refusing to delete {path}: something is still mounted below it")
    shutil.rmtree(path, ignore_errors=False)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _clear_leftovers(root: Path, digest: str, final: Path) -> None:
    # Holding the digest's lock: no one else is building it, so any temp directory
    # for it is a crashed build's, and an existing but incomplete entry is garbage.
    for leftover in root.glob(f".{digest}.tmp-*"):
        remove_tree(leftover)
    if final.exists():
        remove_tree(final)


def _build_into(root: Path, digest: str, final: Path, build: BuildStep) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{digest}.tmp-", dir=root))
    try:
        extras = build(tmp)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.name != MANIFEST_NAME}
        manifest = {"digest": digest, "files": files, **extras}
        _write_synced(tmp / MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True))
        for name in [*files, MANIFEST_NAME]:
            # Readable by all whatever the builder's umask: ``space serve`` builds as
            # root under umask 077 (issue 18), then its node agent, as the unprivileged
            # ``space`` user, reads the same entry (a 0600 one sent it to the root-only
            # lock file, EACCES). Images hold no secret: the node key seals disks later.
            os.chmod(tmp / name, 0o644)
            _fsync_path(tmp / name)
        # Readable by all, whatever the umask: a root server builds under umask 077
        # (issue 18) and its node agent reads the entry after it drops root. An image
        # is public (a Debian system and the guest daemon); only root may write here.
        for name in (*files, MANIFEST_NAME):
            os.chmod(tmp / name, 0o644)
        os.chmod(tmp, 0o755)
        os.rename(tmp, final)
        _fsync_path(root)
    except BaseException:
        remove_tree(tmp)
        raise


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve())
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return sorted(found)
