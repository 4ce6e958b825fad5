"""A template's directory tree for gVisor sandboxes (issue 21): what root unpacks from
an ext4 image a guest wrote, and what it refuses to, with a real debugfs, btrfs pool
and root broker.

Needs root (the broker, a loop-mounted pool); fails loudly without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import subprocess
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from space.node.api import InvalidArgument, Unavailable
from space.node.privileged import broker_for
from space.node.privileged._gvisor import TREE_ROOT
from space.node.privileged._gvisor_tree import tree_limit_bytes
from space.node.privileged.requests import MakeGuestTree, unpacking_name
from space.node.storage.btrfs import BtrfsPool
from space.node.storage.disks import _pieces, encrypt_image
from space.node.vmm.gvisor_tree import ensure_tree

from .test_btrfs_pool import data_dir, pool, runner  # noqa: F401

T = TypeVar("T")
PASSPHRASE = b"k" * 64
DIGEST = "d" * 64


@dataclass(frozen=True)
class Pool:
    """A real pool (its root broker running) and the loop to ask it on."""

    runner: asyncio.Runner
    pool: BtrfsPool

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.runner.run(coro)


@pytest.fixture
def real(pool: BtrfsPool, runner: asyncio.Runner) -> Pool:  # noqa: F811
    return Pool(runner, pool)


def _image(tmp_path: Path, make: Callable[[Path], object], *, mib: int = 16) -> Path:
    """An ext4 image of the directory ``make`` fills (no checksums, so a test may
    patch names in it as a hostile guest would)."""
    src = tmp_path / "src"
    (src / "usr" / "bin").mkdir(parents=True)
    (src / "usr" / "bin" / "python3").write_bytes(b"#!guest python\n")
    make(src)
    image = tmp_path / "rootfs.img"
    subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-O", "^metadata_csum", "-d", str(src), str(image), f"{mib}M"],
        check=True,
        capture_output=True,
    )
    return image


def _patch(image: Path, *renames: tuple[bytes, bytes]) -> None:
    """Rename directory entries in place, as only a crafted image has them."""
    data = image.read_bytes()
    for old, new in renames:
        assert len(old) == len(new) and data.count(old) == 1, old
        data = data.replace(old, new)
    image.write_bytes(data)


def _make(real: Pool, image: Path) -> Path:
    tree = real.pool.tree_path(DIGEST)
    real.run(ensure_tree(real.pool.root.parent / "run", tree, image, passphrase=PASSPHRASE))
    return tree


def _nothing_left(real: Pool) -> None:
    trees = real.pool.root / "gvisor"
    assert sorted(os.listdir(trees)) == [], "a tree or root's scratch directory stayed"


def test_an_image_is_unpacked_read_only_with_owners_and_modes_and_nothing_that_escalates(
    real: Pool, tmp_path: Path
) -> None:
    def files(src: Path) -> None:
        home = src / "home" / "user"
        home.mkdir(parents=True)
        (home / "notes").write_text("mine\n")
        os.chown(home, 1000, 1000)
        os.chown(home / "notes", 1000, 1000)
        (home / "notes").chmod(0o640)
        (src / "usr" / "bin" / "shell").write_bytes(b"#!/bin/sh\n")
        (src / "usr" / "bin" / "shell").chmod(0o6755)  # set-user-id and set-group-id root
        (src / "usr" / "bin" / "sh").symlink_to("/usr/bin/shell")
        os.link(home / "notes", src / "also-notes")
        os.mkfifo(src / "fifo")
        os.mknod(src / "mem", 0o666 | stat.S_IFCHR, os.makedev(1, 1))

    top = _make(real, _image(tmp_path, files))
    tree = top / TREE_ROOT  # the guest's root, beside which the agent keeps saved states
    assert stat.S_IMODE(top.stat().st_mode) == 0o700
    notes = (tree / "home" / "user" / "notes").stat()
    assert (notes.st_uid, notes.st_gid, stat.S_IMODE(notes.st_mode)) == (1000, 1000, 0o640)
    assert (tree / "home" / "user" / "notes").read_text() == "mine\n"
    assert (tree / "also-notes").read_text() == "mine\n"
    # Kept as links for the guest to resolve; the host follows none.
    assert os.readlink(tree / "usr" / "bin" / "sh") == "/usr/bin/shell"
    shell = (tree / "usr" / "bin" / "shell").stat()
    assert (shell.st_uid, stat.S_IMODE(shell.st_mode)) == (0, 0o755)  # no set-id bits
    assert not (tree / "fifo").exists() and not (tree / "mem").exists()
    assert stat.S_IMODE(tree.stat().st_mode) == 0o755
    ro = subprocess.run(["btrfs", "property", "get", "-ts", str(top), "ro"], capture_output=True)
    assert ro.stdout.strip() == b"ro=true"
    assert real.pool.tree_digests() == [DIGEST]
    # Once per digest: a second ask makes nothing.
    again = real.run(ensure_tree(real.pool.root.parent / "run", top, tmp_path, passphrase=b""))
    assert again is False
    real.run(real.pool.delete_tree(DIGEST))
    _nothing_left(real)
    assert real.pool.tree_digests() == []


def test_a_luks_disk_is_decrypted_for_root_into_a_file_without_a_name_that_goes_after(
    real: Pool, tmp_path: Path
) -> None:
    plain = _image(tmp_path, lambda src: (src / "marker").write_text("from luks\n"))
    luks = tmp_path / "disk.luks"
    real.run(encrypt_image(plain, luks, PASSPHRASE))
    before = _deleted_files_held()
    tree = _make(real, luks)
    assert (tree / TREE_ROOT / "marker").read_text() == "from luks\n"
    assert _deleted_files_held() == before  # the decrypted copy is closed: gone
    assert os.listdir(real.pool.root / "gvisor") == [DIGEST]  # and never had a name there
    real.run(real.pool.delete_tree(DIGEST))
    _nothing_left(real)


def _saved_while_mounted(tmp_path: Path) -> Path:
    """An ext4 image copied while mounted, as a build layer is saved while its guest
    runs: 40 files written in place (sync), then renamed a moment before the copy, the
    renames committed to the journal (fsync) and not yet written in place."""
    image = _image(tmp_path, lambda src: (src / "early").write_text("before\n"))
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(mounted)], check=True)
    try:
        for n in range(40):
            (mounted / f"written{n}").write_text(f"{n}\n")
        os.sync()
        for n in range(40):
            (mounted / f"written{n}").rename(mounted / f"renamed{n}")
        top = os.open(mounted, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(top)
        finally:
            os.close(top)
        saved = tmp_path / "saved.img"
        saved.write_bytes(image.read_bytes())
    finally:
        subprocess.run(["umount", str(mounted)], check=True)
    superblock = saved.read_bytes()[1024:1124]
    assert int.from_bytes(superblock[0x60:0x64], "little") & 0x4, "no journal to replay"
    return saved


def test_a_disk_saved_while_its_guest_ran_is_unpacked_with_its_journal_replayed(
    real: Pool, tmp_path: Path
) -> None:
    """debugfs reads what is in place: without the replay the tree missed the files
    only the journal held, or debugfs refused the image's bitmaps (seen in CI)."""
    luks = tmp_path / "layer.luks"
    real.run(encrypt_image(_saved_while_mounted(tmp_path), luks, PASSPHRASE))
    luks.chmod(0o600)
    before = luks.read_bytes()
    tree = _make(real, luks) / TREE_ROOT
    assert (tree / "early").read_text() == "before\n"
    assert sorted(os.listdir(tree)) == sorted(
        ["early", "lost+found", "usr"] + [f"renamed{n}" for n in range(40)]
    )
    assert [(tree / f"renamed{n}").read_text() for n in range(40)] == [f"{n}\n" for n in range(40)]
    assert luks.read_bytes() == before  # replayed in the decrypted copy alone
    real.run(real.pool.delete_tree(DIGEST))
    _nothing_left(real)


