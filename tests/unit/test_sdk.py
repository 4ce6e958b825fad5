"""The async SDK core against the real API over a FakeNode (tests/unit/_live_api.py)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from space.sdk import AsyncCommandHandle, AsyncSandbox, CommandResult
from space.sdk.errors import CommandExitError, Conflict, InternalError, NotFound, Unavailable
from tests.unit._live_api import LiveApi
from tests.unit._sdk_calls import create as _create

pytestmark = pytest.mark.anyio


async def test_create_posts_the_documented_body_and_returns_the_new_sandbox(
    api: LiveApi,
) -> None:
    sandbox = await _create(api, cpus=2, memory_mib=512, env={"A": "1"}, metadata={"m": "x"})
    info = await sandbox.get_info()
    assert sandbox.sandbox_id in api.node.boxes
    assert (info.cpus, info.memory_mib, info.env, info.metadata) == (2, 512, {"A": "1"}, {"m": "x"})
    assert info.created_at is not None and info.created_at.tzinfo is not None
    await sandbox.close()


async def test_requests_carry_the_api_key_as_a_bearer_token(api: LiveApi) -> None:
    sandbox = await _create(api)
    await sandbox.close()
    assert all(h["authorization"] == f"Bearer {api.key}" for _, _, h in api.requests)


async def test_api_url_and_key_come_from_the_environment_when_not_given(
    api: LiveApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPACE_API_URL", "http://from-env:9999")
    monkeypatch.setenv("SPACE_API_KEY", api.key)
    seen: list[httpx.URL] = []
    inner = api.transport()

    async def record(request: httpx.Request) -> httpx.Response:
        seen.append(request.url)
        return await inner.handle_async_request(request)

    sandbox = await AsyncSandbox.create(_transport=httpx.MockTransport(record))
    await sandbox.close()
    assert seen[0].host == "from-env" and seen[0].port == 9999


async def test_connect_list_and_kill_manage_existing_sandboxes(api: LiveApi) -> None:
    first = await _create(api)
    again = await AsyncSandbox.connect(
        first.sandbox_id, api_key=api.key, _transport=api.transport()
    )
    listed = await AsyncSandbox.list(api_key=api.key, _transport=api.transport())
    assert [s.sandbox_id for s in listed] == [first.sandbox_id]
    assert await again.kill() is True
    assert api.node.boxes == {}
    # Already deleted: the API answers 204 again (docs/api.md), so kill is True again;
    # the SDK's False ("already gone") is for a 404, an id the API does not know.
    assert await first.kill() is True


async def test_negative_connect_to_an_unknown_sandbox_raises_not_found_with_context(
    api: LiveApi,
) -> None:
    with pytest.raises(NotFound) as caught:
        await AsyncSandbox.connect("nope", api_key=api.key, _transport=api.transport())
    assert caught.value.sandbox_id == "nope"
    assert caught.value.status_code == 404
    assert caught.value.operation == "sandbox.get_info"


async def test_async_with_kills_the_sandbox_on_exit(api: LiveApi) -> None:
    async with await _create(api) as sandbox:
        assert sandbox.sandbox_id in api.node.boxes
    assert api.node.boxes == {}


async def test_negative_using_a_killed_sandbox_raises_conflict_not_an_httpx_error(
    api: LiveApi,
) -> None:
    sandbox = await _create(api)
    await sandbox.kill()
    with pytest.raises(Conflict):
        await sandbox.files.read("/x")


async def test_run_feeds_callbacks_in_order_and_collects_the_output(api: LiveApi) -> None:
    api.scripts["build"] = [
        ("stdout", b"one\n"),
        ("stderr", b"warn\n"),
        ("stdout", b"two\n"),
        ("exit", 3, None, False),
    ]
    seen: list[tuple[str, str]] = []
    async with await _create(api) as sandbox:
        result = await sandbox.commands.run(
            "build",
            on_stdout=lambda t: seen.append(("out", t)),
            on_stderr=lambda t: seen.append(("err", t)),
        )
    assert seen == [("out", "one\n"), ("err", "warn\n"), ("out", "two\n")]
    assert result == CommandResult(stdout="one\ntwo\n", stderr="warn\n", exit_code=3)


async def test_run_decodes_a_multibyte_character_split_across_chunks(api: LiveApi) -> None:
    text = "naïve €100 🐍"
    raw = text.encode()
    # Split inside the 4-byte snake and inside the 3-byte euro sign.
    cuts = [raw[:9], raw[9:12], raw[12:-2], raw[-2:]]
    api.scripts["py"] = [*(("stdout", c) for c in cuts), ("exit", 0, None, False)]
    chunks: list[str] = []
    async with await _create(api) as sandbox:
        result = await sandbox.commands.run("py", on_stdout=chunks.append)
    assert "".join(chunks) == text
    assert "\ufffd" not in "".join(chunks)
    assert result.stdout == text


async def test_run_sends_argv_env_cwd_user_stdin_and_timeout_as_documented(
    api: LiveApi,
) -> None:
    api.scripts["cat -"] = [("exit", 0, None, False)]
    async with await _create(api) as sandbox:
        await sandbox.files.make_dir("/tmp")
        await sandbox.commands.run(
            ["cat", "-"], env={"K": "v"}, cwd="/tmp", user="root", stdin=b"data", timeout_s=5
        )
    assert api.exec_bodies == [
        {"argv": ["cat", "-"], "env": {"K": "v"}, "cwd": "/tmp", "user": "root",
         "stdin": "data", "timeout_s": 5}
    ]  # fmt: skip


async def test_run_reports_signal_and_timeout_as_the_server_does(api: LiveApi) -> None:
    api.scripts["sleep"] = [("exit", None, 9, True)]
    async with await _create(api) as sandbox:
        result = await sandbox.commands.run("sleep")
    assert (result.exit_code, result.signal, result.timed_out, result.ok) == (None, 9, True, False)


async def test_negative_run_with_check_raises_command_exit_error_carrying_the_result(
    api: LiveApi,
) -> None:
    api.scripts["false"] = [("stderr", b"bad\n"), ("exit", 1, None, False)]
    async with await _create(api) as sandbox:
        with pytest.raises(CommandExitError) as caught:
            await sandbox.commands.run("false", check=True)
    assert (caught.value.exit_code, caught.value.stderr) == (1, "bad\n")
    assert caught.value.sandbox_id is not None


async def test_negative_an_error_event_midway_raises_its_mapped_exception(api: LiveApi) -> None:
    api.scripts["crash"] = [("stdout", b"partial"), ("error", "unavailable", "VM died")]
    async with await _create(api) as sandbox:
        with pytest.raises(Unavailable, match="VM died"):
            await sandbox.commands.run("crash")


async def test_negative_a_stream_ending_without_exit_raises_unavailable(api: LiveApi) -> None:
    api.scripts["cut"] = [("stdout", b"partial")]
    async with await _create(api) as sandbox:
        with pytest.raises(Unavailable, match="ended before"):
            await sandbox.commands.run("cut")


async def test_negative_non_utf8_stdin_bytes_are_refused_before_sending(api: LiveApi) -> None:
    async with await _create(api) as sandbox:
        with pytest.raises(Exception, match="UTF-8"):
            await sandbox.commands.run("cat", stdin=b"\xff\xfe")
    assert api.exec_bodies == []


async def test_background_run_returns_a_handle_whose_wait_replays_the_output(
    api: LiveApi,
) -> None:
    api.scripts["server"] = [("stdout", b"ready\n"), ("exit", 0, None, False)]
    chunks: list[str] = []
    async with await _create(api) as sandbox:
        handle = await sandbox.commands.run("server", background=True)
        assert isinstance(handle, AsyncCommandHandle)
        assert api.exec_bodies[-1]["background"] is True
        result = await handle.wait(on_stdout=chunks.append)
    assert (handle.pid, result.stdout, result.exit_code, chunks) == (100, "ready\n", 0, ["ready\n"])


async def test_background_handle_kill_ends_the_process_with_the_signal(api: LiveApi) -> None:
    api.scripts["loop"] = [("stdout", b"tick\n"), ("exit", 0, None, False)]
    async with await _create(api) as sandbox:
        handle = await sandbox.commands.run("loop", background=True)
        assert await handle.kill(15) is True
        result = await handle.wait()
        listed = await sandbox.commands.list()
        again = await sandbox.commands.connect(handle.process_id)
    assert (result.signal, result.exit_code) == (15, None)
    assert [p.process_id for p in listed] == [handle.process_id]
    assert again.pid == handle.pid


async def test_negative_killing_or_connecting_to_an_unknown_process(api: LiveApi) -> None:
    async with await _create(api) as sandbox:
        assert await sandbox.commands.kill("p-missing") is False
        with pytest.raises(NotFound):
            await sandbox.commands.connect("p-missing")


async def test_files_write_then_read_as_text_bytes_and_stream(api: LiveApi) -> None:
    async with await _create(api) as sandbox:
        info = await sandbox.files.write("/home/user/a.txt", "héllo")
        text = await sandbox.files.read("/home/user/a.txt")
        raw = await sandbox.files.read("/home/user/a.txt", format="bytes")
        stream = await sandbox.files.read("/home/user/a.txt", format="stream")
        streamed = b"".join([chunk async for chunk in stream])
    assert (info.size, info.name) == (6, "a.txt")
    assert (text, raw, streamed) == ("héllo", "héllo".encode(), "héllo".encode())


async def test_files_write_streams_a_generated_iterable_in_chunks_intact(api: LiveApi) -> None:
    blocks = [os.urandom(64 * 1024) for _ in range(20)]

    def generate() -> Iterator[bytes]:
        yield from blocks

    async with await _create(api) as sandbox:
        info = await sandbox.files.write("/data.bin", generate())
        stored = api.node.boxes[sandbox.sandbox_id].files["/data.bin"]
    assert stored == b"".join(blocks) and info.size == len(stored)
    assert len(api.upload_chunks) > 1  # streamed, not sent as one buffered body


async def test_files_write_accepts_an_async_iterable_and_a_file_object(
    api: LiveApi, tmp_path: Path
) -> None:
    async def generate() -> AsyncIterator[bytes]:
        for part in (b"a" * 10, b"b" * 10):
            yield part

    local = tmp_path / "up.bin"
    local.write_bytes(b"x" * (3 * 1024 * 1024 + 5))
    async with await _create(api) as sandbox:
        await sandbox.files.write("/async.bin", generate())
        with local.open("rb") as handle:
            await sandbox.files.write("/file.bin", handle)
        stored = api.node.boxes[sandbox.sandbox_id].files
    assert stored["/async.bin"] == b"a" * 10 + b"b" * 10
    assert stored["/file.bin"] == local.read_bytes()
    assert max(api.upload_chunks) <= 1 << 20  # read from disk one chunk at a time


async def test_negative_write_refuses_an_iterable_yielding_text(api: LiveApi) -> None:
    async with await _create(api) as sandbox:
        with pytest.raises(Exception, match="expected bytes"):
            await sandbox.files.write("/bad", iter(["text"]))  # type: ignore[arg-type]
        assert not await sandbox.files.exists("/bad")


async def test_files_stat_list_exists_rename_remove_make_dir(api: LiveApi) -> None:
    async with await _create(api) as sandbox:
        await sandbox.files.write("/d/one", b"1")
        await sandbox.files.write("/d/two", b"22")
        listed = sorted(f.name for f in await sandbox.files.list("/d"))
        moved = await sandbox.files.rename("/d/two", "/d/three")
        await sandbox.files.remove("/d/one")
        exists = (await sandbox.files.exists("/d/one"), await sandbox.files.exists("/d/three"))
        made = await sandbox.files.make_dir("/newdir")
        stat = await sandbox.files.stat("/d/three")
    assert listed == ["one", "two"]
    assert (moved.path, moved.size, exists, made.is_dir, stat.size) == (
        "/d/three", 2, (False, True), True, 2
    )  # fmt: skip


async def test_download_to_and_upload_from_copy_local_files(api: LiveApi, tmp_path: Path) -> None:
    source = tmp_path / "src.bin"
    source.write_bytes(os.urandom(200_000))
    target = tmp_path / "dst.bin"
    async with await _create(api) as sandbox:
        await sandbox.files.upload_from(source, "/remote.bin")
        count = await sandbox.files.download_to("/remote.bin", target)
    assert count == 200_000 and target.read_bytes() == source.read_bytes()


async def test_negative_download_of_a_missing_file_leaves_no_local_file(
    api: LiveApi, tmp_path: Path
) -> None:
    target = tmp_path / "never.bin"
    async with await _create(api) as sandbox:
        with pytest.raises(NotFound):
            await sandbox.files.download_to("/missing", target)
        with pytest.raises(NotFound, match="local file"):
            await sandbox.files.upload_from(tmp_path / "absent", "/x")
    assert not target.exists()


async def test_negative_reading_non_utf8_as_text_raises_and_suggests_bytes(api: LiveApi) -> None:
    async with await _create(api) as sandbox:
        await sandbox.files.write("/bin", b"\xff\x00")
        with pytest.raises(Exception, match="format='bytes'"):
            await sandbox.files.read("/bin")


async def test_negative_a_malformed_answer_raises_internal_error() -> None:
    # The real API cannot answer this: a tiny handler plays a broken server.
    async def broken(request: httpx.Request) -> httpx.Response:
        return httpx.Response(201, json={"id": "x"})  # a Sandbox without its fields

    with pytest.raises(InternalError, match="malformed sandbox"):
        await AsyncSandbox.create(api_key="sk-test", _transport=httpx.MockTransport(broken))
