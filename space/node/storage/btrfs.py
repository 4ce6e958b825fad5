"""The node's btrfs pool: read-only template subvolumes and per-sandbox CoW snapshots.

Layout::

    <pool>/templates/<name>/<digest>/   read-only subvolume: kernel, initrd, rootfs.img
    <pool>/sandboxes/<id>/              writable snapshot of a template subvolume (or of a
                                        sandbox snapshot); also holds the guest RAM file
    <pool>/snapshots/<id>/              read-only snapshot of a sandbox volume
    <pool>/layers/<digest>/             read-only: a template build step's result (the
                                        template files of its build VM, paused)

A sandbox volume is a subvolume snapshot, O(1) whatever the image size; its rootfs
image (LUKS, see disks.py) is grown right after the snapshot and before any boot, and
never touched by the host again once a guest may have written to it.

Quota groups (issue 17): ``open`` turns btrfs quotas on, and every sandbox volume is
made with a limit on what it may reference (``limit_mib``; the figure is
space.node.core.capacity.volume_limit_mib's). Referenced, not exclusive: what a volume
shares with its template, its snapshots or its fork siblings counts too, so taking a
snapshot or deleting a template never frees room for more writes, and the bound holds
whatever else refers to the same extents. A write past the limit fails with EDQUOT
(QEMU reports it to the guest as an I/O error); a guest that fills its ext4, which is
sized to its disk, gets ENOSPC from its own filesystem first.

Every method raises space.node.api.errors leaves (Unavailable for a failed command,
InvalidArgument for a bad name). What btrfs lets a subvolume's owner do (make one,
snapshot it, make it read-only) is done here; the rest (the loop mount, quotas and
limits, sizes, deletion) is asked of the node's root broker (space.node.privileged).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from space.node.api import InvalidArgument, NotFound, Unavailable
from space.node.core.data_dir import secure_top_level
from space.node.core.run import run
from space.node.privileged import RootBroker
from space.node.privileged.requests import (
    AdoptPool,
    DeleteSubvolume,
    EnableQuotas,
    ExclusiveBytes,
    LimitSubvolume,
    MountPool,
    ReferencedBytes,
    Request,
    UnmountPool,
    unpacking_name,
)
from space.node.storage.disks import encrypt_image, grow_disk

__all__ = [
    "BtrfsPool",
    "TemplateVolume",
    "is_layer_of",
    "pack_snapshot_args",
    "snapshot_subvolume",
]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_DIGEST_RE = re.compile(r"^[A-Za-z0-9]{1,128}$")
_COMPLETE_MARK = ".complete"
#: gVisor trees (issue 21): ``<pool>/gvisor/<digest>``, and while one is unpacked,
#: root's scratch directory beside it (requests.unpacking_name).
_TREES = "gvisor"
_TEMPLATE_FILES = ("kernel", "initrd", "rootfs.img")


def _check_name(kind: str, name: str) -> str:
    if not _NAME_RE.match(name) or ".." in name:
        raise InvalidArgument(f"invalid {kind} {name!r}: want [A-Za-z0-9_.-], at most 63")
    return name


def _unpacking_of(name: str) -> str | None:
    """The digest whose unpacking scratch directory ``name`` is, or None."""
    digest = name[1:].partition(".")[0]
    return digest if _DIGEST_RE.match(digest) and unpacking_name(digest) == name else None


def _check_digest(digest: str) -> str:
    if not _DIGEST_RE.match(digest):
        raise InvalidArgument(f"invalid digest {digest!r}: want [A-Za-z0-9], at most 128")
    return digest


@dataclass(frozen=True, slots=True)
class TemplateVolume:
    """An imported template: its subvolume and the files in it."""

    name: str
    digest: str
    path: Path

    @property
    def kernel(self) -> Path:
        return self.path / "kernel"

    @property
    def initrd(self) -> Path:
        return self.path / "initrd"

    @property
    def rootfs(self) -> Path:
        return self.path / "rootfs.img"


class BtrfsPool:
    """A btrfs filesystem the node owns (see the module docstring).

    Create with ``await BtrfsPool.open(...)``; ``close(unmount=True)`` unmounts a pool
    this object loop-mounted (and detaches its loop device). Without a ``broker``
    nothing that needs root can be done (a pool only read, in tests).
    """

    def __init__(
        self,
        root: Path,
        *,
        image: Path | None,
        mounted_here: bool,
        fresh_mount: bool = False,
        broker: RootBroker | None = None,
    ) -> None:
        self.root = root
        self._broker = broker
        self._image = image
        self._mounted_here = mounted_here
        #: True if ``open`` mounted it just now (it was not mounted before).
        self.fresh_mount = fresh_mount

    @classmethod
    async def open(
        cls,
        *,
        pool_path: Path | None,
        data_dir: Path,
        size_gib: int,
        broker: RootBroker,
        quotas: bool = True,
    ) -> BtrfsPool:
        """Use ``pool_path`` (must be btrfs) or the loop file ``data_dir/pool.img``.

        The loop file is created sparse and formatted on first use; if it is already
        mounted at ``data_dir/pool`` that mount is reused. With ``quotas`` (off only to
        measure their cost) btrfs quotas are turned on, also on an existing pool, and
        their first scan awaited. Idempotent.
        """
        if pool_path is not None:
            await _require_btrfs(pool_path)
            if (await asyncio.to_thread(pool_path.stat)).st_uid != os.geteuid():  # the agent's
                await broker.call(AdoptPool(root=str(pool_path)))
            pool = cls(pool_path, image=None, mounted_here=False, broker=broker)
        else:
            pool = await cls._open_loop(data_dir, size_gib, broker)
        if quotas:
            await pool.enable_quotas()
        for sub in ("templates", "sandboxes", "snapshots", "layers"):
            (pool.root / sub).mkdir(exist_ok=True)
        # Owner-only, also on a pool made before issue 18 (its root was 0755).
        secure_top_level(pool.root)
        return pool

    async def enable_quotas(self) -> None:
        """Turn btrfs quota groups on and wait until their figures are right; idempotent.

        On a pool that had them off, the kernel scans what exists (seconds for a few
        GiB); a pool that has them on returns at once. Raises Unavailable if it fails.
        """
        await self._ask(EnableQuotas(root=str(self.root)))

    async def referenced_bytes(self, path: Path) -> int:
        """Bytes the subvolume ``path`` refers to, as its quota group counts them
        (committed figures: call after a sync). Raises Unavailable without quotas."""
        return _as_int(await self._ask(ReferencedBytes(path=str(path))))

    async def limit(self, path: Path, max_referenced: int) -> None:
        """Limit the quota group of subvolume ``path`` to reference ``max_referenced``
        bytes. Needs quotas on (``enable_quotas``); raises Unavailable (with the errno's
        message) if it fails. Idempotent: the limit replaces any earlier one."""
        await self._ask(LimitSubvolume(path=str(path), max_referenced=max_referenced))

    @classmethod
    async def _open_loop(cls, data_dir: Path, size_gib: int, broker: RootBroker) -> BtrfsPool:
        image, mountpoint = data_dir / "pool.img", data_dir / "pool"
        mounted, created = await asyncio.to_thread(_prepare_loop_files, image, size_gib)
        if mounted:
            await _require_btrfs(mountpoint)
            if (await asyncio.to_thread(mountpoint.stat)).st_uid != os.geteuid():  # made by root
                await broker.call(AdoptPool(root=str(mountpoint)))
            return cls(mountpoint, image=image, mounted_here=True, broker=broker)
        await broker.call(MountPool(image=str(image), mountpoint=str(mountpoint), mkfs=created))
        return cls(mountpoint, image=image, mounted_here=True, fresh_mount=True, broker=broker)

    async def close(self, *, unmount: bool = False) -> None:
        """Forget the pool; with ``unmount`` also unmount a loop pool and free its loop."""
        if unmount and self._mounted_here and self._image is not None:
            await self._ask(UnmountPool(image=str(self._image), mountpoint=str(self.root)))

    @property
    def broker(self) -> RootBroker:
        """The root broker this pool asks; Unavailable if it has none."""
        if self._broker is None:
            raise Unavailable(f"the pool {self.root} has no root broker")
        return self._broker

    async def _ask(self, request: Request) -> object:
        if self._broker is None:
            raise Unavailable(f"the pool {self.root} has no root broker for {request.op}")
        return await self._broker.call(request)

    # templates

    def template(self, name: str, digest: str) -> TemplateVolume:
        """The template volume ``name``/``digest`` (NotFound unless fully imported)."""
        vol = TemplateVolume(
            _check_name("template", name),
            _check_digest(digest),
            self.root / "templates" / name / digest,
        )
        if not (vol.path / _COMPLETE_MARK).exists():
            raise NotFound(f"template {name}@{digest} is not in the pool")
        return vol

    def templates(self) -> list[TemplateVolume]:
        """Every fully imported template volume."""
        found = []
        for name_dir in sorted((self.root / "templates").iterdir()):
            for dig_dir in sorted(name_dir.iterdir()):
                if (dig_dir / _COMPLETE_MARK).exists():
                    found.append(TemplateVolume(name_dir.name, dig_dir.name, dig_dir))
        return found

    async def import_template(
        self,
        name: str,
        digest: str,
        *,
        kernel: Path,
        initrd: Path,
        rootfs: Path,
        disk_passphrase: bytes | None = None,
    ) -> TemplateVolume:
        """Copy a built image into a read-only subvolume once; idempotent. With a
        ``disk_passphrase`` the rootfs is encrypted on the way in (LUKS, see disks.py).

        A half-finished import (no completion mark) is deleted and redone.
        """
        try:
            return self.template(name, digest)
        except NotFound:
            pass
        path = self.root / "templates" / name / digest
        path.parent.mkdir(exist_ok=True)
        if path.exists():
            await self._delete_subvolume(path)
        await run("btrfs", "subvolume", "create", str(path))
        copies = [(kernel, "kernel"), (initrd, "initrd")]
        if disk_passphrase is None:
            copies.append((rootfs, "rootfs.img"))
        else:
            await encrypt_image(rootfs, path / "rootfs.img", disk_passphrase)
        for src, dst in copies:
            await run("cp", "--reflink=auto", "--sparse=always", str(src), str(path / dst))
        (path / _COMPLETE_MARK).write_text(digest + "\n")
        await asyncio.to_thread(os.sync)
        await run("btrfs", "property", "set", "-ts", str(path), "ro", "true")
        return TemplateVolume(name, digest, path)

    async def delete_template_image(self, path: Path) -> None:
        """Delete a subvolume beside the templates (a ready state); idempotent."""
        if path.parent.parent != self.root / "templates":
            raise InvalidArgument(f"{path} is not beside a template")
        if await asyncio.to_thread(path.exists):
            await self._delete_subvolume(path)

    async def publish_template(
        self, name: str, digest: str, source: TemplateVolume, *, grow_mib: int | None = None
    ) -> TemplateVolume:
        """Make ``source`` (a layer or another template) the template ``name``/``digest``.

        O(1): a read-only snapshot. ``grow_mib`` also grows its disk to that size (only
        for a ``source`` whose image no guest wrote: a template of no disk step on the
        pristine base). Idempotent; replaces a half-made one.
        """
        try:
            return self.template(name, digest)
        except NotFound:
            pass
        path = self.root / "templates" / _check_name("template", name) / _check_digest(digest)
        path.parent.mkdir(exist_ok=True)
        if path.exists():
            await self._delete_subvolume(path)
        if grow_mib is None:
            await snapshot_subvolume(source.path, path, read_only=True)
            return TemplateVolume(name, digest, path)
        await snapshot_subvolume(source.path, path)
        try:
            # Unmarked while it grows, so a crash leaves it half-made (replaced above).
            mark = path / _COMPLETE_MARK
            text = await asyncio.to_thread(mark.read_bytes)
            await asyncio.to_thread(mark.unlink)
            await grow_disk(path / "rootfs.img", grow_mib)
            await asyncio.to_thread(_write_synced, mark, text)
            await run("btrfs", "property", "set", "-ts", str(path), "ro", "true")
        except BaseException:
            await self._delete_subvolume(path)
            raise
        return TemplateVolume(name, digest, path)

    async def delete_template(self, volume: TemplateVolume) -> None:
        """Delete a template's subvolume (sandboxes made from it keep their own); idempotent."""
        if volume.path.parent.parent != self.root / "templates":
            raise InvalidArgument(f"{volume.path} is not a template")
        if await asyncio.to_thread(volume.path.exists):
            await self._delete_subvolume(volume.path)
        with contextlib.suppress(OSError):
            volume.path.parent.rmdir()  # only once no build of the name is left

    # layers

    def layer(self, digest: str) -> TemplateVolume | None:
        """The complete layer of the build step ``digest``, or None."""
        path = self.root / "layers" / _check_digest(digest)
        if (path / _COMPLETE_MARK).exists():
            return TemplateVolume("layer", digest, path)
        return None

    async def save_layer(self, volume: str, digest: str) -> TemplateVolume:
        """Keep a paused build VM's disk (its volume ``volume``) as the read-only layer
        ``digest``.

        Only the template files are kept, not the guest's RAM. Replaces a half-made
        layer of that digest.
        """
        path = self.root / "layers" / _check_digest(digest)
        if path.exists():
            await self._delete_subvolume(path)
        await snapshot_subvolume(self.sandbox_path(volume), path)
        try:
            await asyncio.to_thread(_keep_template_files, path, digest)
            await run("btrfs", "property", "set", "-ts", str(path), "ro", "true")
        except BaseException:
            await self._delete_subvolume(path)
            raise
        return TemplateVolume("layer", digest, path)

    # sandboxes

    # A sandbox volume's name is given once, when it is made (the sandbox's id, or the
    # pool VM's that became the sandbox), and is kept for the volume's life.

    def sandbox_path(self, volume: str) -> Path:
        return self.root / "sandboxes" / _check_name("volume name", volume)

    def sandbox_volumes(self) -> list[str]:
        return sorted(p.name for p in (self.root / "sandboxes").iterdir())

    async def create_sandbox_volume(
        self,
        volume: str,
        template: TemplateVolume,
        *,
        disk_mib: int,
        limit_mib: int | None,
        grow: bool = True,
    ) -> Path:
        """Snapshot the template as the sandbox volume ``volume``, limited to reference
        ``limit_mib`` (None: no limit), and grow its rootfs to ``disk_mib``.

        Raises Conflict-free: an existing volume of the name is replaced (the caller owns
        idempotency). Raises InvalidArgument if ``disk_mib`` is below the image size.
        ``grow`` False keeps the image as it is: for an image a guest wrote, which the
        host must never parse.
        """
        path = await self.clone_volume(template.path, volume, limit_mib=limit_mib)
        try:
            (path / _COMPLETE_MARK).unlink(missing_ok=True)
            if grow:
                await grow_disk(path / "rootfs.img", disk_mib)
        except BaseException:
            await self._delete_subvolume(path)
            raise
        return path

    async def clone_volume(self, source: Path, volume: str, *, limit_mib: int | None) -> Path:
        """Make the sandbox volume ``volume`` a writable snapshot of ``source`` (a
        template, a sandbox volume or a snapshot), limited to reference ``limit_mib``
        (None: no limit), replacing any volume of that name; O(1), copy-on-write.

        On failure no volume of the name remains."""
        path = self.sandbox_path(volume)
        if path.exists():
            await self._delete_subvolume(path)
        await snapshot_subvolume(source, path)
        if limit_mib is not None:
            try:
                await self.limit(path, limit_mib << 20)
            except BaseException:
                await self._delete_subvolume(path)
                raise
        return path

    # snapshots

    def snapshot_path(self, snapshot_id: str) -> Path:
        return self.root / "snapshots" / _check_name("snapshot id", snapshot_id)

    def snapshot_ids(self) -> list[str]:
        return sorted(p.name for p in (self.root / "snapshots").iterdir())

    async def snapshot_volume(self, volume: str, snapshot_id: str) -> Path:
        """A read-only snapshot of the sandbox volume ``volume``, durable on return.

        btrfs writes out the source's dirty data (RAM file pages too) and commits the
        snapshot in its own transaction. Replaces a leftover of the same id.
        """
        path = self.snapshot_path(snapshot_id)
        if path.exists():
            await self._delete_subvolume(path)
        await snapshot_subvolume(self.sandbox_path(volume), path, read_only=True)
        return path

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot's subvolume; idempotent."""
        path = self.snapshot_path(snapshot_id)
        if path.exists():
            await self._delete_subvolume(path)

    async def exclusive_bytes(self, path: Path) -> int:
        """Bytes of data only ``path`` (a subvolume) refers to, by extent sharing.

        Measured with ``btrfs filesystem du`` (needs no quotas); Unavailable if it fails.
        """
        return _as_int(await self._ask(ExclusiveBytes(path=str(path))))

    async def delete_sandbox_volume(self, volume: str) -> None:
        """Delete the sandbox volume ``volume``; idempotent."""
        path = self.sandbox_path(volume)
        if path.exists():
            await self._delete_subvolume(path)

    async def delete_staged(self, path: Path) -> None:
        """Delete a subvolume or directory of a move under ``incoming/`` or ``exports/``
        (issue 19); idempotent."""
        incoming, exports = self.root / "incoming", self.root / "exports"
        if incoming not in (path.parent, path.parent.parent) and path.parent != exports:
            raise InvalidArgument(f"{path} is not a move's")
        await self._delete_subvolume(path)

    # gVisor trees (issue 21)

    def tree_path(self, digest: str) -> Path:
        """Where the directory tree of template ``digest`` is, for gVisor sandboxes
        (made by root: space.node.vmm.gvisor_tree)."""
        return self.root / _TREES / _check_digest(digest)

    def tree_digests(self) -> list[str]:
        """The digests whose tree is made, and those whose unpacking was cut short."""
        try:
            names = os.listdir(self.root / _TREES)
        except FileNotFoundError:
            return []
        found = {n for n in names if _DIGEST_RE.match(n)}
        found |= {d for d in map(_unpacking_of, names) if d is not None}
        return sorted(found)

    async def delete_tree(self, digest: str) -> None:
        """Delete the tree of template ``digest``, and what an unpacking of it cut
        short left (root's scratch directory); idempotent. Sandboxes cloned from it
        keep their volumes."""
        tree = self.tree_path(digest)
        if await asyncio.to_thread(os.path.lexists, tree):
            await self._delete_subvolume(tree)
        await self.delete_unpacking(digest)

    async def delete_unpacking(self, digest: str) -> None:
        """Delete what an unpacking of the tree of ``digest`` cut short left (root's
        scratch directory and the partial tree in it); idempotent."""
        scratch = self.tree_path(digest).with_name(unpacking_name(digest))
        if await asyncio.to_thread(os.path.lexists, scratch):
            await self._delete_subvolume(scratch / "tree")
            with contextlib.suppress(OSError):  # root's, emptied; the next unpack takes it up
                await asyncio.to_thread(os.rmdir, scratch)

    async def _delete_subvolume(self, path: Path) -> None:
        await self._ask(DeleteSubvolume(path=str(path)))


