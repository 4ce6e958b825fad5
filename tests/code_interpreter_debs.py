"""The .debs the code interpreter template installs, cached on the host for the tests.

Tests send nothing past loopback, yet building templates/code-interpreter installs
Debian packages. So scripts/setup.sh runs this module once (`python -m
tests.code_interpreter_debs`): it resolves the packages of the template's spec against
the dpkg status of the node's `base` image exactly as a build does (the node's own
space.node.templates.packages.fetch_debs, from Debian's registry), and keeps the .debs
with a Packages index as a flat apt repository in
``/var/cache/space/debs/code-interpreter-<key>``. The key hashes the package names and
the base image's dpkg status, so a new base or spec gets its own closure, and a
complete directory never changes. The tests give it to the node as its only apt source:
served on 127.0.0.1 (tests.apt_repo.served_directory), or as apt's ``copy:`` source,
whose line names the directory and so the closure (the node's build cache keys its
layers by the sources' lines).

The status is read from the host-built base image with debugfs (the image is never
mounted, and no guest ever wrote this file).
"""

from __future__ import annotations

import asyncio
import hashlib
import lzma
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from space.node.core.config import DEFAULT_APT_SOURCES
from space.node.images import build_template
from space.node.templates.packages import MAX_STATUS_BYTES, fetch_debs
from space.node.templates.spec import load_spec

__all__ = ["SPEC_DIR", "cached_repository", "template_packages"]

SPEC_DIR = Path(__file__).resolve().parents[1] / "templates" / "code-interpreter"
CACHE_ROOT = Path("/var/cache/space/debs")
_COMPLETE = "complete"


def template_packages() -> tuple[str, ...]:
    return tuple(sorted(set(load_spec(SPEC_DIR / "space.toml").packages)))


def base_status() -> bytes:
    """/var/lib/dpkg/status of the node's base guest image (built if it is not yet)."""
    rootfs = build_template("base").rootfs
    out = subprocess.run(
        ["debugfs", "-R", "cat /var/lib/dpkg/status", str(rootfs)],
        capture_output=True,
        check=True,
        timeout=120,
    ).stdout
    if not out.startswith(b"Package: ") or len(out) > MAX_STATUS_BYTES:
        raise RuntimeError(f"no dpkg status read from {rootfs}")
    return out


def cached_repository(status: bytes | None = None) -> Path:
    """The cache directory for today's spec and base image (it may not exist yet)."""
    key = hashlib.sha256()
    key.update("\n".join(template_packages()).encode() + b"\n\0")
    key.update(status if status is not None else base_status())
    return CACHE_ROOT / f"code-interpreter-{key.hexdigest()[:24]}"


def ensure_repository() -> Path:
    """Fill the cache directory unless it is complete; return it."""
    status = base_status()
    target = cached_repository(status)
    if (target / _COMPLETE).is_file():
        return target
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    debs = asyncio.run(
        fetch_debs(
            template_packages(),
            status=status,
            sources=DEFAULT_APT_SOURCES,
            work_dir=CACHE_ROOT / "apt",
            progress=lambda line: print(line, file=sys.stderr),
        )
    )
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=CACHE_ROOT))
    try:
        for deb in debs:
            shutil.copyfile(deb, staging / deb.name)
        index = subprocess.run(
            ["dpkg-scanpackages", "--multiversion", ".", "/dev/null"],
            cwd=staging,
            check=True,
            capture_output=True,
            timeout=300,
        ).stdout
        (staging / "Packages").write_bytes(index)
        (staging / "Packages.xz").write_bytes(lzma.compress(index))
        (staging / _COMPLETE).write_text(f"{len(debs)} packages\n")
        staging.chmod(0o755)  # a node's apt reads it as the node's user (copy: source)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


if __name__ == "__main__":
    print(ensure_repository())
