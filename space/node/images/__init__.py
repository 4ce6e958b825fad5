"""Guest image builds: kernel, initramfs and ext4 root filesystem per template.

``build_template("base")`` returns a GuestImage whose three files live in
``<cache_dir>/<digest>/``, where the digest hashes every input (see _template.py).
An unchanged template is reused at once; a changed one is built beside it and renamed
into place atomically, under a per-digest lock. Old builds stay until removed.

Errors (all NodeError subclasses, see space/node/api/errors.py):

    ImageBuildError            a step failed; carries the command and its output tail
    └── TemplateNotFound       no template of that name (also a NotFound)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from space.node.api import NotFound

from ._cache import prune
from ._command import ImageBuildError
from ._template import KERNEL_CMDLINE, build_entry, inputs_for

__all__ = [
    "DEFAULT_CACHE_DIR",
    "GuestImage",
    "ImageBuildError",
    "TemplateNotFound",
    "build_template",
    "template_digest",
]

DEFAULT_CACHE_DIR = Path("/var/cache/space/images")


class TemplateNotFound(ImageBuildError, NotFound):
    """No template of that name exists."""

    code = "not_found"


@dataclass(frozen=True)
class GuestImage:
    """A built template: three files in one immutable cache directory.

    Never boot or modify these files in place; give each VM its own copy
    (reflink or subvolume snapshot).
    """

    name: str
    digest: str
    directory: Path
    kernel: Path
    initrd: Path
    rootfs: Path
    kernel_cmdline: str


def build_template(
    name: str = "base",
    *,
    cache_dir: Path = DEFAULT_CACHE_DIR,
    progress: Callable[[str], None] | None = None,
) -> GuestImage:
    """Build template ``name`` into ``cache_dir``, or reuse the build already there.

    Synchronous and blocking: a cold build takes minutes (debootstrap, mkfs), a
    reuse milliseconds once the kernel lookup is cached. ``progress`` is called with
    a short line before each step. Idempotent and safe to run concurrently (threads
    or processes): a second build of the same digest waits and then reuses the first.
    Interrupted builds leave nothing but a temp directory that the next build removes.
    Raises TemplateNotFound for an unknown name, ImageBuildError if a step fails.
    """
    report = progress or (lambda _line: None)
    report(f"resolving inputs of template {name!r}")
    inputs = inputs_for(name)
    directory = build_entry(inputs, cache_dir, report)
    digest = inputs.digest()
    try:
        for old in prune(cache_dir, template=name, keep=digest):
            report(f"removed old build {old[:12]} of template {name!r}")
    except OSError as exc:
        raise ImageBuildError(f"image cache {cache_dir}: {exc}") from exc
    return GuestImage(
        name=name,
        digest=digest,
        directory=directory,
        kernel=directory / "vmlinuz",
        initrd=directory / "initrd.img",
        rootfs=directory / "rootfs.img",
        kernel_cmdline=KERNEL_CMDLINE,
    )


def template_digest(name: str = "base") -> str:
    """The digest ``build_template(name)`` would produce, without building anything.

    Costs one apt-cache lookup (about 1 s) the first time per process and after
    ``apt-get update``, milliseconds otherwise. Raises TemplateNotFound or
    ImageBuildError like build_template.
    """
    return inputs_for(name).digest()
