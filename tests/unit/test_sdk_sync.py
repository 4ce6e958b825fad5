"""The sync facade: plain sync code drives the async core on the SDK's loop thread."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator

import pytest

from space.sdk import (
    AsyncCommandHandle,
    AsyncCommands,
    AsyncFiles,
    AsyncNetwork,
    AsyncSandbox,
    CommandHandle,
    Commands,
    Files,
    Network,
    Sandbox,
)
from space.sdk.errors import CommandExitError, InvalidArgument, NotFound
from tests.unit._live_api import LiveApi


def _create(sync_api: LiveApi) -> Sandbox:
    return Sandbox.create(api_key=sync_api.key, _transport=sync_api.transport())


def test_sync_sandbox_creates_runs_and_kills_from_plain_sync_code(sync_api: LiveApi) -> None:
    sync_api.scripts["echo hi"] = [("stdout", b"hi\n"), ("exit", 0, None, False)]
    threads: list[str] = []
    with _create(sync_api) as sandbox:
        result = sandbox.commands.run(
            "echo hi", on_stdout=lambda _t: threads.append(threading.current_thread().name)
        )
        info = sandbox.get_info()
    assert result.stdout == "hi\n" and info.sandbox_id == sandbox.sandbox_id
    assert sync_api.node.boxes == {}  # the with block killed it
    assert threads == ["space-sdk-loop"]  # callbacks run on the SDK's loop thread


def test_sync_list_connect_and_check(sync_api: LiveApi) -> None:
    sync_api.scripts["false"] = [("exit", 1, None, False)]
    sandbox = _create(sync_api)
    again = Sandbox.connect(
        sandbox.sandbox_id, api_key=sync_api.key, _transport=sync_api.transport()
    )
    listed = Sandbox.list(api_key=sync_api.key, _transport=sync_api.transport())
    with pytest.raises(CommandExitError):
        again.commands.run("false", check=True)
    assert [s.sandbox_id for s in listed] == [sandbox.sandbox_id]
    assert again.kill() is True and sandbox.kill() is True  # deleted: 204 again


def test_sync_background_handle_waits_and_kills(sync_api: LiveApi) -> None:
    sync_api.scripts["job"] = [("stdout", b"a"), ("stdout", b"b"), ("exit", 0, None, False)]
    with _create(sync_api) as sandbox:
        handle = sandbox.commands.run("job", background=True)
        assert isinstance(handle, CommandHandle)
        seen: list[str] = []
        result = handle.wait(on_stdout=seen.append)
        assert handle.kill() is True
        connected = sandbox.commands.connect(handle.process_id)
    assert (result.stdout, seen, connected.pid) == ("ab", ["a", "b"], handle.pid)


def test_sync_files_round_trip_including_a_streamed_read(sync_api: LiveApi) -> None:
    def generate() -> Iterator[bytes]:
        for i in range(5):
            yield bytes([i]) * 1000

    with _create(sync_api) as sandbox:
        sandbox.files.write("/f", generate())
        chunks = list(sandbox.files.read("/f", format="stream"))
        text_missing = sandbox.files.exists("/nope")
        with pytest.raises(NotFound):
            sandbox.files.read("/nope")
    assert b"".join(chunks) == b"".join(bytes([i]) * 1000 for i in range(5))
    assert text_missing is False


def test_negative_calling_the_sync_sdk_from_its_own_callback_raises_instead_of_deadlocking(
    sync_api: LiveApi,
) -> None:
    sync_api.scripts["x"] = [("stdout", b"x"), ("exit", 0, None, False)]
    with _create(sync_api) as sandbox, pytest.raises(InvalidArgument, match="callback"):
        sandbox.commands.run("x", on_stdout=lambda _t: sandbox.files.exists("/"))


def test_sync_methods_keep_the_async_signature_and_docstring() -> None:
    assert Sandbox.kill.__doc__ and "Idempotent" in Sandbox.kill.__doc__
    assert Sandbox.create.__doc__ and "Create a sandbox" in Sandbox.create.__doc__


PAIRS = [
    (AsyncSandbox, Sandbox),
    (AsyncCommands, Commands),
    (AsyncFiles, Files),
    (AsyncCommandHandle, CommandHandle),
    (AsyncNetwork, Network),
]


def _public_methods(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, callable) if not name.startswith("_")}


@pytest.mark.parametrize(("async_cls", "sync_cls"), PAIRS)
def test_every_public_async_method_has_a_sync_twin(async_cls: type, sync_cls: type) -> None:
    assert _public_methods(async_cls) <= _public_methods(sync_cls)


@pytest.mark.parametrize(("async_cls", "sync_cls"), PAIRS)
def test_wrapped_sync_twins_keep_the_async_parameters(async_cls: type, sync_cls: type) -> None:
    for name in _public_methods(async_cls):
        twin = getattr(sync_cls, name)
        if getattr(twin, "__wrapped__", None) is None:
            continue  # hand-written twins (run, read, connect) return facade objects
        assert inspect.signature(twin) == inspect.signature(getattr(async_cls, name)), name
        assert twin.__doc__ == getattr(async_cls, name).__doc__, name


def test_the_lifecycle_methods_are_wrapped_not_hand_written() -> None:
    for name in (
        "hibernate", "resume", "set_timeouts", "snapshot", "snapshots", "restore", "fork",
        "list_snapshots", "delete_snapshot",
    ):  # fmt: skip
        assert getattr(Sandbox, name).__wrapped__ == getattr(AsyncSandbox, name), name
