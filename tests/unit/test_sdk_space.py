"""``AsyncSpace`` / ``Space``: one client whose calls and sandboxes share one connection
(issue 13), against the control plane over a FakeNode."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from space.sdk import AsyncSandbox, AsyncSpace, Sandbox, SecretInfo, Space
from space.sdk._http import ApiClient, one_call
from space.sdk.errors import Conflict, InvalidArgument, NotFound
from tests.unit._live_api import LiveApi
from tests.unit._sdk_calls import connection
from tests.unit.fakes import control_app
from tests.unit.test_sdk_templates import project

pytestmark = pytest.mark.anyio


def _space(api: LiveApi) -> AsyncSpace:
    return AsyncSpace("http://space", api.key, transport=api.transport())


@pytest.fixture
def clients(monkeypatch: pytest.MonkeyPatch) -> list[ApiClient]:
    """Every ApiClient (one connection pool each) the SDK makes during the test."""
    made: list[ApiClient] = []
    original = ApiClient.__init__

    def counting(self: ApiClient, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    monkeypatch.setattr(ApiClient, "__init__", counting)
    return made


async def test_every_call_and_sandbox_of_a_space_share_its_one_connection(
    api: LiveApi, clients: list[ApiClient]
) -> None:
    async with _space(api) as space:
        sandbox = await space.sandboxes.create(cpus=2)
        again = await space.sandboxes.connect(sandbox.sandbox_id)
        (child,) = await sandbox.fork(1)
        listed = await space.sandboxes.list()
        await space.sandboxes.list_pools()
        await space.sandboxes.list_snapshots(sandbox_id=sandbox.sandbox_id)
    assert len(clients) == 1 and clients[0]._client.is_closed
    assert isinstance(again, AsyncSandbox) and again.sandbox_id == sandbox.sandbox_id
    assert {s.sandbox_id for s in listed} == {sandbox.sandbox_id, child.sandbox_id}
    assert all(h["authorization"] == f"Bearer {api.key}" for _, _, h in api.requests)


async def test_closing_or_killing_a_sandbox_of_a_space_leaves_the_space_usable(
    api: LiveApi,
) -> None:
    async with _space(api) as space:
        first = await space.sandboxes.create()
        second = await space.sandboxes.create()
        await first.close()
        await first.close()  # idempotent
        assert await second.kill() is True
        assert [s.sandbox_id for s in await space.sandboxes.list()] == [first.sandbox_id]
        assert (await first.get_info()).state == "running"  # its close kept the connection


async def test_negative_after_the_space_closes_every_call_raises_conflict_and_kills_nothing(
    api: LiveApi,
) -> None:
    space = _space(api)
    sandbox = await space.sandboxes.create()
    await space.aclose()
    await space.aclose()  # idempotent
    with pytest.raises(Conflict, match="connection is closed"):
        await space.sandboxes.list()
    with pytest.raises(Conflict, match="connection is closed"):
        await sandbox.get_info()
    assert list(api.node.boxes) == [sandbox.sandbox_id]


async def test_a_space_sends_the_same_requests_as_the_classmethods(api: LiveApi) -> None:
    sandbox = await AsyncSandbox.create(**connection(api))
    sid, snapshot_id = sandbox.sandbox_id, (await sandbox.snapshot("a")).snapshot_id
    api.requests.clear()
    await AsyncSandbox.list_snapshots(sandbox_id=sid, **connection(api))
    await AsyncSandbox.delete_snapshot(snapshot_id, **connection(api))
    await AsyncSandbox.list_pools(**connection(api))
    by_classmethods = [(method, path) for method, path, _ in api.requests]
    api.requests.clear()
    async with _space(api) as space:
        await space.sandboxes.list_snapshots(sandbox_id=sid)
        await space.sandboxes.delete_snapshot(snapshot_id)  # deleted: 204 again
        await space.sandboxes.list_pools()
    assert [(method, path) for method, path, _ in api.requests] == by_classmethods
    await sandbox.close()


async def test_negative_a_malformed_id_is_refused_before_anything_is_sent(api: LiveApi) -> None:
    async with _space(api) as space:
        with pytest.raises(InvalidArgument):
            await space.sandboxes.delete_snapshot("../sandboxes")
        with pytest.raises(InvalidArgument):
            await space.sandboxes.list_snapshots(sandbox_id="a/b")
    assert api.requests == []


async def test_the_connection_comes_from_the_environment_when_not_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPACE_API_URL", "http://from-env:9999/")
    monkeypatch.setenv("SPACE_API_KEY", "sk-env")
    async with AsyncSpace(request_timeout_s=5) as space:
        config = space.config
    assert (config.api_url, config.api_key, config.request_timeout_s) == (
        "http://from-env:9999", "sk-env", 5
    )  # fmt: skip
    assert "sk-env" not in repr(space)


async def test_secrets_and_templates_of_a_space_reach_the_control_plane(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    async with control_app(tmp_path / "data") as h:
        key = h.key("acme")["Authorization"].removeprefix("Bearer ")
        async with AsyncSpace(api_key=key, transport=httpx.ASGITransport(app=h.app)) as space:
            info = await space.secrets.set("TOKEN", "sk-value", ["api.example.com"])
            got = await space.secrets.get("TOKEN")
            await space.secrets.delete("TOKEN")
            await space.secrets.delete("TOKEN")  # idempotent
            secrets_after = await space.secrets.list()
            built = await space.templates.build(root)
            refs = [t.ref for t in await space.templates.list()]
            await space.templates.delete(built)
            with pytest.raises(NotFound):
                await space.templates.delete(built)
    assert isinstance(info, SecretInfo) and got == info and secrets_after == []
    assert refs == ["base:latest", "py:v1"]


async def test_one_call_closes_its_connection_unless_a_sandbox_keeps_it() -> None:
    async with one_call("http://x", None, None, None) as plain:
        pass
    async with one_call("http://x", None, None, None, keep_open=True) as kept:
        pass
    with pytest.raises(RuntimeError):
        async with one_call("http://x", None, None, None, keep_open=True) as failed:
            raise RuntimeError("the call failed")
    assert plain._client.is_closed and failed._client.is_closed
    assert not kept._client.is_closed
    await kept.aclose()


def test_sync_space_wraps_the_async_one_and_its_sandboxes_are_sandboxes(
    sync_api: LiveApi,
) -> None:
    api = sync_api
    with Space("http://space", api.key, transport=api.transport()) as space:
        with space.sandboxes.create() as sandbox:
            assert isinstance(sandbox, Sandbox)
            assert [s.sandbox_id for s in space.sandboxes.list()] == [sandbox.sandbox_id]
        assert space.sandboxes.list() == []  # the with block killed it, the space lives on
        kept = space.sandboxes.create()
    with pytest.raises(Conflict):
        kept.get_info()
    assert list(api.node.boxes) == [kept.sandbox_id]  # closing the space kills nothing
