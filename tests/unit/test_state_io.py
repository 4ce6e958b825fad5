"""The pipes between QEMU and a ``vmstate`` file (space/node/vmm/state_io.py), with a
thread standing in for QEMU: streams round trip sealed or plain, a state that does not
authenticate stops with Unavailable after only verified bytes went through, and an
error or a cancellation leaves no thread and no descriptor behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from space.node.api import Unavailable
from space.node.vmm.sealed_state import CHUNK_BYTES, HEADER_BYTES, NotAuthentic, open_chunks
from space.node.vmm.state_io import state_reader, state_writer

KEY = os.urandom(32)
DATA = os.urandom(3 * CHUNK_BYTES + 12345)


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture(autouse=True)
def _nothing_left() -> Iterator[None]:
    """Each test must leave the descriptors and threads it found, no more."""
    fds, threads = _fds(), set(threading.enumerate())
    yield
    assert set(threading.enumerate()) == threads
    assert _fds() == fds


def _fake_qemu_writes(fd: int, data: bytes) -> threading.Thread:
    """A 'QEMU' writing ``data`` into its copy ``fd`` of the state descriptor, then
    closing it (as QEMU does when the migration completes)."""

    def run() -> None:
        with contextlib.suppress(BrokenPipeError), os.fdopen(fd, "wb") as out:
            out.write(data)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _fake_qemu_reads(fd: int) -> tuple[threading.Thread, bytearray]:
    """A 'QEMU' reading its copy ``fd`` to the end."""
    got = bytearray()

    def run() -> None:
        with os.fdopen(fd, "rb") as source:
            while block := source.read(1 << 16):
                got.extend(block)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, got


def _unseal(path: Path) -> bytes:
    with path.open("rb") as file:
        return b"".join(open_chunks(KEY, file.read))


async def _save(path: Path, data: bytes, key: bytes | None) -> int:
    async with state_writer(path, key, sandbox_id="sbx") as writer:
        qemu = _fake_qemu_writes(os.dup(writer.qemu_fd), data)
        writer.handed_over()
        await asyncio.to_thread(qemu.join)  # QEMU reports the migration complete
        return await writer.finish(10.0)


def test_a_sealed_save_writes_no_plaintext_and_opens_to_the_stream(tmp_path: Path) -> None:
    path = tmp_path / "vmstate"
    size = asyncio.run(_save(path, DATA, KEY))
    blob = path.read_bytes()
    assert size == len(blob) == HEADER_BYTES + len(DATA) + 4 * 16
    assert DATA[:64] not in blob and DATA[-64:] not in blob
    assert path.stat().st_mode & 0o777 == 0o600
    assert _unseal(path) == DATA


def test_a_save_without_a_key_writes_the_stream_as_it_is(tmp_path: Path) -> None:
    path = tmp_path / "vmstate"
    assert asyncio.run(_save(path, DATA, None)) == len(DATA)
    assert path.read_bytes() == DATA


def test_negative_a_save_that_qemu_ends_half_way_never_authenticates(tmp_path: Path) -> None:
    path = tmp_path / "vmstate"

    async def main() -> None:
        with contextlib.suppress(RuntimeError):
            async with state_writer(path, KEY, sandbox_id="sbx") as writer:
                qemu = _fake_qemu_writes(os.dup(writer.qemu_fd), DATA[: 2 * CHUNK_BYTES])
                writer.handed_over()
                await asyncio.to_thread(qemu.join)
                await asyncio.sleep(0.1)
                raise RuntimeError("the migration failed")  # finish is never called

    asyncio.run(main())
    with pytest.raises(NotAuthentic):
        _unseal(path)


def test_a_save_cancelled_while_qemu_holds_the_pipe_stops_its_thread(tmp_path: Path) -> None:
    async def main() -> None:
        qemu_end = -1

        async def save() -> None:
            nonlocal qemu_end
            async with state_writer(tmp_path / "vmstate", KEY, sandbox_id="sbx") as writer:
                qemu_end = os.dup(writer.qemu_fd)  # a QEMU that never writes nor closes
                writer.handed_over()
                await writer.finish(60.0)

        task = asyncio.create_task(save())
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        os.close(qemu_end)

    asyncio.run(main())


def test_negative_a_state_file_that_cannot_be_written_is_unavailable(tmp_path: Path) -> None:
    async def main() -> None:
        async with state_writer(Path("/dev/full"), KEY, sandbox_id="sbx"):
            pass

    with pytest.raises(Unavailable, match="saved state"):
        asyncio.run(main())
    with pytest.raises(Unavailable, match="No such file"):
        asyncio.run(_load(tmp_path / "missing", KEY))


async def _load(path: Path, key: bytes | None) -> bytes:
    async with state_reader(path, key, sandbox_id="sbx") as reader:
        qemu, got = _fake_qemu_reads(os.dup(reader.qemu_fd))
        reader.handed_over()
        try:
            await asyncio.to_thread(qemu.join)
            reader.check()
            await reader.finish(10.0)
        finally:
            await asyncio.to_thread(qemu.join)
        return bytes(got)


def test_a_sealed_state_loads_as_the_stream_it_was(tmp_path: Path) -> None:
    path = tmp_path / "vmstate"
    asyncio.run(_save(path, DATA, KEY))
    assert asyncio.run(_load(path, KEY)) == DATA


def test_a_plaintext_state_from_before_sealing_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "vmstate"
    path.write_bytes(b"QEVM" + DATA)
    assert asyncio.run(_load(path, KEY)) == b"QEVM" + DATA
    assert asyncio.run(_load(path, None)) == b"QEVM" + DATA


def test_negative_a_tampered_state_stops_the_load_after_verified_chunks_only(
    tmp_path: Path,
) -> None:
    path = tmp_path / "vmstate"
    asyncio.run(_save(path, DATA, KEY))
    blob = bytearray(path.read_bytes())
    blob[HEADER_BYTES + 2 * (CHUNK_BYTES + 16) + 100] ^= 0x01  # in the third chunk
    path.write_bytes(blob)
    got = bytearray()

    async def main() -> None:
        async with state_reader(path, KEY, sandbox_id="sbx") as reader:
            qemu, read = _fake_qemu_reads(os.dup(reader.qemu_fd))
            reader.handed_over()
            await asyncio.to_thread(qemu.join)  # the pipe ends after the bad chunk
            got.extend(read)
            await reader.finish(10.0)

    with pytest.raises(Unavailable, match="the saved state of sandbox sbx does not authenticate"):
        asyncio.run(main())
    assert bytes(got) == DATA[: 2 * CHUNK_BYTES]


def test_negative_a_sealed_state_without_a_key_or_under_another_does_not_load(
    tmp_path: Path,
) -> None:
    path = tmp_path / "vmstate"
    asyncio.run(_save(path, DATA, KEY))
    with pytest.raises(Unavailable, match="sealed and this VM has no key"):
        asyncio.run(_load(path, None))
    with pytest.raises(Unavailable, match="does not authenticate"):
        asyncio.run(_load(path, os.urandom(32)))


def test_a_load_cancelled_while_qemu_reads_nothing_stops_its_thread(tmp_path: Path) -> None:
    path = tmp_path / "vmstate"
    asyncio.run(_save(path, DATA, KEY))

    async def main() -> None:
        qemu_end = -1

        async def load() -> None:
            nonlocal qemu_end
            async with state_reader(path, KEY, sandbox_id="sbx") as reader:
                qemu_end = os.dup(reader.qemu_fd)  # a QEMU that never reads: the pipe fills
                reader.handed_over()
                await asyncio.sleep(60)

        task = asyncio.create_task(load())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        os.close(qemu_end)

    asyncio.run(main())
