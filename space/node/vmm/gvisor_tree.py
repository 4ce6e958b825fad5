"""A template's directory tree for gVisor sandboxes, as the node agent asks for it
(issue 21).

gVisor runs a sandbox on a directory. Each template's tree is made once per digest
by root (space.node.privileged._gvisor_tree, which trusts nothing in the image) from
the template's ext4 image, handed over as a descriptor: the base image's plain copy
in the image cache, or a built template's disk (LUKS under the node's disk key, as
every guest disk) decrypted here into a file without a name that is gone once root
has read it (space.node.storage.disks.decrypted_copy).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from space.node.privileged import broker_for
from space.node.privileged.requests import MakeGuestTree
from space.node.storage.disks import decrypted_copy, disk_format

__all__ = ["ensure_tree"]


async def ensure_tree(run_root: Path, tree: Path, image: Path, *, passphrase: bytes) -> bool:
    """Make ``tree`` (a subvolume, root's, read-only) the directory tree of the guest
    image ``image`` (plain ext4, or LUKS opened with ``passphrase``), unless it exists;
    returns whether it was made now. The caller serialises calls for one tree.

    Raises InvalidArgument or Unavailable (root's words: what in the image it refused),
    Timeout. Nothing is left then: no tree, and no decrypted copy.
    """
    if await asyncio.to_thread(tree.is_dir):
        return False
    await asyncio.to_thread(tree.parent.mkdir, mode=0o700, exist_ok=True)
    if await asyncio.to_thread(disk_format, image) == "luks":
        fd = await decrypted_copy(image, tree.parent, passphrase)
    else:
        fd = await asyncio.to_thread(os.open, image, os.O_RDONLY | os.O_CLOEXEC)
    try:
        await broker_for(run_root).call(MakeGuestTree(path=str(tree)), fds=(fd,))
    finally:
        os.close(fd)
    return True
