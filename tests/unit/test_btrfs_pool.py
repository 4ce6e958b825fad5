"""The btrfs pool on a loop file: templates, O(1) sandbox snapshots, clean teardown.

Needs root (mount, losetup); fails loudly without it.
"""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from space.node.agent._lifecycle import ram_file
from space.node.agent._recovery import _limit_volumes
from space.node.api import InvalidArgument, NotFound, SandboxSpec, Unavailable
from space.node.core.capacity import volume_limit_mib
from space.node.core.sandbox import MEMORY_FILE
from space.node.privileged import Scope, broker_for
from space.node.privileged.requests import AdoptPool
from space.node.storage.btrfs import (
    BtrfsPool,
    pack_snapshot_args,
    snapshot_subvolume,
)
from space.node.storage.disks import disk_bytes, disk_format
from space.node.vmm.jail import JAIL_UIDS
from tests.root_broker import root_broker, root_broker_of

IMAGE_MIB = 64


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.fail("the btrfs pool tests mount a loop file: run them as root")
    with root_broker(tmp_path):
        yield tmp_path
    # Whatever the test did, leave no mount or loop device behind.
    subprocess.run(["umount", str(tmp_path / "pool")], capture_output=True, check=False)
    loops = loops_of(tmp_path / "pool.img")
    for loop in loops:
        subprocess.run(["losetup", "-d", loop], check=False)
    assert not loops, f"loop devices left behind: {loops}"


@pytest.fixture
def image_files(tmp_path: Path) -> dict[str, Any]:
    src = tmp_path / "image"
    src.mkdir()
    (src / "vmlinuz").write_bytes(b"kernel")
    (src / "initrd.img").write_bytes(b"initrd")
    rootfs = src / "rootfs.img"
    subprocess.run(
        ["mkfs.ext4", "-q", "-F", str(rootfs), f"{IMAGE_MIB}M"], check=True, capture_output=True
    )
    return {"kernel": src / "vmlinuz", "initrd": src / "initrd.img", "rootfs": rootfs}


