"""Subvolumes as send streams through the root broker (issue 19): what it sends, what it
receives, and what it refuses, leaving nothing behind.

Needs root (a loop-mounted btrfs pool); fails loudly without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import struct
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from space.node.api import InvalidArgument
from space.node.core.send_stream import SendStreamFraming
from space.node.privileged._streams import send_subvolume
from space.node.privileged.pinned import pin
from space.node.privileged.requests import ReceiveSubvolume, SendSubvolume
from space.node.storage.btrfs import BtrfsPool, snapshot_subvolume
from space.node.storage.streams import (
    adopt_received,
    receive_stream,
    send_stream,
    subvolume_ids,
)
from tests.root_broker import root_broker
from tests.unit.test_btrfs_pool import _open, loops_of

_MIB = 1 << 20


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.fail("the stream tests mount a loop file: run them as root")
    with root_broker(tmp_path):
        yield tmp_path
    subprocess.run(["umount", str(tmp_path / "pool")], capture_output=True, check=False)
    assert not loops_of(tmp_path / "pool.img")


@pytest.fixture
def runner() -> Iterator[asyncio.Runner]:
    with asyncio.Runner() as r:
        yield r


@pytest.fixture
def pool(data_dir: Path, runner: asyncio.Runner) -> Iterator[BtrfsPool]:
    pool = runner.run(_open(data_dir, quotas=False))
    try:
        yield pool
    finally:
        runner.run(pool.close(unmount=True))


def _subvolume(pool: BtrfsPool, name: str, files: dict[str, bytes]) -> Path:
    """A read-only subvolume ``name`` in the pool holding ``files``."""
    path = pool.root / name
    subprocess.run(["btrfs", "subvolume", "create", str(path)], check=True, capture_output=True)
    for file, data in files.items():
        (path / file).write_bytes(data)
    os.sync()
    subprocess.run(["btrfs", "property", "set", "-ts", str(path), "ro", "true"], check=True)
    return path


async def _sent(pool: BtrfsPool, path: Path, parent: Path | None = None) -> bytes:
    return b"".join([chunk async for chunk in send_stream(pool.broker, path, parent)])


async def _chunks(data: bytes, size: int = 100_000) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def _staging(pool: BtrfsPool) -> Path:
    directory = pool.root / "incoming" / os.urandom(4).hex()
    directory.mkdir(parents=True)
    return directory


def test_a_subvolume_sent_and_received_arrives_whole_and_is_handed_to_the_agent(
    pool: BtrfsPool, runner: asyncio.Runner
) -> None:
    payload = os.urandom(3 * _MIB)
    source = _subvolume(pool, "source", {"disk": payload, "state": b"saved"})
    stream = runner.run(_sent(pool, source))
    assert stream.startswith(b"btrfs-stream\0")
    staging = _staging(pool)
    received = runner.run(
        receive_stream(pool.broker, pool.root, staging, _chunks(stream), max_bytes=len(stream))
    )
    assert received.sha256 == hashlib.sha256(stream).hexdigest()
    assert received.stream_bytes == len(stream)
    assert (received.path / "disk").read_bytes() == payload
    assert subvolume_ids(received.path).received_uuid == subvolume_ids(source).uuid
    runner.run(adopt_received(pool.broker, received.path, writable=True))
    info = (received.path / "disk").stat()
    assert (info.st_uid, info.st_mode & 0o777) == (os.geteuid(), 0o600)
    (received.path / "new").write_bytes(b"writable")  # a sandbox's volume again


def _received(pool: BtrfsPool, runner: asyncio.Runner, source: Path) -> Path:
    stream = runner.run(_sent(pool, source))
    staging = _staging(pool)
    return runner.run(
        receive_stream(pool.broker, pool.root, staging, _chunks(stream), max_bytes=len(stream))
    ).path


def test_a_gvisor_volume_keeps_its_guest_s_tree_as_sent_and_the_rest_is_the_agent_s(
    pool: BtrfsPool, runner: asyncio.Runner
) -> None:
    """Its guest root's owners, modes and links are the guest's (a move or an archive
    of a gVisor sandbox must wake with them); its saved state beside it becomes the
    agent's, as a VM volume's files do. A volume without a root directory, or with a
    link in its place, is refused."""
    path = pool.root / "gvisor-volume"
    subprocess.run(["btrfs", "subvolume", "create", str(path)], check=True, capture_output=True)
    (path / "vmstate").write_bytes(b"sealed")
    root = path / "rootfs"
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "bin").symlink_to("usr/bin")
    tool = root / "usr" / "bin" / "tool"
    tool.write_bytes(b"#!/bin/sh\n")
    os.chown(tool, 0, 0)
    tool.chmod(0o4755)
    home = root / "home" / "user"
    home.mkdir(parents=True)
    (home / "notes").write_bytes(b"mine")
    os.chown(home / "notes", 1000, 1000)
    (home / "notes").chmod(0o640)
    os.sync()
    subprocess.run(["btrfs", "property", "set", "-ts", str(path), "ro", "true"], check=True)

    received = _received(pool, runner, path)
    runner.run(adopt_received(pool.broker, received, writable=True, guest_tree=True))
    state = (received / "vmstate").stat()
    assert (state.st_uid, state.st_mode & 0o777) == (os.geteuid(), 0o600)
    assert os.readlink(received / "rootfs" / "bin") == "usr/bin"
    kept = (received / "rootfs" / "usr" / "bin" / "tool").stat()
    assert kept.st_mode & 0o7777 == 0o4755  # nothing to the host: the pool is nosuid
    notes = (received / "rootfs" / "home" / "user" / "notes").stat()
    assert (notes.st_uid, notes.st_gid, notes.st_mode & 0o777) == (1000, 1000, 0o640)

    for name, make in (
        ("no-root", lambda p: None),
        ("linked-root", lambda p: (p / "rootfs").symlink_to("/")),
    ):
        bad = pool.root / name
        subprocess.run(["btrfs", "subvolume", "create", str(bad)], check=True, capture_output=True)
        (bad / "vmstate").write_bytes(b"sealed")
        make(bad)
        subprocess.run(["btrfs", "property", "set", "-ts", str(bad), "ro", "true"], check=True)
        received = _received(pool, runner, bad)
        with pytest.raises(InvalidArgument, match="holds no guest root directory"):
            runner.run(adopt_received(pool.broker, received, writable=True, guest_tree=True))


def test_an_incremental_stream_carries_only_what_differs_from_the_parent(
    pool: BtrfsPool, runner: asyncio.Runner
) -> None:
    template = _subvolume(pool, "template", {"disk": os.urandom(4 * _MIB)})
    sandbox = pool.root / "sandbox"
    runner.run(snapshot_subvolume(template, sandbox))
    (sandbox / "written").write_bytes(b"a file the guest wrote")
    frozen = pool.root / "sandbox.ro"
    runner.run(snapshot_subvolume(sandbox, frozen, read_only=True))
    full = runner.run(_sent(pool, frozen))
    incremental = runner.run(_sent(pool, frozen, template))
    assert len(incremental) < len(full) / 100
    staging = _staging(pool)
    received = runner.run(
        receive_stream(pool.broker, pool.root, staging, _chunks(incremental), max_bytes=_MIB)
    )
    assert (received.path / "written").read_bytes() == b"a file the guest wrote"
    assert (received.path / "disk").read_bytes() == (template / "disk").read_bytes()


@pytest.mark.parametrize(
    "cut",
    [
        pytest.param(lambda s: b"not a btrfs stream at all" * 100, id="not-a-stream"),
        pytest.param(lambda s: s[: len(s) - 7], id="truncated-mid-command"),
        pytest.param(lambda s: s[: len(s) // 2], id="truncated-half"),
        pytest.param(lambda s: s + s[17:], id="two-subvolumes"),
    ],
)
@pytest.mark.parametrize("by", ["agent", "broker"])
def test_negative_a_bad_or_cut_stream_is_refused_and_leaves_nothing(
    pool: BtrfsPool, runner: asyncio.Runner, cut: object, by: str
) -> None:
    source = _subvolume(pool, "source", {"disk": os.urandom(2 * _MIB)})
    stream = runner.run(_sent(pool, source))
    bad = cut(stream)  # type: ignore[operator]
    staging = _staging(pool)
    with pytest.raises(InvalidArgument):
        if by == "agent":
            runner.run(
                receive_stream(pool.broker, pool.root, staging, _chunks(bad), max_bytes=_MIB * 8)
            )
        else:
            runner.run(_broker_receive(pool, staging, bad, _MIB * 8))
    assert list(staging.iterdir()) == []


def test_negative_a_stream_that_loses_its_framing_is_refused_naming_where(
    pool: BtrfsPool, runner: asyncio.Runner
) -> None:
    source = _subvolume(pool, "source", {"disk": os.urandom(_MIB)})
    stream = runner.run(_sent(pool, source))
    first, command = struct.unpack_from("<IH", stream, 17)  # after the 17-byte header
    at = 17 + 10 + first
    bad = stream[:at] + struct.pack("<IHI", 0x94D5_DAAD, 7, 0) + stream[at:]
    where = (
        f"a stream command 7 of {0x94D5_DAAD} bytes (header {bad[at : at + 10].hex()}"
        f" at byte {at}, command 2; the one before: {command}, of {first} bytes)"
    )
    # The agent reads it before the broker does: refused as it read it.
    staging = _staging(pool)
    with pytest.raises(InvalidArgument) as refused:
        runner.run(
            receive_stream(pool.broker, pool.root, staging, _chunks(bad), max_bytes=_MIB * 8)
        )
    assert refused.value.message == where
    assert list(staging.iterdir()) == []
    # An agent that does not (a hostile one) meets the broker's own check.
    with pytest.raises(InvalidArgument) as refused:
        runner.run(_broker_receive(pool, staging, bad, _MIB * 8))
    assert refused.value.message == f"receive_subvolume: {where}"
    assert list(staging.iterdir()) == []


@pytest.mark.parametrize(
    "command", [pytest.param(0, id="unspecified"), pytest.param(27, id="past-the-last")]
)
def test_negative_a_command_no_send_stream_has_is_refused_by_the_broker(
    pool: BtrfsPool, runner: asyncio.Runner, command: int
) -> None:
    source = _subvolume(pool, "source", {"disk": os.urandom(_MIB)})
    stream = runner.run(_sent(pool, source))
    first = struct.unpack_from("<I", stream, 17)[0]
    at = 17 + 10 + first
    bad = stream[:at] + struct.pack("<IHI", 0, command, 0) + stream[at:]
    staging = _staging(pool)
    with pytest.raises(InvalidArgument, match=f"a stream command {command} of 0 bytes"):
        runner.run(_broker_receive(pool, staging, bad, _MIB * 8))
    assert list(staging.iterdir()) == []


async def _broker_receive(pool: BtrfsPool, directory: Path, data: bytes, max_bytes: int) -> None:
    """Hand ``data`` to the broker's receive as a hostile agent would: unchecked."""
    read_end, write_end = os.pipe()
    request = ReceiveSubvolume(pool=str(pool.root), directory=str(directory), max_bytes=max_bytes)
    receiving = asyncio.ensure_future(pool.broker.call(request, fds=(read_end,), give=True))

    def write() -> None:
        with contextlib.suppress(BrokenPipeError), open(write_end, "wb") as pipe:
            pipe.write(data)

    await asyncio.to_thread(write)
    await receiving