#: BTRFS_IOC_SNAP_CREATE_V2 = _IOW(0x94, 23, struct btrfs_ioctl_vol_args_v2) (linux/btrfs.h).
_SNAP_CREATE_V2 = 0x50009417
_SUBVOL_RDONLY = 1 << 1
#: struct btrfs_ioctl_vol_args_v2: s64 fd, u64 transid, u64 flags, u64 unused[4], then
#: char name[BTRFS_SUBVOL_NAME_MAX + 1 = 4040]; 4096 bytes in all.
_VOL_ARGS_V2 = struct.Struct("=qQQ32x4040s")


def pack_snapshot_args(source_fd: int, name: str, *, read_only: bool) -> bytearray:
    """The ioctl argument that snapshots the subvolume open as ``source_fd`` as ``name``."""
    encoded = name.encode()
    if not encoded or b"/" in encoded or len(encoded) >= 4040:
        raise InvalidArgument(f"invalid subvolume name {name!r}")
    flags = _SUBVOL_RDONLY if read_only else 0
    return bytearray(_VOL_ARGS_V2.pack(source_fd, 0, flags, encoded))


async def snapshot_subvolume(source: Path, dest: Path, *, read_only: bool = False) -> None:
    """Snapshot subvolume ``source`` as ``dest`` (O(1), copy-on-write), durable on return.

    The ioctl itself, not the ``btrfs`` command: spawning that costs more than the
    snapshot. btrfs flushes the source's dirty data and commits the snapshot in its
    own transaction. Raises Unavailable (with the errno's message) if it fails.
    """

    def snapshot() -> None:
        src = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            parent = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                args = pack_snapshot_args(src, dest.name, read_only=read_only)
                fcntl.ioctl(parent, _SNAP_CREATE_V2, args)
            finally:
                os.close(parent)
        finally:
            os.close(src)

    try:
        await asyncio.to_thread(snapshot)
    except OSError as exc:
        raise Unavailable(f"snapshot of {source} as {dest} failed: {exc}") from exc