def test_an_image_to_replay_is_replayed_as_its_owner_and_only_if_opened_for_writing(
    real: Pool, tmp_path: Path
) -> None:
    """Root writes only to an image the agent opened for writing (a plain image is
    handed over read-only: the base image's, which is never saved running), and
    e2fsck runs as the image's owner (the agent's own uid in production)."""
    saved = _saved_while_mounted(tmp_path)
    os.chown(saved, 4321, 4321)
    saved.chmod(0o600)
    before = saved.read_bytes()
    tree = real.pool.tree_path(DIGEST)
    tree.parent.mkdir(mode=0o700, exist_ok=True)
    broker = broker_for(real.pool.root.parent / "run")

    def make(flags: int) -> None:
        fd = os.open(saved, flags)
        try:
            real.run(broker.call(MakeGuestTree(str(tree)), fds=(fd,)))
        finally:
            os.close(fd)

    with pytest.raises(Unavailable, match="needs replaying and it was given read-only"):
        make(os.O_RDONLY)
    assert saved.read_bytes() == before
    _nothing_left(real)
    make(os.O_RDWR)
    assert (tree / TREE_ROOT / "renamed39").read_text() == "39\n"
    assert saved.stat().st_uid == 4321
    real.run(real.pool.delete_tree(DIGEST))
    _nothing_left(real)


def _deleted_files_held() -> int:
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed
            held += os.readlink(f"/proc/self/fd/{fd}").endswith("(deleted)")
    return held


def test_negative_a_crafted_image_s_links_and_names_write_nothing_outside_its_tree(
    real: Pool, tmp_path: Path
) -> None:
    """A link, then a file of the same name (the file would be written through the
    link), and a name holding ``../``: debugfs as root alone would write the host's
    files; confined, it finds nothing writable, and the template is refused."""
    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    escape = b"../" * 8 + b"tmp-escape"

    def files(src: Path) -> None:
        (src / "a").mkdir()
        (src / "a" / "link").symlink_to(victim)
        (src / "a" / "lonk").write_text("written through the link\n")
        (src / "a" / escape.replace(b"/", b"Z").decode()).write_text("escaped\n")

    image = _image(tmp_path, files)
    _patch(image, (b"lonk", b"link"), (escape.replace(b"/", b"Z"), escape))
    with pytest.raises(Unavailable, match="Read-only file system") as refused:
        _make(real, image)
    assert "/a/link" in str(refused.value) and "tmp-escape" in str(refused.value)
    assert victim.read_text() == "untouched\n"
    assert not Path("/tmp-escape").exists()
    _nothing_left(real)


