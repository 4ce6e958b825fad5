"""``debugfs rdump`` of an image a guest wrote, confined (issue 21), run by the root broker.

``python -m space.node.privileged._unpack_child IMAGE_FD SCRATCH_FD MAX_FILE_BYTES``
unpacks the ext4 image open as IMAGE_FD into the subvolume ``tree`` of the directory
SCRATCH_FD holds (root's alone). debugfs writes by path names that come from the
image: a symbolic link it made a moment before, then a file of the same name (a
crafted directory may hold both), or a name with ``/`` or ``..`` in it, would have
root write wherever the image says. So debugfs sees no file system of the host's:

- new mount, PID, network, IPC and UTS namespaces; its root a read-only tmpfs holding
  ``/usr`` (read-only, nosuid, nodev), the links into it a merged-/usr system has,
  ``/out`` (the tree, a clone of its mount taken from the descriptor: nosuid, nodev,
  noexec), ``/dev/null`` and ``/proc`` (its own PID namespace's, read-only, pids
  only: the image is read as ``/proc/self/fd/IMAGE_FD``). A link in the image leads
  to the tree itself, or to something read-only, or to nothing.
- the capabilities it needs and no more (CAP_CHOWN and CAP_FOWNER to give each file
  its owner and times, CAP_DAC_READ_SEARCH to read the image, which is the agent's),
  no_new_privs, and limits: address space, the size of any one file it writes, open
  files. The tree's own size is bounded by its quota group (set by the broker).

A disk saved while its guest ran (each build layer is) is consistent only with its
journal: metadata committed there may not be written in place yet, and debugfs reads
what is in place, so a tree unpacked as it is would miss files or fail on checksums.
Such an image's journal is replayed first, by ``e2fsck -E journal_only`` in the same
confinement, without any capability and as the image's owner, so that it writes to
the agent's (decrypted, unnamed) copy and nothing else; an image that needs it must
be given open for writing.

Exits with debugfs's status (128 + the signal if it was killed).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import resource
import shutil
import signal
import sys

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWPID, _CLONE_NEWNET = 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 0x4000, 0x40000
_MNT_DETACH = 2
#: x86-64 syscall numbers and their flags.
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_PIVOT_ROOT = 428, 429, 155
_OPEN_TREE_CLONE, _AT_SYMLINK_NOFOLLOW, _MOVE_MOUNT_F_EMPTY_PATH = 1, 0x100, 0x4
_AT_FDCWD = -100
#: Where the new root is built (a tmpfs mounted over it in this namespace only).
_NEW_ROOT = "/tmp"
#: debugfs's memory: libext2fs's bitmaps and one block at a time need far less, and a
#: crafted inode (a link target of 4 GiB) makes it allocate what it claims.
_MAX_ADDRESS_BYTES = 1 << 30
_CAPABILITIES = "+chown,+fowner,+dac_read_search"
#: ext4's superblock: its place, where in it its magic and incompatible features are,
#: and the feature "the journal holds what is not yet in place".
_SUPERBLOCK_AT, _MAGIC_AT, _INCOMPAT_AT = 1024, 0x38, 0x60
_EXT4_MAGIC, _INCOMPAT_RECOVER = 0xEF53, 0x4
#: e2fsck's exit statuses that mean the journal was replayed (1: "errors corrected").
_REPLAYED = (0, 1)

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> int:
    if result < 0:
        raise OSError(ctypes.get_errno(), what)
    return result


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str) -> None:
    encoded = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    _check(_libc.mount(encoded[0], encoded[1], encoded[2], flags, encoded[3]), f"mount {target}")


def _build_root(tree: int) -> None:
    """The new root (see the module docstring), entered with pivot_root."""
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE, "")
    _mount("tmpfs", _NEW_ROOT, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=64k,mode=0755")
    os.chdir(_NEW_ROOT)
    for name in ("usr", "out", "proc", "old", "dev"):
        os.mkdir(name, 0o755)
    os.chmod("dev", 0o755)  # whatever the broker's umask: e2fsck is not root
    with open("dev/null", "x"):  # e2fsck opens it before anything else
        pass
    _mount("/dev/null", "dev/null", None, _MS_BIND, "")
    _mount(
        None, "dev/null", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NOEXEC, ""
    )
    _mount("/usr", "usr", None, _MS_BIND | _MS_REC, "")
    _mount(None, "usr", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV, "")
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = f"/{name}"
        if os.path.islink(host) and os.readlink(host).startswith("usr/"):
            os.symlink(os.readlink(host), name)
        elif os.path.isdir(host):  # not a merged-/usr system
            os.mkdir(name, 0o755)
            _mount(host, name, None, _MS_BIND | _MS_REC, "")
            flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
            _mount(None, name, None, flags, "")
    moved = _libc.syscall(_SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, b"out", _MOVE_MOUNT_F_EMPTY_PATH)
    _check(moved, "move_mount out")
    os.close(tree)
    _mount(None, "out", None, _MS_REMOUNT | _MS_BIND | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "")
    _check(_libc.syscall(_SYS_PIVOT_ROOT, b".", b"old"), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/old", _MNT_DETACH), "umount old root")
    os.rmdir("/old")
    flags = _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    _mount("proc", "/proc", "proc", flags, "subset=pid")
    _mount(None, "/", None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV, "")


def _limit(max_file_bytes: int) -> None:
    # Python ignores SIGXFSZ, and an exec keeps that: debugfs would go on writing to
    # a file past its limit, one failed write a block, through all of a crafted size.
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_AS, (_MAX_ADDRESS_BYTES, _MAX_ADDRESS_BYTES))
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _needs_recovery(image: int) -> bool:
    """Whether the ext4 image ``image`` has a journal to replay (an image that is not
    ext4 at all is left to debugfs to refuse)."""
    block = os.pread(image, _INCOMPAT_AT + 4, _SUPERBLOCK_AT)
    if len(block) < _INCOMPAT_AT + 4:
        return False
    if int.from_bytes(block[_MAGIC_AT : _MAGIC_AT + 2], "little") != _EXT4_MAGIC:
        return False
    return bool(int.from_bytes(block[_INCOMPAT_AT:], "little") & _INCOMPAT_RECOVER)


def _replay_journal(image: int, setpriv: str, e2fsck: str) -> None:
    """Replay the journal of ``image`` in place (see the module docstring); raises
    OSError if it was not opened for writing or e2fsck failed."""
    if fcntl.fcntl(image, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise OSError("the image's journal needs replaying and it was given read-only")
    owner = os.fstat(image)
    pid = os.fork()
    if pid == 0:
        try:
            os.execve(
                setpriv,
                [
                    "setpriv", f"--reuid={owner.st_uid}", f"--regid={owner.st_gid}",
                    "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
                    "--no-new-privs", "--", e2fsck, "-E", "journal_only", "-p",
                    f"/proc/self/fd/{image}",
                ],
                # No mtab here to check the image against; it is a file, never mounted.
                {**os.environ, "EXT2FS_NO_MTAB_OK": "1"},
            )  # fmt: skip
        finally:
            os._exit(127)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code not in _REPLAYED:
        raise OSError(f"replaying the image's journal failed (e2fsck exit status {code})")


def main(argv: list[str]) -> int:
    image, scratch, max_file_bytes = int(argv[0]), int(argv[1]), int(argv[2])
    into = argv[3].encode()  # the directory of SCRATCH unpacked into (root's own names)
    flags = _OPEN_TREE_CLONE | _AT_SYMLINK_NOFOLLOW
    tree = _check(_libc.syscall(_SYS_OPEN_TREE, scratch, into, flags), "open_tree")
    os.close(scratch)
    spaces = _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS
    _check(_libc.unshare(spaces), "unshare")
    programs = [shutil.which(name) for name in ("setpriv", "debugfs", "e2fsck")]
    if None in programs:
        raise OSError(f"setpriv, debugfs and e2fsck must be installed, found {programs}")
    pid = os.fork()  # the child is PID 1 of the new PID namespace
    if pid:
        os.close(tree)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        return 128 - code if code < 0 else code
    try:
        _build_root(tree)
        _limit(max_file_bytes)
        os.set_inheritable(image, True)
        setpriv, debugfs, e2fsck = (str(program) for program in programs)  # in /usr or /sbin: seen
        if _needs_recovery(image):
            _replay_journal(image, setpriv, e2fsck)
        os.execv(
            setpriv,
            [
                "setpriv", "--inh-caps=-all", f"--bounding-set=-all,{_CAPABILITIES}",
                "--no-new-privs", "--", debugfs, "-R", "rdump / /out", f"/proc/self/fd/{image}",
            ],
        )  # fmt: skip
    except BaseException as exc:  # the step that failed, for the broker's message
        print(f"unpack: {exc}", file=sys.stderr, flush=True)
        os._exit(125)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
