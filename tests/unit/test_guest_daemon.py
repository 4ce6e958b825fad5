"""spaced as a real subprocess (--stdio) driven through GuestChannel."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from space.node.api import (
    Conflict,
    ExecExited,
    ExecOutput,
    ExecRequest,
    ExecStream,
    InvalidArgument,
    NotFound,
    ProcessSelector,
    PtySize,
    Timeout,
)
from space.node.channel import GuestChannel

from ._guest_harness import Guest, run_with_channel, running_guest


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


async def collect(stream: ExecStream) -> tuple[bytes, bytes, ExecExited]:
    out, err = bytearray(), bytearray()
    exited = None
    async for event in stream:
        if isinstance(event, ExecOutput):
            (out if event.stream == "stdout" else err).extend(event.data)
        else:
            exited = event
    assert exited is not None
    return bytes(out), bytes(err), exited


def test_exec_streams_stdout_and_stderr_and_reports_the_exit_code(tmp_path: Path) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        stream = await channel.exec(
            ExecRequest(argv=["sh", "-c", "echo out; echo err >&2; exit 3"])
        )
        assert stream.pid > 0 and stream.process_id.startswith("p")
        out, err, exited = await collect(stream)
        assert (out, err) == (b"out\n", b"err\n")
        assert exited == ExecExited(exit_code=3, signal=None, timed_out=False)

    run_with_channel(tmp_path, body)


def test_exec_runs_cmd_in_the_home_with_the_default_environment(tmp_path: Path) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        request = ExecRequest(cmd='pwd; echo "$HOME $LANG $EXTRA"', env={"EXTRA": "x y"})
        out, _, exited = await collect(await channel.exec(request))
        assert out.decode().splitlines() == [str(tmp_path), f"{tmp_path} C.UTF-8 x y"]
        assert exited.exit_code == 0

    run_with_channel(tmp_path, body)


def test_exec_reports_the_signal_that_killed_the_process(tmp_path: Path) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        _, _, exited = await collect(await channel.exec(ExecRequest(cmd="kill -TERM $$")))
        assert exited == ExecExited(exit_code=None, signal=signal.SIGTERM, timed_out=False)

    run_with_channel(tmp_path, body)


def test_exec_feeds_stdin_to_the_process(tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024)  # beyond one credit window

    async def body(channel: GuestChannel, guest: Guest) -> None:
        stream = await channel.exec(ExecRequest(argv=["sha256sum"], stdin=data))
        out, _, exited = await collect(stream)
        assert out.split()[0].decode() == hashlib.sha256(data).hexdigest()
        assert exited.exit_code == 0

    run_with_channel(tmp_path, body)


def test_exec_timeout_kills_the_process_group_and_reports_timed_out(tmp_path: Path) -> None:
    marker = tmp_path / "grandchild-alive"

    async def body(channel: GuestChannel, guest: Guest) -> None:
        cmd = f"(sleep 2; touch '{marker}') & sleep 30"
        started = time.monotonic()
        _, _, exited = await collect(await channel.exec(ExecRequest(cmd=cmd, timeout_s=0.5)))
        assert exited.timed_out and exited.signal == signal.SIGKILL
        assert time.monotonic() - started < 5
        await asyncio.sleep(2.5)
        assert not marker.exists()  # the whole group died, not just the shell

    run_with_channel(tmp_path, body)


def test_exec_output_beyond_the_window_arrives_whole_on_both_channels(tmp_path: Path) -> None:
    expected_out = "".join(f"{i}\n" for i in range(1, 400_001)).encode()  # 2.7 MB
    expected_err = "".join(f"{i}\n" for i in range(1, 100_001)).encode()

    async def body(channel: GuestChannel, guest: Guest) -> None:
        request = ExecRequest(cmd="seq 1 400000 & seq 1 100000 >&2; wait")
        out, err, exited = await collect(await channel.exec(request))
        assert (out, err, exited.exit_code) == (expected_out, expected_err, 0)

    run_with_channel(tmp_path, body)


def test_exec_ends_after_the_process_when_a_grandchild_holds_its_pipes(tmp_path: Path) -> None:
    """Output goes on while it moves after the exit; silence ends the exec, not EOF."""
    pid_file = tmp_path / "holder.pid"

    async def body(channel: GuestChannel, guest: Guest) -> None:
        cmd = "(for i in 1 2 3; do sleep 0.2; echo late$i; done) & echo early; exit 4"
        out, _, exited = await collect(await channel.exec(ExecRequest(cmd=cmd)))
        assert (out, exited.exit_code) == (b"early\nlate1\nlate2\nlate3\n", 4)

        cmd = f"sleep 60 & echo $! > '{pid_file}'; echo before; exit 3"
        started = time.monotonic()
        out, _, exited = await collect(await channel.exec(ExecRequest(cmd=cmd)))
        assert (out, exited.exit_code) == (b"before\n", 3)
        assert time.monotonic() - started < 5  # not the 60 s the holder lives
        os.kill(int(pid_file.read_text()), 0)  # it still runs, and holds the pipes

    try:
        run_with_channel(tmp_path, body)
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_negative_exec_with_a_missing_cwd_or_program_raises_not_found(tmp_path: Path) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        with pytest.raises(NotFound) as missing_cwd:
            await channel.exec(ExecRequest(argv=["true"], cwd="no/such/dir"))
        assert missing_cwd.value.sandbox_id == "sb-test"
        with pytest.raises(NotFound):
            await channel.exec(ExecRequest(argv=["/no/such/program"]))
        with pytest.raises(InvalidArgument):
            await channel.exec(ExecRequest(argv=["true"], user="no-such-user-here"))
        # The channel is still healthy after refusals.
        assert (await collect(await channel.exec(ExecRequest(argv=["true"]))))[2].exit_code == 0

    run_with_channel(tmp_path, body)


def test_ten_concurrent_execs_each_get_their_own_output(tmp_path: Path) -> None:
    async def one(channel: GuestChannel, n: int) -> bytes:
        request = ExecRequest(cmd=f"for i in 1 2 3; do echo {n}-$i; sleep 0.05; done")
        out, _, exited = await collect(await channel.exec(request))
        assert exited.exit_code == 0
        return out

    async def body(channel: GuestChannel, guest: Guest) -> None:
        outputs = await asyncio.gather(*(one(channel, n) for n in range(10)))
        assert outputs == [f"{n}-1\n{n}-2\n{n}-3\n".encode() for n in range(10)]

    run_with_channel(tmp_path, body)


def test_aclose_of_a_foreground_exec_kills_it_and_the_channel_goes_on(tmp_path: Path) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        stream = await channel.exec(ExecRequest(argv=["sleep", "30"]))
        await stream.aclose()
        await asyncio.sleep(0.3)
        with pytest.raises(ProcessLookupError):
            os.kill(stream.pid, 0)
        assert await channel.ping() < 1.0

    run_with_channel(tmp_path, body)


def test_kill_process_reaches_a_foreground_exec(tmp_path: Path) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        stream = await channel.exec(ExecRequest(argv=["sleep", "30"]))
        await channel.kill_process(stream.process_id, signal.SIGTERM)
        _, _, exited = await collect(stream)
        assert exited.signal == signal.SIGTERM

    run_with_channel(tmp_path, body)


def test_background_process_is_listed_attached_and_killed(tmp_path: Path) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        request = ExecRequest(cmd="echo first; sleep 0.2; echo second; sleep 30", background=True)
        started = await channel.exec(request)
        assert [event async for event in started] == []
        listed = {p.process_id: p for p in await channel.list_processes()}
        info = listed[started.process_id]
        assert info.running and info.pid == started.pid and info.cmd == request.cmd
        await asyncio.sleep(0.5)
        attached = await channel.attach(started.process_id)
        await channel.kill_process(started.process_id)
        out, _, exited = await collect(attached)
        assert out == b"first\nsecond\n"  # replayed from the ring buffer
        assert exited.signal == signal.SIGKILL
        (after,) = [p for p in await channel.list_processes() if p.process_id == info.process_id]
        assert not after.running and after.signal == signal.SIGKILL
        with pytest.raises(NotFound):
            await channel.kill_process("p0000")

    run_with_channel(tmp_path, body)


def test_attach_by_pid_or_tag_finds_the_oldest_running_process_in_one_request(
    tmp_path: Path,
) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        ended = await channel.exec(ExecRequest(cmd="echo gone", background=True, tag="job"))
        first = await channel.exec(
            ExecRequest(cmd="echo one; sleep 30", background=True, tag="job")
        )
        second = await channel.exec(
            ExecRequest(cmd="echo two; sleep 30", background=True, tag="job", pty=PtySize(5, 40))
        )
        await asyncio.sleep(0.3)
        by_tag = await channel.attach(ProcessSelector(tag="job"))  # ended: skipped
        assert (by_tag.process_id, by_tag.pid, by_tag.pty) == (first.process_id, first.pid, False)
        by_pid = await channel.attach(ProcessSelector(pid=second.pid))
        assert (by_pid.process_id, by_pid.pty) == (second.process_id, True)
        for stream in (first, second):
            await channel.kill_process(stream.process_id)
        assert (await collect(by_tag))[0] == b"one\n"
        assert (await collect(by_pid))[0] == b"two\r\n"  # a terminal's newline
        for gone in (ProcessSelector(pid=ended.pid), ProcessSelector(tag="job")):
            with pytest.raises(NotFound):  # ended (or killed) processes are not found
                await channel.attach(gone)
        with pytest.raises(InvalidArgument):
            await channel.attach(ProcessSelector())
        assert await channel.ping() < 1.0

    run_with_channel(tmp_path, body)


def test_new_hello_starts_a_new_session_and_background_processes_survive(tmp_path: Path) -> None:
    async def body(first: GuestChannel, guest: Guest) -> None:
        background = await first.exec(ExecRequest(cmd="echo kept; sleep 30", background=True))
        foreground = await first.exec(ExecRequest(argv=["sleep", "30"]))
        await first.close()
        second = await guest.channel("sb-second")
        try:
            assert second.hello["session"] != first.hello["session"]
            await asyncio.sleep(0.3)
            with pytest.raises(ProcessLookupError):  # the old session's exec was killed
                os.kill(foreground.pid, 0)
            (info,) = await second.list_processes()
            assert info.process_id == background.process_id and info.running
            attached = await second.attach(background.process_id)
            await second.kill_process(background.process_id)
            out, _, _ = await collect(attached)
            assert out == b"kept\n"
        finally:
            await second.close()

    run_with_channel(tmp_path, body)


async def chunks(data: bytes, size: int = 100_000) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def pseudo_random(total: int, digest: hashlib._Hash) -> AsyncIterator[bytes]:
    block = os.urandom(1024 * 1024)
    for n in range(total // len(block)):
        chunk = bytes([n % 256]) + block[1:]
        digest.update(chunk)
        yield chunk


def test_write_and_read_of_100_mib_match_and_guest_memory_stays_bounded(tmp_path: Path) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        sent = hashlib.sha256()
        stat = await channel.write_file("big/file.bin", pseudo_random(100 << 20, sent))
        assert stat.size == 100 << 20 and stat.type == "file" and stat.mode == 0o644
        reader = await channel.read_file("big/file.bin")
        assert reader.stat.size == 100 << 20
        received = hashlib.sha256()
        async for chunk in reader:
            received.update(chunk)
        assert received.hexdigest() == sent.hexdigest()
        assert guest.vm_hwm_kib() < 80 * 1024

    run_with_channel(tmp_path, body)


def test_names_with_spaces_and_unicode_round_trip(tmp_path: Path) -> None:
    name = "dir with space/fïlé ☃ name.txt"

    async def body(channel: GuestChannel, guest: Guest) -> None:
        stat = await channel.write_file(name, chunks(b"hello"), mode=0o600)
        assert stat.name == "fïlé ☃ name.txt" and stat.mode == 0o600
        assert (tmp_path / name).read_bytes() == b"hello"
        reader = await channel.read_file(str(tmp_path / name))
        assert b"".join([chunk async for chunk in reader]) == b"hello"
        (entry,) = await channel.list_dir("dir with space")
        assert entry.name == "fïlé ☃ name.txt" and entry.size == 5

    run_with_channel(tmp_path, body)


def test_list_stat_mkdir_remove_and_rename(tmp_path: Path) -> None:
    (tmp_path / "target").write_text("t")
    (tmp_path / "link").symlink_to(tmp_path / "target")

    async def body(channel: GuestChannel, guest: Guest) -> None:
        made = await channel.make_dir("a/b/c")
        assert made.type == "dir" and (tmp_path / "a/b/c").is_dir()
        assert (await channel.make_dir("a/b/c")).type == "dir"  # idempotent
        assert (await channel.stat("link")).type == "symlink"  # never followed
        listed = [(e.name, e.type) for e in await channel.list_dir(".")]
        assert listed == [("a", "dir"), ("link", "symlink"), ("target", "file")]
        moved = await channel.rename("target", "a/moved")
        assert moved.path == str(tmp_path / "a/moved") and not (tmp_path / "target").exists()
        with pytest.raises(Conflict):
            await channel.remove("a")  # not empty
        await channel.remove("a", recursive=True)
        await channel.remove("link")
        assert names(tmp_path) == []

    run_with_channel(tmp_path, body)


def test_negative_file_errors_map_to_node_errors(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()

    async def body(channel: GuestChannel, guest: Guest) -> None:
        with pytest.raises(NotFound):
            await channel.stat("missing")
        with pytest.raises(NotFound):
            await channel.read_file("missing")
        with pytest.raises(InvalidArgument, match="is_a_directory"):
            await channel.read_file("dir")
        with pytest.raises(InvalidArgument, match="is_a_directory"):
            await channel.write_file("dir", chunks(b"x"))
        with pytest.raises(Conflict, match="already_exists"):
            await channel.make_dir("file")
        with pytest.raises(InvalidArgument, match="not_a_directory"):
            await channel.list_dir("file")
        with pytest.raises(InvalidArgument):
            await channel.write_file("f2", chunks(b"x"), mode=0o777777)
        assert (tmp_path / "file").read_text() == "x"
        assert names(tmp_path) == ["dir", "file"]

    run_with_channel(tmp_path, body)


def test_negative_an_abandoned_write_leaves_the_old_content_and_no_temp_file(
    tmp_path: Path,
) -> None:
    (tmp_path / "keep").write_bytes(b"old")

    async def failing() -> AsyncIterator[bytes]:
        yield b"x" * 300_000
        raise RuntimeError("source failed")

    async def body(channel: GuestChannel, guest: Guest) -> None:
        with pytest.raises(RuntimeError):
            await channel.write_file("keep", failing())
        await asyncio.sleep(0.3)
        assert (tmp_path / "keep").read_bytes() == b"old"
        assert names(tmp_path) == ["keep"]

    run_with_channel(tmp_path, body)


def test_list_dir_of_a_large_directory_arrives_in_batches(tmp_path: Path) -> None:
    for n in range(1500):
        (tmp_path / f"entry-{n:05d}-{'x' * 40}").touch()

    async def body(channel: GuestChannel, guest: Guest) -> None:
        entries = await channel.list_dir(".")
        assert [e.name for e in entries] == names(tmp_path)

    run_with_channel(tmp_path, body)


def test_system_info_and_ping(tmp_path: Path) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        info = await channel.system_info()
        assert str(info["agent"]).startswith("spaced/") and float(str(info["uptime_s"])) > 0
        assert 0 < await channel.ping() < 1.0

    run_with_channel(tmp_path, body)


def test_negative_a_request_past_its_deadline_raises_timeout(tmp_path: Path) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        guest.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(Timeout):
                await channel.ping(timeout_s=0.2)
        finally:
            guest.proc.send_signal(signal.SIGCONT)
        assert await channel.ping() < 1.0

    run_with_channel(tmp_path, body)


def test_spaced_answers_the_channels_pings_so_a_quiet_exec_outlives_the_silence_timeout(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with running_guest(tmp_path) as guest:
            channel = await guest.channel(silence_timeout_s=0.5, ping_interval_s=0.1)
            try:
                began = time.monotonic()
                stream = await channel.exec(ExecRequest(argv=["sleep", "1.5"]))
                out, _, exited = await collect(stream)
                assert (out, exited.exit_code) == (b"", 0)
                assert time.monotonic() - began >= 1.5
            finally:
                await channel.close()

    asyncio.run(main())


def test_negative_a_stopped_spaced_fails_a_waiting_request_after_the_silence_timeout(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with running_guest(tmp_path) as guest:
            channel = await guest.channel(silence_timeout_s=0.5, ping_interval_s=0.1)
            try:
                guest.proc.send_signal(signal.SIGSTOP)
                try:
                    with pytest.raises(Timeout, match=r"file\.stat: the guest sent nothing"):
                        await channel.stat(".")
                finally:
                    guest.proc.send_signal(signal.SIGCONT)
                assert (await channel.stat(".")).type == "dir"  # the channel lives on
            finally:
                await channel.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    "request_fields",
    [
        {"op": "exec", "argv": "not a list"},
        {"op": "exec", "argv": ["true"], "cmd": "true"},
        {"op": "exec", "argv": ["true"], "env": {"A": 1}},
        {"op": "exec", "argv": ["true"], "timeout_s": -1},
        {"op": "exec", "argv": ["true"], "stdin": "yes"},
        {"op": "file.stat", "path": 7},
        {"op": "file.stat", "path": "a\u0000b"},
        {"op": "file.remove", "path": "/"},
        {"op": "process.kill", "process_id": "p1", "signal": 99},
        {"op": "exec", "cmd": "true", "follow": True},  # follow without background
        {"op": "process.attach", "pid": 1, "tag": "t"},  # two selectors
        {"op": "process.attach"},  # none
        {"op": "process.attach", "pid": 0},
        {"op": "process.attach", "pid": 4 * 1024 * 1024 + 1},
        {"op": "process.attach", "tag": "no spaces"},
        {"op": "no.such.op"},
    ],
    ids=lambda fields: str(sorted(fields.items()))[:60],
)
def test_negative_malformed_requests_get_invalid_argument(
    tmp_path: Path, request_fields: dict[str, object]
) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        with pytest.raises(InvalidArgument):
            await channel._request(request_fields, lambda message: message)
        assert await channel.ping() < 1.0  # the guest and the channel carry on

    run_with_channel(tmp_path, body)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")
def test_exec_and_files_as_another_user_drop_privileges(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)

    async def body(channel: GuestChannel, guest: Guest) -> None:
        request = ExecRequest(argv=["id", "-un"], user="nobody", cwd="/")
        out, _, exited = await collect(await channel.exec(request))
        assert (out, exited.exit_code) == (b"nobody\n", 0)
        stat = await channel.write_file(str(shared / "f"), chunks(b"x"), user="nobody")
        assert stat.owner == "nobody"

    run_with_channel(tmp_path, body)