def is_layer_of(path: Path, digest: str) -> bool:
    """Whether ``path`` holds exactly a layer's files, regular, marked complete as the
    layer ``digest`` (as save_layer leaves it): for a layer received from elsewhere."""
    with os.scandir(path) as entries:
        kinds = {entry.name: entry.stat(follow_symlinks=False).st_mode for entry in entries}
    if set(kinds) != {*_TEMPLATE_FILES, _COMPLETE_MARK}:
        return False
    if not all(stat.S_ISREG(mode) for mode in kinds.values()):
        return False
    with open(path / _COMPLETE_MARK, "rb") as mark:
        return mark.read(200) == f"{digest}\n".encode()


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _keep_template_files(path: Path, digest: str) -> None:
    for entry in path.iterdir():
        if entry.name not in _TEMPLATE_FILES:
            entry.unlink()
    (path / _COMPLETE_MARK).write_text(digest + "\n")
    os.sync()


def _prepare_loop_files(image: Path, size_gib: int) -> tuple[bool, bool]:
    """Make the mountpoint and (sparse) image; returns (already mounted, image created)."""
    mountpoint = image.parent / "pool"
    mountpoint.mkdir(parents=True, exist_ok=True)
    if os.path.ismount(mountpoint):
        return True, False
    if image.exists():
        return False, False
    with open(image, "wb") as f:
        f.truncate(size_gib << 30)
    return False, True


async def _require_btrfs(path: Path) -> None:
    fstype = (await run("stat", "-f", "-c", "%T", str(path))).strip()
    if fstype != "btrfs":
        raise Unavailable(f"{path} is not a btrfs filesystem (it is {fstype})")


def _as_int(value: object) -> int:
    if type(value) is not int:
        raise Unavailable(f"the root broker answered {value!r}, not a number of bytes")
    return value
