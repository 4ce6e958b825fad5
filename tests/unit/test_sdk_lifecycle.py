"""The SDK's sandbox lifecycle against the fake API: pause, hibernate, resume, timeouts, fork.

Snapshots, restore and create-from-snapshot are in test_sdk_snapshots.py.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from space.limits import CPUS, DISK_MIB, MAX_FORK_CHILDREN, MEMORY_MIB, RESOURCES
from space.sdk import AsyncSandbox, Sandbox, SandboxInfo
from space.sdk._sandbox_requests import create_body
from space.sdk.errors import Conflict, InternalError, InvalidArgument, NotFound
from tests.unit._sdk_calls import bodies as _bodies
from tests.unit._sdk_calls import create as _sdk_sandbox
from tests.unit.test_sdk_fake_api import API_KEY, FakeApi

pytestmark = pytest.mark.anyio


# pause and resume


async def test_sdk_pause_and_resume_post_to_the_documented_paths_and_report_the_state(
    fake: FakeApi,
) -> None:
    sandbox = await _sdk_sandbox(fake)
    sid = sandbox.sandbox_id

    paused = await sandbox.pause()
    listed = {info.sandbox_id: info.state for info in await _list(fake)}
    resumed = await sandbox.resume()
    await sandbox.close()

    assert paused.state == "paused" and listed == {sid: "paused"}
    assert resumed.state == "running" and fake.sandboxes[sid]["state"] == "running"
    posts = [path for method, path, _ in fake.requests if method == "POST"]
    assert posts[-2:] == [f"/v1/sandboxes/{sid}/pause", f"/v1/sandboxes/{sid}/resume"]


async def test_sdk_command_on_a_paused_sandbox_runs_and_leaves_it_running(fake: FakeApi) -> None:
    fake.scripts["echo hi"] = [("stdout", b"hi\n"), ("exit", 0, None, False)]
    sandbox = await _sdk_sandbox(fake)
    await sandbox.pause()

    result = await sandbox.commands.run("echo hi")

    assert result.stdout == "hi\n"
    assert (await sandbox.get_info()).state == "running"
    await sandbox.close()


async def test_negative_sdk_pause_of_a_sandbox_in_error_raises_conflict_naming_it(
    fake: FakeApi,
) -> None:
    sandbox = await _sdk_sandbox(fake)
    fake.sandboxes[sandbox.sandbox_id]["state"] = "error"
    with pytest.raises(Conflict, match="it is error"):
        await sandbox.pause()
    with pytest.raises(Conflict, match="it is error"):
        await sandbox.resume()
    await sandbox.close()
    assert fake.sandboxes[sandbox.sandbox_id]["state"] == "error"


async def test_negative_sdk_pause_of_a_deleted_sandbox_raises_not_found(fake: FakeApi) -> None:
    sandbox = await _sdk_sandbox(fake)
    del fake.sandboxes[sandbox.sandbox_id]
    with pytest.raises(NotFound):
        await sandbox.pause()
    await sandbox.close()


def test_sync_sandbox_pause_and_resume_wrap_the_async_core(fake: FakeApi) -> None:
    sandbox = Sandbox.create(api_url="http://space", api_key=API_KEY, _transport=fake.transport())
    try:
        assert sandbox.pause().state == "paused"
        assert sandbox.get_info().state == "paused"
        assert sandbox.resume().state == "running"
    finally:
        sandbox.close()


# hibernate


async def test_sdk_hibernate_posts_to_its_path_and_resume_wakes_the_sandbox(
    fake: FakeApi,
) -> None:
    sandbox = await _sdk_sandbox(fake)
    sid = sandbox.sandbox_id

    hibernated = await sandbox.hibernate()
    again = await sandbox.hibernate()
    resumed = await sandbox.resume()
    await sandbox.close()

    assert (hibernated.state, again.state, resumed.state) == ("hibernated", "hibernated", "running")
    posts = [path for method, path, _ in fake.requests if method == "POST"]
    assert posts[-3:] == [f"/v1/sandboxes/{sid}/{a}" for a in ("hibernate", "hibernate", "resume")]


async def test_negative_sdk_hibernate_of_a_sandbox_in_error_raises_conflict_keeping_the_message(
    fake: FakeApi,
) -> None:
    sandbox = await _sdk_sandbox(fake)
    fake.sandboxes[sandbox.sandbox_id]["state"] = "error"
    with pytest.raises(Conflict) as caught:
        await sandbox.hibernate()
    await sandbox.close()
    error = caught.value
    assert error.message == f"cannot hibernate sandbox {sandbox.sandbox_id}: it is error"
    assert (error.status_code, error.details, error.operation) == (
        409, {"state": "error"}, "sandbox.hibernate"
    )  # fmt: skip
    assert fake.sandboxes[sandbox.sandbox_id]["state"] == "error"


# create's lifecycle fields and set_timeouts


async def test_create_sends_idle_timeout_and_leaves_unset_sizes_to_the_api(fake: FakeApi) -> None:
    plain = await _sdk_sandbox(fake)
    idle = await _sdk_sandbox(fake, idle_timeout_s=60, timeout_s=None)
    info = await idle.get_info()
    await plain.close()
    await idle.close()

    first, second = _bodies(fake, "/v1/sandboxes")
    assert "idle_timeout_s" not in first and not {"template", "cpus"} & first.keys()
    assert (second["idle_timeout_s"], second["timeout_s"]) == (60, None)
    assert (info.idle_timeout_s, info.max_lifetime_s, info.cpus) == (60, None, 1)
    assert info.last_active_at is not None and info.last_active_at.tzinfo is not None


@pytest.mark.parametrize(
    "arguments",
    [
        {"idle_timeout_s": 30},
        {"max_lifetime_s": None},
        {"idle_timeout_s": None, "max_lifetime_s": 600},
        {},
    ],
)
async def test_set_timeouts_sends_exactly_the_arguments_given_none_included(
    fake: FakeApi, arguments: dict[str, Any]
) -> None:
    sandbox = await _sdk_sandbox(fake, idle_timeout_s=90, timeout_s=300)
    info = await sandbox.set_timeouts(**arguments)
    await sandbox.close()

    assert _bodies(fake, "/timeouts") == [arguments]
    expected = {"idle_timeout_s": 90, "max_lifetime_s": 300, **arguments}
    assert (info.idle_timeout_s, info.max_lifetime_s) == tuple(expected.values())
    assert ("PUT", f"/v1/sandboxes/{sandbox.sandbox_id}/timeouts") in [
        (method, path) for method, path, _ in fake.requests
    ]


async def test_negative_set_timeouts_out_of_range_raises_invalid_argument_and_changes_nothing(
    fake: FakeApi,
) -> None:
    sandbox = await _sdk_sandbox(fake, idle_timeout_s=90)
    with pytest.raises(InvalidArgument, match="bad timeouts"):
        await sandbox.set_timeouts(idle_timeout_s=0)
    info = await sandbox.get_info()
    await sandbox.close()
    assert info.idle_timeout_s == 90


@pytest.mark.parametrize(
    ("key", "value"),
    [("idle_timeout_s", "60"), ("max_lifetime_s", True), ("last_active_at", "soon"),
     ("head_snapshot", 7)],
)  # fmt: skip
def test_negative_malformed_lifecycle_fields_of_a_sandbox_raise_internal_error(
    key: str, value: Any
) -> None:
    body = {"id": "s", "template": "base", "state": "hibernated", "cpus": 1, "memory_mib": 256}
    with pytest.raises(InternalError, match="malformed sandbox"):
        SandboxInfo.from_wire({**body, "disk_mib": 2048, key: value})


# fork


async def test_fork_returns_usable_children_each_with_its_own_connection(fake: FakeApi) -> None:
    fake.scripts["hostname"] = [("stdout", b"child\n"), ("exit", 0, None, False)]
    parent = await _sdk_sandbox(fake)

    children = await parent.fork(3)
    ran = await children[0].commands.run("hostname")
    killed = await children[0].kill()  # closes that child's connection only
    parent_info = await parent.get_info()
    second_info = await children[1].get_info()
    for child in children[1:]:
        await child.close()
    await parent.close()

    assert _bodies(fake, "/fork") == [{"count": 3}]
    ids = [child.sandbox_id for child in children]
    assert len(set(ids)) == 3 and parent.sandbox_id not in ids
    assert all(isinstance(child, AsyncSandbox) for child in children)
    assert (ran.stdout, killed, parent_info.state, second_info.state) == (
        "child\n", True, "running", "running"
    )  # fmt: skip
    assert set(fake.sandboxes) == {parent.sandbox_id, *ids[1:]}
    assert all(h["authorization"] == f"Bearer {API_KEY}" for _, _, h in fake.requests)


async def test_fork_defaults_to_one_child(fake: FakeApi) -> None:
    parent = await _sdk_sandbox(fake)
    children = await parent.fork()
    await children[0].close()
    await parent.close()
    assert len(children) == 1 and _bodies(fake, "/fork") == [{"count": 1}]


@pytest.mark.parametrize("n", [0, 17])
async def test_negative_fork_out_of_range_raises_invalid_argument_and_makes_nothing(
    fake: FakeApi, n: int
) -> None:
    parent = await _sdk_sandbox(fake)
    with pytest.raises(InvalidArgument, match=f"n must be 1 to {MAX_FORK_CHILDREN}, got {n}"):
        await parent.fork(n)
    await parent.close()
    assert list(fake.sandboxes) == [parent.sandbox_id]
    assert _bodies(fake, "/fork") == []  # refused before anything was sent


async def test_negative_fork_of_a_sandbox_still_creating_raises_conflict_and_makes_nothing(
    fake: FakeApi,
) -> None:
    parent = await _sdk_sandbox(fake)
    fake.sandboxes[parent.sandbox_id]["state"] = "creating"
    with pytest.raises(Conflict, match="it is creating"):
        await parent.fork(2)
    await parent.close()
    assert list(fake.sandboxes) == [parent.sandbox_id]


@pytest.mark.parametrize("answer", [{"sandboxes": "no"}, {"children": []}, [], {"sandboxes": [{}]}])
async def test_negative_a_malformed_fork_answer_raises_internal_error(answer: Any) -> None:
    fake = FakeApi()
    inner = fake.transport()

    async def route(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/fork"):
            return httpx.Response(201, json=answer)
        return await inner.handle_async_request(request)

    parent = await AsyncSandbox.create(api_key=API_KEY, _transport=httpx.MockTransport(route))
    with pytest.raises(InternalError, match="malformed"):
        await parent.fork(1)
    await parent.close()


# the sync facade


def test_sync_hibernate_set_timeouts_and_fork_wrap_the_async_core(fake: FakeApi) -> None:
    sandbox = Sandbox.create(api_url="http://space", api_key=API_KEY, _transport=fake.transport())
    try:
        assert sandbox.hibernate().state == "hibernated"
        assert sandbox.set_timeouts(max_lifetime_s=None).max_lifetime_s is None
        children = sandbox.fork(2)
        assert all(isinstance(child, Sandbox) for child in children) and len(children) == 2
        assert children[0].get_info().state == "running"
        assert children[1].kill() is True
        children[0].close()
    finally:
        sandbox.close()


async def _list(fake: FakeApi) -> list[SandboxInfo]:
    return await AsyncSandbox.list(
        api_url="http://space", api_key=API_KEY, _transport=fake.transport()
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("cpus", CPUS.low - 1),
        ("cpus", CPUS.high + 1),
        ("memory_mib", MEMORY_MIB.low - 1),
        ("disk_mib", DISK_MIB.high + 1),
        ("cpus", True),
    ],
)
async def test_negative_create_past_a_resource_limit_raises_and_sends_nothing(
    fake: FakeApi, name: str, value: object
) -> None:
    with pytest.raises(InvalidArgument, match=f"{name} must be within"):
        await _sdk_sandbox(fake, **{name: value})
    assert _bodies(fake, "/v1/sandboxes") == [] and not fake.sandboxes


async def test_create_at_every_resource_limit_is_sent() -> None:
    # The same space.limits the API enforces: its bounds pass the SDK's own check.
    for allowed in RESOURCES.values():
        assert allowed.holds(allowed.low) and allowed.holds(allowed.high)
    body = create_body(None, CPUS.high, MEMORY_MIB.high, DISK_MIB.low, None)
    assert body == {"cpus": CPUS.high, "memory_mib": MEMORY_MIB.high, "disk_mib": DISK_MIB.low}