def test_negative_a_tree_larger_than_its_image_allows_is_refused(
    real: Pool, tmp_path: Path
) -> None:
    """Hard links come out as copies: 24 links to 4 MiB exceed the tree's quota."""
    assert tree_limit_bytes(32 << 20) == 64 << 20

    def files(src: Path) -> None:
        (src / "big").write_bytes(os.urandom(4 << 20))
        for n in range(23):
            os.link(src / "big", src / f"link{n}")

    with pytest.raises(Unavailable, match="Disk quota exceeded"):
        _make(real, _image(tmp_path, files, mib=32))
    _nothing_left(real)


def test_negative_a_sparse_file_larger_than_the_image_is_refused(
    real: Pool, tmp_path: Path
) -> None:
    """rdump writes holes as zeros: no file it writes may outgrow the image."""

    def files(src: Path) -> None:
        with open(src / "sparse", "wb") as f:
            f.truncate(8 << 30)

    with pytest.raises(Unavailable, match="unpacking the image failed"):
        _make(real, _image(tmp_path, files))
    _nothing_left(real)


def test_negative_root_reads_only_a_regular_file_the_agent_opened_for_reading(
    real: Pool, tmp_path: Path
) -> None:
    image = _image(tmp_path, lambda src: None)
    tree = real.pool.tree_path(DIGEST)
    tree.parent.mkdir(mode=0o700, exist_ok=True)
    broker = broker_for(real.pool.root.parent / "run")
    read_end, write_end = os.pipe()
    held = [
        os.open(image, os.O_PATH),  # what the agent may name but not read
        os.open(image, os.O_WRONLY),
        read_end,
    ]
    try:
        matches = ("opened for reading", "opened for reading", "of 1 to")
        for fd, match in zip(held, matches, strict=True):
            with pytest.raises(InvalidArgument, match=match):
                real.run(broker.call(MakeGuestTree(path=str(tree)), fds=(fd,)))
    finally:
        for fd in (*held, write_end):
            os.close(fd)
    assert not tree.exists() and not (tree.parent / unpacking_name(DIGEST)).exists()


def test_what_an_unpacking_cut_short_left_is_found_by_its_digest_and_removed(
    real: Pool,
) -> None:
    """Root's scratch directory with a partial tree in it (the broker stopped)."""
    scratch = real.pool.tree_path(DIGEST).with_name(unpacking_name(DIGEST))
    scratch.parent.mkdir(mode=0o700, exist_ok=True)
    scratch.mkdir(mode=0o700)
    subprocess.run(["btrfs", "subvolume", "create", str(scratch / "tree")], check=True)
    (scratch.parent / "not-a-digest!").mkdir()
    assert real.pool.tree_digests() == [DIGEST]
    real.run(real.pool.delete_unpacking(DIGEST))
    assert not scratch.exists() and real.pool.tree_digests() == []


def test_a_disk_s_holes_stay_holes_in_its_decrypted_copy_and_small_ones_join_the_data(
    tmp_path: Path,
) -> None:
    """The pieces qemu-img decrypts: the payload whole, in order; a hole of 1 MiB or
    more stays a hole (it would decrypt to noise), a smaller one is decrypted."""
    disk = tmp_path / "disk"
    k, mib = 4096, 1 << 20
    runs = (0, 2 * k + 2 * mib, 3 * k + 2 * mib + mib // 2)  # after the header, in the payload
    with open(disk, "wb") as f:
        for at in (-k, *runs):
            f.seek(k + at)
            f.write(b"x" * k)
        f.truncate(20 * mib)
    middle = 2 * k + mib // 2  # data, a 512 KiB hole, data
    assert _pieces(disk, k) == [
        (0, k, True),
        (k, k + 2 * mib, False),
        (runs[1], middle, True),
        (runs[1] + middle, 20 * mib - k - runs[1] - middle, False),
    ]


def test_root_unpacks_an_image_only_the_unprivileged_agent_may_read(
    real: Pool, tmp_path: Path
) -> None:
    """The agent's decrypted copy is 0600 and the agent's (a uid of its own in
    production): the confined debugfs reads it through the descriptor alone."""
    image = _image(tmp_path, lambda src: (src / "marker").write_text("agent's\n"))
    os.chown(image, 4321, 4321)
    image.chmod(0o600)
    tree = real.pool.tree_path(DIGEST)
    tree.parent.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(image, os.O_RDONLY)
    try:
        real.run(
            broker_for(real.pool.root.parent / "run").call(MakeGuestTree(str(tree)), fds=(fd,))
        )
    finally:
        os.close(fd)
    assert (tree / TREE_ROOT / "marker").read_text() == "agent's\n"
    real.run(real.pool.delete_tree(DIGEST))
    _nothing_left(real)