def loops_of(image: Path) -> list[str]:
    out = subprocess.run(
        ["losetup", "-l", "-n", "-O", "NAME", "-j", str(image)],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return out.split()


def _btrfs(*args: str) -> str:
    return subprocess.run(["btrfs", *args], check=True, capture_output=True, text=True).stdout


def _field(show: str, name: str) -> str:
    """One field of ``btrfs subvolume show`` output."""
    for line in show.splitlines():
        key, _, value = line.strip().partition(":")
        if key == name:
            return value.strip()
    raise AssertionError(f"no {name} in {show!r}")


async def _open(data_dir: Path, quotas: bool = True) -> BtrfsPool:
    broker = broker_for(data_dir / "run")
    return await BtrfsPool.open(
        pool_path=None, data_dir=data_dir, size_gib=2, broker=broker, quotas=quotas
    )


@pytest.fixture
def runner() -> Iterator[asyncio.Runner]:
    with asyncio.Runner() as r:
        yield r


@pytest.fixture
def pool(data_dir: Path, runner: asyncio.Runner) -> Iterator[BtrfsPool]:
    pool = runner.run(_open(data_dir))
    try:
        yield pool
    finally:
        runner.run(pool.close(unmount=True))
    assert not os.path.ismount(pool.root)


def test_pool_on_a_loop_file_is_mounted_and_reused_when_opened_again(
    pool: BtrfsPool, data_dir: Path, runner: asyncio.Runner
) -> None:
    assert os.path.ismount(pool.root)
    assert (pool.root / "templates").is_dir() and (pool.root / "sandboxes").is_dir()
    again = runner.run(_open(data_dir))
    assert again.root == pool.root
    assert len(loops_of(data_dir / "pool.img")) == 1
    # What a crafted image could hold (a set-user-id file, a device) is of no use.
    options = next(
        line.split()[5].split(",")
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split()[4] == str(pool.root)
    )
    assert "nosuid" in options and "nodev" in options


def test_an_unmounted_pool_leaves_no_loop_device(data_dir: Path, runner: asyncio.Runner) -> None:
    pool = runner.run(_open(data_dir))
    assert len(loops_of(data_dir / "pool.img")) == 1
    runner.run(pool.close(unmount=True))
    assert not os.path.ismount(pool.root)
    assert loops_of(data_dir / "pool.img") == []


def test_template_import_is_read_only_and_idempotent(
    pool: BtrfsPool, runner: asyncio.Runner, image_files: dict[str, Any]
) -> None:
    vol = runner.run(pool.import_template("base", "d1", **image_files))
    assert vol.kernel.read_bytes() == b"kernel"
    assert "ro=true" in _btrfs("property", "get", "-ts", str(vol.path), "ro")
    again = runner.run(pool.import_template("base", "d1", **image_files))
    assert again == vol
    assert [t.digest for t in pool.templates()] == ["d1"]


def test_a_template_published_grown_has_its_disk_and_leaves_its_source_as_it_was(
    pool: BtrfsPool, runner: asyncio.Runner, image_files: dict[str, Any]
) -> None:
    base = runner.run(pool.import_template("base", "d1", **image_files))
    digest = "c" * 64
    grown = runner.run(pool.publish_template("steps-none", digest, base, grow_mib=IMAGE_MIB * 2))
    assert grown.rootfs.stat().st_size == IMAGE_MIB * 2 << 20
    assert base.rootfs.stat().st_size == IMAGE_MIB << 20
    fsck = subprocess.run(["e2fsck", "-fn", str(grown.rootfs)], capture_output=True)
    assert fsck.returncode == 0, fsck.stdout
    assert "ro=true" in _btrfs("property", "get", "-ts", str(grown.path), "ro")
    assert pool.template("steps-none", digest) == grown
    again = runner.run(pool.publish_template("steps-none", digest, base, grow_mib=IMAGE_MIB * 2))
    assert again == grown


def test_sandbox_volume_is_an_o1_snapshot_with_a_grown_rootfs(
    pool: BtrfsPool, runner: asyncio.Runner, image_files: dict[str, Any]
) -> None:
    vol = runner.run(pool.import_template("base", "d1", **image_files))
    start = time.monotonic()
    path = runner.run(
        pool.create_sandbox_volume("sb-1", vol, disk_mib=IMAGE_MIB * 2, limit_mib=None)
    )
    elapsed = time.monotonic() - start
    # The volume's parent is the template subvolume: a CoW snapshot, not a copy.
    template_uuid = _field(_btrfs("subvolume", "show", str(vol.path)), "UUID")
    assert _field(_btrfs("subvolume", "show", str(path)), "Parent UUID") == template_uuid
    assert elapsed < 5  # snapshot + resize2fs of a 64 MiB image
    assert (path / "rootfs.img").stat().st_size == IMAGE_MIB * 2 << 20
    assert vol.rootfs.stat().st_size == IMAGE_MIB << 20  # the template is untouched
    fsck = subprocess.run(["e2fsck", "-fn", str(path / "rootfs.img")], capture_output=True)
    assert fsck.returncode == 0, fsck.stdout
    assert pool.sandbox_volumes() == ["sb-1"]
    runner.run(pool.delete_sandbox_volume("sb-1"))
    runner.run(pool.delete_sandbox_volume("sb-1"))  # idempotent
    assert not path.exists() and pool.sandbox_volumes() == []


def test_an_encrypted_template_disk_is_cloned_copy_on_write_and_grown_by_its_file(
    pool: BtrfsPool, runner: asyncio.Runner, image_files: dict[str, Any]
) -> None:
    vol = runner.run(pool.import_template("base", "d1", **image_files, disk_passphrase=b"00" * 32))
    assert disk_format(vol.rootfs) == "luks" and disk_bytes(vol.rootfs) == IMAGE_MIB << 20
    path = runner.run(
        pool.create_sandbox_volume("sb-1", vol, disk_mib=IMAGE_MIB * 2, limit_mib=None)
    )
    assert disk_bytes(path / "rootfs.img") == IMAGE_MIB * 2 << 20
    assert disk_bytes(vol.rootfs) == IMAGE_MIB << 20  # the template is untouched
    # Every extent of the clone is the template's: copy-on-write as with raw images.
    assert runner.run(pool.exclusive_bytes(path)) < 1 << 20
    runner.run(pool.delete_sandbox_volume("sb-1"))


def test_negative_disk_smaller_than_the_image_is_refused_and_leaves_no_volume(
    pool: BtrfsPool, runner: asyncio.Runner, image_files: dict[str, Any]
) -> None:
    vol = runner.run(pool.import_template("base", "d1", **image_files))
    with pytest.raises(InvalidArgument):
        runner.run(pool.create_sandbox_volume("sb-1", vol, disk_mib=IMAGE_MIB - 1, limit_mib=None))
    assert pool.sandbox_volumes() == []


def test_negative_unknown_template_and_bad_names_are_refused(pool: BtrfsPool) -> None:
    with pytest.raises(NotFound):
        pool.template("base", "nope")
    with pytest.raises(InvalidArgument):
        pool.sandbox_path("../etc")


def test_snapshot_of_a_sandbox_volume_is_read_only_and_holds_nothing_of_its_own(
    pool: BtrfsPool, runner: asyncio.Runner, image_files: dict[str, Any]
) -> None:
    vol = runner.run(pool.import_template("base", "d1", **image_files))
    path = runner.run(pool.create_sandbox_volume("sb-1", vol, disk_mib=IMAGE_MIB, limit_mib=None))
    (path / "memory.ram").write_bytes(os.urandom(1 << 20))

    snap = runner.run(pool.snapshot_volume("sb-1", "snap-1"))

    assert "ro=true" in _btrfs("property", "get", "-ts", str(snap), "ro")
    with pytest.raises(OSError):
        (snap / "memory.ram").write_bytes(b"x")
    assert runner.run(pool.exclusive_bytes(snap)) == 0  # every extent shared
    clone = runner.run(pool.clone_volume(snap, "sb-2", limit_mib=None))
    (clone / "memory.ram").write_bytes(b"changed")  # writable, and apart from the snapshot
    assert (snap / "memory.ram").stat().st_size == 1 << 20
    assert pool.snapshot_ids() == ["snap-1"]
    runner.run(pool.delete_snapshot("snap-1"))
    runner.run(pool.delete_snapshot("snap-1"))  # idempotent
    assert pool.snapshot_ids() == []
    for sid in ("sb-1", "sb-2"):
        runner.run(pool.delete_sandbox_volume(sid))


@pytest.mark.parametrize("name", ["", "a/b", "x" * 4040])
def test_negative_a_snapshot_name_the_ioctl_cannot_take_is_refused(name: str) -> None:
    with pytest.raises(InvalidArgument):
        pack_snapshot_args(0, name, read_only=True)
    assert len(pack_snapshot_args(0, "x" * 4039, read_only=True)) == 4096


def test_a_woken_image_maps_the_ram_file_it_can_share_else_its_own_copy(
    pool: BtrfsPool, runner: asyncio.Runner, image_files: dict[str, Any]
) -> None:
    vol = runner.run(pool.import_template("base", "d1", **image_files))
    path = runner.run(pool.create_sandbox_volume("sb-1", vol, disk_mib=IMAGE_MIB, limit_mib=None))
    (path / MEMORY_FILE).write_bytes(os.urandom(1 << 20))
    ready = pool.root / "templates" / "base" / "d1.ready"
    runner.run(snapshot_subvolume(path, ready))  # a ready state: a writable subvolume
    snap = runner.run(pool.snapshot_volume("sb-1", "snap-1"))  # read-only

    # From a ready state: its own file (one inode in the page cache for every sandbox),
    # and the clone's copy goes.
    clone = runner.run(pool.clone_volume(ready, "sb-2", limit_mib=None))
    assert ram_file(clone, ready) == ready / MEMORY_FILE
    assert not (clone / MEMORY_FILE).exists()
    # A read-only snapshot's file cannot be opened read-write, as QEMU 7.2 does even
    # for a private mapping: the clone's copy is mapped instead.
    clone = runner.run(pool.clone_volume(snap, "sb-3", limit_mib=None))
    assert ram_file(clone, snap) == clone / MEMORY_FILE
    assert ram_file(clone, None) == clone / MEMORY_FILE
    # A state that holds the RAM: anonymous memory.
    (clone / MEMORY_FILE).unlink()
    assert ram_file(clone, ready) is None
    runner.run(pool.delete_template_image(ready))
    runner.run(pool.delete_snapshot("snap-1"))
    for sid in ("sb-1", "sb-2", "sb-3"):
        runner.run(pool.delete_sandbox_volume(sid))


def _quotas_on(root: Path) -> bool:
    show = subprocess.run(["btrfs", "qgroup", "show", str(root)], capture_output=True)
    return show.returncode == 0


def _write_until_refused(path: Path, *, start: int, mib: int) -> tuple[int, OSError | None]:
    """Write 1 MiB blocks of random data into ``path`` from offset ``start`` on, up to
    ``mib`` of them, fsyncing each; the count written and the error that stopped it."""
    block = os.urandom(1 << 20)
    fd = os.open(path, os.O_WRONLY)
    try:
        for i in range(mib):
            try:
                os.pwrite(fd, block, start + (i << 20))
                os.fsync(fd)
            except OSError as exc:
                return i, exc
    finally:
        os.close(fd)
    return mib, None


def test_quotas_are_turned_on_when_a_pool_opens_also_an_existing_one_and_again(
    data_dir: Path, runner: asyncio.Runner
) -> None:
    bare = runner.run(_open(data_dir, quotas=False))
    try:
        assert not _quotas_on(bare.root)  # the check can tell
        _btrfs("subvolume", "create", str(bare.root / "sandboxes" / "old"))
        (bare.root / "sandboxes" / "old" / "data").write_bytes(os.urandom(8 << 20))
        for _ in range(2):  # on an existing pool with data; then once more, a no-op
            pool = runner.run(_open(data_dir))
            assert _quotas_on(pool.root)
            os.sync()
            # The scan that turning them on starts has counted what was there.
            referenced = runner.run(pool.referenced_bytes(pool.root / "sandboxes" / "old"))
            assert 8 << 20 <= referenced < 9 << 20
        assert len(loops_of(data_dir / "pool.img")) == 1
    finally:
        runner.run(bare.close(unmount=True))


def test_negative_a_volume_refuses_writes_past_its_quota_and_a_snapshot_frees_no_room(
    pool: BtrfsPool, runner: asyncio.Runner, image_files: dict[str, Any]
) -> None:
    vol = runner.run(pool.import_template("base", "d1", **image_files))
    limit_mib = 96
    path = runner.run(
        pool.create_sandbox_volume("sb-1", vol, disk_mib=4 * IMAGE_MIB, limit_mib=limit_mib)
    )
    free = runner.run(pool.referenced_bytes(path))
    written, error = _write_until_refused(path / "rootfs.img", start=IMAGE_MIB << 20, mib=256)
    assert error is not None and error.errno == errno.EDQUOT
    os.sync()
    referenced = runner.run(pool.referenced_bytes(path))
    assert referenced <= limit_mib << 20
    # Refused near the limit, not long before it: what the template shares counts too.
    assert (limit_mib << 20) - free - (2 << 20) <= written << 20 <= limit_mib << 20
    # A snapshot shares every extent, yet the volume's own count stays: still refused.
    runner.run(pool.snapshot_volume("sb-1", "snap-1"))
    again, error = _write_until_refused(path / "rootfs.img", start=200 << 20, mib=4)
    assert again == 0 and error is not None and error.errno == errno.EDQUOT
    # The pool itself is far from full, and a volume without a limit writes on.
    other = runner.run(
        pool.create_sandbox_volume("sb-2", vol, disk_mib=4 * IMAGE_MIB, limit_mib=None)
    )
    assert _write_until_refused(other / "rootfs.img", start=IMAGE_MIB << 20, mib=128) == (128, None)
    runner.run(pool.delete_snapshot("snap-1"))
    for sid in ("sb-1", "sb-2"):
        runner.run(pool.delete_sandbox_volume(sid))  # a volume at its limit still goes
    assert pool.sandbox_volumes() == []


def test_a_volume_near_its_quota_rewrites_a_saved_state_of_its_ram(
    pool: BtrfsPool, runner: asyncio.Runner, image_files: dict[str, Any]
) -> None:
    # As a hibernation does (space.node.vmm.qemu save_state: O_TRUNC, then the RAM):
    # the old state's extents are freed only at the commit, which btrfs makes when the
    # new ones would pass the limit.
    vol = runner.run(pool.import_template("base", "d1", **image_files))
    path = runner.run(pool.create_sandbox_volume("sb-1", vol, disk_mib=IMAGE_MIB, limit_mib=100))
    state = os.urandom(64 << 20)
    (path / "vmstate").write_bytes(state)
    os.sync()
    # Two states would pass the limit: the rewrite must reuse the room of the old one.
    assert runner.run(pool.referenced_bytes(path)) + len(state) > 100 << 20
    for _ in range(3):
        fd = os.open(path / "vmstate", os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, state)
            os.fsync(fd)
        finally:
            os.close(fd)
    assert (path / "vmstate").stat().st_size == 64 << 20
    runner.run(pool.delete_sandbox_volume("sb-1"))


def test_negative_a_quota_limit_on_a_pool_without_quotas_is_unavailable(
    data_dir: Path, runner: asyncio.Runner
) -> None:
    bare = runner.run(_open(data_dir, quotas=False))
    try:
        volume = bare.sandbox_path("sb-1")
        _btrfs("subvolume", "create", str(volume))
        with pytest.raises(Unavailable, match="quota limit"):
            runner.run(bare.limit(volume, 1 << 30))
        with pytest.raises(Unavailable):
            runner.run(bare.clone_volume(volume, "sb-2", limit_mib=64))
        assert bare.sandbox_volumes() == ["sb-1"]  # the failed clone left nothing
        runner.run(bare.delete_sandbox_volume("sb-1"))
    finally:
        runner.run(bare.close(unmount=True))


def test_a_restarted_node_limits_the_volumes_made_before_its_pool_had_quotas(
    data_dir: Path, runner: asyncio.Runner, image_files: dict[str, Any]
) -> None:
    bare = runner.run(_open(data_dir, quotas=False))
    try:
        vol = runner.run(bare.import_template("base", "d1", **image_files))
        old = runner.run(
            bare.create_sandbox_volume("sb-old", vol, disk_mib=IMAGE_MIB, limit_mib=None)
        )
        pool = runner.run(_open(data_dir))
        spec = SandboxSpec("sb-old", memory_mib=128, disk_mib=1024)
        sandbox = SimpleNamespace(
            sandbox_id="sb-old", volume=old, record=SimpleNamespace(spec=spec)
        )
        gone = SimpleNamespace(  # its volume went with an interrupted delete: nothing to do
            sandbox_id="sb-gone", volume=pool.sandbox_path("sb-gone"), record=sandbox.record
        )
        said: list[str] = []
        node = SimpleNamespace(
            sandboxes={"sb-old": sandbox, "sb-gone": gone}, life=SimpleNamespace(pool=pool)
        )
        runner.run(_limit_volumes(cast(Any, node), said.append))
        assert said == []
        limits = _btrfs("qgroup", "show", "-r", "--raw", "-f", str(old)).splitlines()[-1]
        assert int(limits.split()[3]) == volume_limit_mib(1024, 128) << 20
    finally:
        runner.run(bare.close(unmount=True))


def test_a_pool_a_root_node_made_becomes_the_unprivileged_agents_with_its_snapshots(
    pool: BtrfsPool, runner: asyncio.Runner, image_files: dict[str, Any], data_dir: Path
) -> None:
    agent, jail = (4242, 4343), JAIL_UIDS[3]
    vol = runner.run(pool.import_template("base", "d1", **image_files))
    sandbox = runner.run(
        pool.create_sandbox_volume("sb-1", vol, disk_mib=IMAGE_MIB, limit_mib=None)
    )
    os.chown(sandbox / "rootfs.img", jail, jail)  # what a jail was handed
    snapshot = runner.run(pool.snapshot_volume("sb-1", "snap-1"))
    scope = Scope(data_dir / "agent-run", (data_dir,), agent)
    with root_broker_of(scope) as broker:
        asyncio.run(broker.call(AdoptPool(root=str(pool.root))))
    for path in (pool.root, vol.path, vol.kernel, sandbox, snapshot, snapshot / "kernel"):
        assert (path.stat().st_uid, path.stat().st_gid) == agent, path
    for disk in (sandbox / "rootfs.img", snapshot / "rootfs.img"):
        info = disk.stat()
        assert (info.st_uid, info.st_gid, info.st_mode & 0o060) == (jail, agent[1], 0o060)
    for read_only in (vol.path, snapshot):  # still read-only
        assert "ro=true" in _btrfs("property", "get", "-ts", str(read_only), "ro")
    assert pool.root.stat().st_mode & 0o777 == 0o700
