"""file.watch (issue 20) on spaced as a real subprocess (--stdio), through GuestChannel:
inotify events, recursion, bounds, coalescing and drops, release on close."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from space.guest import _watch
from space.node.api import InvalidArgument, NotFound, ResourceExhausted, WatchEvent, WatchStream
from space.node.channel import GuestChannel

from ._guest_harness import Guest, run_with_channel


async def collect(stream: WatchStream, wanted: int, timeout_s: float = 10) -> list[WatchEvent]:
    events: list[WatchEvent] = []
    iterator = aiter(stream)
    async with asyncio.timeout(timeout_s):
        while len(events) < wanted:
            events.append(await anext(iterator))
    return events


def kinds(events: list[WatchEvent]) -> set[tuple[str, str]]:
    return {(event.type, event.name) for event in events}


def test_a_watch_reports_create_write_chmod_rename_and_remove(tmp_path: Path) -> None:
    watched = tmp_path / "w"
    watched.mkdir()

    async def body(channel: GuestChannel, guest: Guest) -> None:
        stream = await channel.watch_dir(str(watched))
        assert stream.path == str(watched)
        (watched / "a.txt").write_text("x")
        os.chmod(watched / "a.txt", 0o600)
        os.rename(watched / "a.txt", watched / "b.txt")
        (watched / "b.txt").unlink()
        (watched / "sub").mkdir()
        seen: list[WatchEvent] = []
        wanted = {
            ("create", "a.txt"), ("write", "a.txt"), ("chmod", "a.txt"), ("rename", "a.txt"),
            ("create", "b.txt"), ("remove", "b.txt"), ("create", "sub"),
        }  # fmt: skip
        while not wanted <= kinds(seen):
            seen += await collect(stream, 1)
        assert next(e for e in seen if e.name == "sub").is_dir
        assert all(e.path == str(watched / e.name) for e in seen)
        await stream.aclose()

    run_with_channel(tmp_path, body)


def test_a_recursive_watch_follows_new_subdirectories_and_ends_when_the_dir_goes(
    tmp_path: Path,
) -> None:
    watched = tmp_path / "r"
    (watched / "old").mkdir(parents=True)

    async def body(channel: GuestChannel, guest: Guest) -> None:
        flat = await channel.watch_dir(str(watched))
        deep = await channel.watch_dir(str(watched), recursive=True)
        (watched / "old" / "f").write_text("1")
        (watched / "new" / "inner").mkdir(parents=True)
        await asyncio.sleep(0.2)  # the new directory's watch is in place
        (watched / "new" / "inner" / "g").write_text("2")
        seen: list[WatchEvent] = []
        while ("write", "new/inner/g") not in kinds(seen):
            seen += await collect(deep, 1)
        assert ("create", "old/f") in kinds(seen)
        flat_seen = await collect(flat, 1)
        assert kinds(flat_seen) == {("create", "new")}  # a flat watch sees its own level
        await flat.aclose()
        for path in sorted(watched.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        watched.rmdir()
        async with asyncio.timeout(10):
            rest = [event async for event in deep]  # ends: the directory is gone
        assert ("remove", "old") in kinds(rest) or ("remove", "old") in kinds(seen)

    run_with_channel(tmp_path, body)


def test_negative_watches_of_missing_paths_files_or_past_the_bounds_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "file").write_text("x")
    for index in range(3):
        (tmp_path / "tree" / str(index)).mkdir(parents=True)

    async def body(channel: GuestChannel, guest: Guest) -> None:
        with pytest.raises(NotFound):
            await channel.watch_dir(str(tmp_path / "missing"))
        with pytest.raises(InvalidArgument):
            await channel.watch_dir(str(tmp_path / "file"))
        # Every watch is released on close: 64 more can be opened, one after another.
        for _ in range(_watch.MAX_WATCH_STREAMS + 1):
            await (await channel.watch_dir(str(tmp_path))).aclose()
        streams = [await channel.watch_dir(str(tmp_path)) for _ in range(_watch.MAX_WATCH_STREAMS)]
        with pytest.raises(ResourceExhausted, match="watches open"):
            await channel.watch_dir(str(tmp_path))
        for stream in streams:
            await stream.aclose()
        await (await channel.watch_dir(str(tmp_path))).aclose()

    run_with_channel(tmp_path, body)


def test_a_slow_reader_gets_a_dropped_count_for_what_did_not_fit(tmp_path: Path) -> None:
    watched = tmp_path / "busy"
    watched.mkdir()
    total = _watch.MAX_PENDING_EVENTS * 3  # past our credit window and the guest's queue

    async def body(channel: GuestChannel, guest: Guest) -> None:
        stream = await channel.watch_dir(str(watched))
        for index in range(total):
            (watched / f"f{index}").touch()
        await asyncio.sleep(1)  # read late: the guest had to queue, then drop
        creates = dropped = 0
        async with asyncio.timeout(30):
            async for event in stream:
                creates += event.type == "create"
                dropped += event.count if event.type == "dropped" else 0
                if creates + dropped >= total:
                    break
        assert dropped > 0 and creates + dropped == total
        await stream.aclose()

    run_with_channel(tmp_path, body)


def test_a_waiting_event_absorbs_its_repeats_and_a_full_queue_counts_drops() -> None:
    watcher = _watch._Watcher("/w", False, _watch.Watches())
    for _ in range(3):
        watcher._queue("write", "/w/same", False)
    assert len(watcher.pending) == 1
    for index in range(_watch.MAX_PENDING_EVENTS + 5):
        watcher._queue("create", f"/w/f{index}", False)
    assert (len(watcher.pending), watcher.dropped) == (_watch.MAX_PENDING_EVENTS, 6)
    first = watcher.take().split(b"\n")[0]
    assert first == b'{"type": "dropped", "count": 6}' and watcher.dropped == 0


def test_a_name_that_is_no_utf8_is_reported_without_breaking_the_channel(
    tmp_path: Path,
) -> None:
    watched = tmp_path / "bytes"
    watched.mkdir()

    async def body(channel: GuestChannel, guest: Guest) -> None:
        stream = await channel.watch_dir(str(watched))
        os.close(os.open(os.path.join(os.fsencode(watched), b"caf\xe9"), os.O_CREAT | os.O_WRONLY))
        (event,) = await collect(stream, 1)
        assert (event.type, os.fsencode(event.name)) == ("create", b"caf\xe9")
        await stream.aclose()
        assert not channel.closed

    run_with_channel(tmp_path, body)