@pytest.mark.parametrize("restart", [False, True], ids=["eintr", "sa-restart"])
def test_a_send_signalled_while_it_waits_is_one_whole_stream(
    pool: BtrfsPool, restart: bool
) -> None:
    """A signal that lands on the thread in the send ioctl while the pipe is full ended
    the send (EINTR: a cut stream) or, for a handler that restarts system calls (as
    asyncio's signal handlers do), began it again from its first byte into the same
    pipe: two streams in one (seen in the many-hosts test, whose broker's children end
    and signal it all the time). The broker blocks signals in that thread."""
    source = _subvolume(pool, "source", {"disk": os.urandom(8 * _MIB)})
    read_end, write_end = os.pipe()
    failure: list[BaseException] = []

    def send() -> None:
        held = pin(str(source))
        try:
            send_subvolume(held, None, write_end)
        except BaseException as exc:
            failure.append(exc)
        finally:
            os.close(write_end)
            held.close()

    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    signal.siginterrupt(signal.SIGUSR1, not restart)
    try:
        sender = threading.Thread(target=send)
        sender.start()
        stream = bytearray()
        while chunk := os.read(read_end, 65536):
            stream += chunk
            if sender.is_alive() and sender.ident is not None:
                signal.pthread_kill(sender.ident, signal.SIGUSR1)
            time.sleep(0.001)  # the pipe fills: the ioctl waits in its write
        sender.join()
    finally:
        os.close(read_end)
        signal.signal(signal.SIGUSR1, previous)
    assert failure == []
    assert stream.count(b"btrfs-stream\0") == 1
    framing = SendStreamFraming()
    framing.feed(stream)
    framing.finish()


