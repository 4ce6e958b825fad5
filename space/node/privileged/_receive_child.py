"""``btrfs receive`` in a mount namespace of its own (issue 19), run by the root broker.

``python -m space.node.privileged._receive_child POOL_FD TOP DIR_FD INTO`` bind-mounts
the pool's top level (held as POOL_FD) on TOP and the staging directory (DIR_FD) on
INTO, both directories root just made, then becomes ``btrfs receive -e -C -m TOP
INTO`` reading its stdin. The mounts are clones of the descriptors themselves
(``open_tree``, taken before the namespace is made, then ``move_mount``), where
mount(8) would look a name up again; they go with the namespace when receive exits.
"""

from __future__ import annotations

import ctypes
import os
import sys

_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000
#: x86-64 syscall numbers (Linux 5.2) and their flags.
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT = 428, 429
_OPEN_TREE_CLONE, _AT_EMPTY_PATH, _MOVE_MOUNT_F_EMPTY_PATH = 1, 0x1000, 0x4
_AT_FDCWD = -100


def main(argv: list[str]) -> None:
    pool_fd, top, dir_fd, into = int(argv[0]), argv[1], int(argv[2]), argv[3]
    libc = ctypes.CDLL(None, use_errno=True)
    trees = []
    for fd in (pool_fd, dir_fd):
        tree = libc.syscall(_SYS_OPEN_TREE, fd, b"", _OPEN_TREE_CLONE | _AT_EMPTY_PATH)
        if tree < 0:
            raise OSError(ctypes.get_errno(), "open_tree")
        trees.append(tree)
        os.close(fd)
    if libc.unshare(_CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    if libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    for tree, target in zip(trees, (top, into), strict=True):
        moved = libc.syscall(
            _SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, target.encode(), _MOVE_MOUNT_F_EMPTY_PATH
        )
        if moved != 0:
            raise OSError(ctypes.get_errno(), f"move_mount on {target}")
        os.close(tree)
    os.execvp("btrfs", ["btrfs", "receive", "-q", "-e", "-C", "-m", top, into])


if __name__ == "__main__":
    main(sys.argv[1:])