def test_negative_a_stream_one_byte_over_its_limit_is_refused_and_leaves_nothing(
    pool: BtrfsPool, runner: asyncio.Runner
) -> None:
    source = _subvolume(pool, "source", {"disk": os.urandom(_MIB)})
    stream = runner.run(_sent(pool, source))
    staging = _staging(pool)
    with pytest.raises(InvalidArgument, match="limit"):
        runner.run(
            receive_stream(
                pool.broker, pool.root, staging, _chunks(stream), max_bytes=len(stream) - 1
            )
        )
    assert list(staging.iterdir()) == []
    received = runner.run(
        receive_stream(pool.broker, pool.root, staging, _chunks(stream), max_bytes=len(stream))
    )
    assert received.stream_bytes == len(stream)


def test_negative_a_receive_outside_the_pool_or_into_a_full_directory_is_refused(
    pool: BtrfsPool,
    runner: asyncio.Runner,
    data_dir: Path,
) -> None:
    source = _subvolume(pool, "source", {"disk": b"x"})
    stream = runner.run(_sent(pool, source))
    outside = data_dir / "not-the-pool"
    outside.mkdir()
    for directory in (outside, Path("/tmp"), pool.root / "source"):
        with pytest.raises(InvalidArgument):
            runner.run(
                receive_stream(pool.broker, pool.root, directory, _chunks(stream), max_bytes=_MIB)
            )
    assert list(outside.iterdir()) == []
    assert sorted(p.name for p in (pool.root / "source").iterdir()) == ["disk"]


def test_negative_only_a_read_only_subvolume_of_the_pool_is_sent(
    pool: BtrfsPool, runner: asyncio.Runner
) -> None:
    writable = pool.root / "writable"
    subprocess.run(["btrfs", "subvolume", "create", str(writable)], check=True, capture_output=True)
    with pytest.raises(InvalidArgument, match="read-only subvolume"):
        runner.run(_sent(pool, writable))
    with pytest.raises(InvalidArgument, match="outside"):
        runner.run(_sent(pool, Path("/etc")))


def test_negative_a_stream_request_without_a_pipe_is_refused(
    pool: BtrfsPool, runner: asyncio.Runner
) -> None:
    source = _subvolume(pool, "source", {"disk": b"x"})
    with pytest.raises(InvalidArgument, match="pipe"):
        runner.run(pool.broker.call(SendSubvolume(path=str(source), parent=None)))
    with open(source / "disk", "rb") as f, pytest.raises(InvalidArgument, match="pipe"):
        request = ReceiveSubvolume(pool=str(pool.root), directory=str(_staging(pool)), max_bytes=9)
        runner.run(pool.broker.call(request, fds=(f.fileno(),)))
