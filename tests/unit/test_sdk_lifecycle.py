"""The SDK's sandbox lifecycle against the real API: pause, hibernate, resume, timeouts, fork.

Snapshots, restore and create-from-snapshot are in test_sdk_snapshots.py.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from space.limits import (
    CPUS,
    DISK_MIB,
    ENV,
    MAX_FORK_CHILDREN,
    MEMORY_MIB,
    METADATA,
    RESOURCES,
)
from space.node.api import SandboxState
from space.sdk import AsyncSandbox, Sandbox, SandboxInfo
from space.sdk._sandbox_requests import create_body
from space.sdk.errors import Conflict, InternalError, InvalidArgument, NotFound
from tests.unit._live_api import LiveApi
from tests.unit._sdk_calls import bodies as _bodies
from tests.unit._sdk_calls import create as _sdk_sandbox

pytestmark = pytest.mark.anyio


# pause and resume


async def test_sdk_pause_and_resume_post_to_the_documented_paths_and_report_the_state(
    api: LiveApi,
) -> None:
    sandbox = await _sdk_sandbox(api)
    sid = sandbox.sandbox_id

    paused = await sandbox.pause()
    listed = {info.sandbox_id: info.state for info in await _list(api)}
    resumed = await sandbox.resume()
    await sandbox.close()

    assert paused.state == "paused" and listed == {sid: "paused"}
    assert resumed.state == "running" and api.node.boxes[sid].status.state == SandboxState.RUNNING
    posts = [path for method, path, _ in api.requests if method == "POST"]
    assert posts[-2:] == [f"/v1/sandboxes/{sid}/pause", f"/v1/sandboxes/{sid}/resume"]


async def test_sdk_command_on_a_paused_sandbox_runs_and_leaves_it_running(api: LiveApi) -> None:
    api.scripts["echo hi"] = [("stdout", b"hi\n"), ("exit", 0, None, False)]
    sandbox = await _sdk_sandbox(api)
    await sandbox.pause()

    result = await sandbox.commands.run("echo hi")

    assert result.stdout == "hi\n"
    assert (await sandbox.get_info()).state == "running"
    await sandbox.close()


async def test_negative_sdk_pause_of_a_sandbox_in_error_raises_conflict_naming_it(
    api: LiveApi,
) -> None:
    sandbox = await _sdk_sandbox(api)
    await api.set_node_state(sandbox.sandbox_id, SandboxState.ERROR)
    with pytest.raises(Conflict, match="it is error"):
        await sandbox.pause()
    with pytest.raises(Conflict, match="it is error"):
        await sandbox.resume()
    assert (await sandbox.get_info()).state == "error"
    await sandbox.close()


async def test_negative_sdk_pause_of_a_deleted_sandbox_raises_not_found(api: LiveApi) -> None:
    sandbox = await _sdk_sandbox(api)
    del api.node.boxes[sandbox.sandbox_id]  # the node lost it
    with pytest.raises(NotFound):
        await sandbox.pause()
    await sandbox.close()


def test_sync_sandbox_pause_and_resume_wrap_the_async_core(sync_api: LiveApi) -> None:
    sandbox = Sandbox.create(**sync_api.connection())
    try:
        assert sandbox.pause().state == "paused"
        assert sandbox.get_info().state == "paused"
        assert sandbox.resume().state == "running"
    finally:
        sandbox.close()


# hibernate


async def test_sdk_hibernate_posts_to_its_path_and_resume_wakes_the_sandbox(
    api: LiveApi,
) -> None:
    sandbox = await _sdk_sandbox(api)
    sid = sandbox.sandbox_id

    hibernated = await sandbox.hibernate()
    again = await sandbox.hibernate()
    resumed = await sandbox.resume()
    await sandbox.close()

    assert (hibernated.state, again.state, resumed.state) == ("hibernated", "hibernated", "running")
    posts = [path for method, path, _ in api.requests if method == "POST"]
    assert posts[-3:] == [f"/v1/sandboxes/{sid}/{a}" for a in ("hibernate", "hibernate", "resume")]


async def test_negative_sdk_hibernate_of_a_sandbox_in_error_raises_conflict_keeping_the_message(
    api: LiveApi,
) -> None:
    sandbox = await _sdk_sandbox(api)
    await api.set_node_state(sandbox.sandbox_id, SandboxState.ERROR)
    with pytest.raises(Conflict) as caught:
        await sandbox.hibernate()
    assert (await sandbox.get_info()).state == "error"
    await sandbox.close()
    error = caught.value
    assert error.message == f"cannot hibernate sandbox {sandbox.sandbox_id}: it is error"
    assert (error.status_code, error.details, error.operation) == (
        409, {"sandbox_id": sandbox.sandbox_id, "state": "error"}, "sandbox.hibernate"
    )  # fmt: skip


# create's lifecycle fields and set_timeouts


async def test_create_sends_idle_timeout_and_leaves_unset_sizes_to_the_api(api: LiveApi) -> None:
    plain = await _sdk_sandbox(api)
    idle = await _sdk_sandbox(api, idle_timeout_s=60, timeout_s=None)
    fresh = await idle.get_info()
    await idle.files.exists("/")  # a file call: activity (docs/api.md)
    info = await idle.get_info()
    await plain.close()
    await idle.close()

    first, second = _bodies(api, "/v1/sandboxes")
    assert "idle_timeout_s" not in first and not {"template", "cpus"} & first.keys()
    assert (second["idle_timeout_s"], second["timeout_s"]) == (60, None)
    assert (info.idle_timeout_s, info.max_lifetime_s, info.cpus) == (60, None, 1)
    assert fresh.last_active_at is None  # no exec, process or file call yet
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
    api: LiveApi, arguments: dict[str, Any]
) -> None:
    sandbox = await _sdk_sandbox(api, idle_timeout_s=90, timeout_s=300)
    info = await sandbox.set_timeouts(**arguments)
    await sandbox.close()

    assert _bodies(api, "/timeouts") == [arguments]
    expected = {"idle_timeout_s": 90, "max_lifetime_s": 300, **arguments}
    assert (info.idle_timeout_s, info.max_lifetime_s) == tuple(expected.values())
    assert ("PUT", f"/v1/sandboxes/{sandbox.sandbox_id}/timeouts") in [
        (method, path) for method, path, _ in api.requests
    ]


async def test_negative_set_timeouts_out_of_range_raises_invalid_argument_and_changes_nothing(
    api: LiveApi,
) -> None:
    sandbox = await _sdk_sandbox(api, idle_timeout_s=90)
    with pytest.raises(
        InvalidArgument, match="idle_timeout_s: Input should be greater than or equal to 1"
    ):
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


async def test_fork_returns_usable_children_each_with_its_own_connection(api: LiveApi) -> None:
    api.scripts["hostname"] = [("stdout", b"child\n"), ("exit", 0, None, False)]
    parent = await _sdk_sandbox(api)

    children = await parent.fork(3)
    ran = await children[0].commands.run("hostname")
    killed = await children[0].kill()  # closes that child's connection only
    parent_info = await parent.get_info()
    second_info = await children[1].get_info()
    for child in children[1:]:
        await child.close()
    await parent.close()

    assert _bodies(api, "/fork") == [{"count": 3}]
    ids = [child.sandbox_id for child in children]
    assert len(set(ids)) == 3 and parent.sandbox_id not in ids
    assert all(isinstance(child, AsyncSandbox) for child in children)
    assert (ran.stdout, killed, parent_info.state, second_info.state) == (
        "child\n", True, "running", "running"
    )  # fmt: skip
    assert set(api.node.boxes) == {parent.sandbox_id, *ids[1:]}
    assert all(h["authorization"] == f"Bearer {api.key}" for _, _, h in api.requests)


async def test_fork_defaults_to_one_child(api: LiveApi) -> None:
    parent = await _sdk_sandbox(api)
    children = await parent.fork()
    await children[0].close()
    await parent.close()
    assert len(children) == 1 and _bodies(api, "/fork") == [{"count": 1}]


@pytest.mark.parametrize("n", [0, 17])
async def test_negative_fork_out_of_range_raises_invalid_argument_and_makes_nothing(
    api: LiveApi, n: int
) -> None:
    parent = await _sdk_sandbox(api)
    with pytest.raises(InvalidArgument, match=f"n must be 1 to {MAX_FORK_CHILDREN}, got {n}"):
        await parent.fork(n)
    await parent.close()
    assert list(api.node.boxes) == [parent.sandbox_id]
    assert _bodies(api, "/fork") == []  # refused before anything was sent


async def test_negative_fork_of_a_sandbox_still_creating_raises_conflict_and_makes_nothing(
    api: LiveApi,
) -> None:
    parent = await _sdk_sandbox(api)
    await api.set_node_state(parent.sandbox_id, SandboxState.CREATING)
    with pytest.raises(Conflict, match="it is creating"):
        await parent.fork(2)
    await parent.close()
    assert list(api.node.boxes) == [parent.sandbox_id]


@pytest.mark.parametrize("answer", [{"sandboxes": "no"}, {"children": []}, [], {"sandboxes": [{}]}])
async def test_negative_a_malformed_fork_answer_raises_internal_error(
    api: LiveApi, answer: Any
) -> None:
    # The real API cannot answer this: a tiny handler breaks its fork answers.
    inner = api.transport()

    async def route(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/fork"):
            return httpx.Response(201, json=answer)
        return await inner.handle_async_request(request)

    parent = await AsyncSandbox.create(api_key=api.key, _transport=httpx.MockTransport(route))
    with pytest.raises(InternalError, match="malformed"):
        await parent.fork(1)
    await parent.close()


# the sync facade


def test_sync_hibernate_set_timeouts_and_fork_wrap_the_async_core(sync_api: LiveApi) -> None:
    sandbox = Sandbox.create(**sync_api.connection())
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


async def _list(api: LiveApi) -> list[SandboxInfo]:
    return await AsyncSandbox.list(**api.connection())


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
    api: LiveApi, name: str, value: object
) -> None:
    with pytest.raises(InvalidArgument, match=f"{name} must be within"):
        await _sdk_sandbox(api, **{name: value})
    assert _bodies(api, "/v1/sandboxes") == [] and not api.node.boxes


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"env": {"A\0B": "x"}}, "without NUL or '='"),
        ({"env": {"A=B": "x"}}, "without NUL or '='"),
        ({"env": {f"V{i}": "" for i in range(ENV.entries + 1)}}, "at most 256"),
        ({"metadata": {"k": "v" * (METADATA.value_bytes + 1)}}, "at most 1024"),
    ],
)
async def test_negative_a_bad_env_or_metadata_is_refused_before_sending(
    api: LiveApi, options: dict[str, Any], words: str
) -> None:
    with pytest.raises(InvalidArgument, match=words):
        await _sdk_sandbox(api, **options)
    assert _bodies(api, "/v1/sandboxes") == [] and not api.node.boxes


async def test_negative_a_bad_exec_env_is_refused_before_sending(api: LiveApi) -> None:
    sandbox = await _sdk_sandbox(api)
    with pytest.raises(InvalidArgument, match="without NUL or '='"):
        await sandbox.commands.run("true", env={"A=B": "x"})
    assert api.exec_bodies == []


async def test_create_at_every_resource_limit_is_sent() -> None:
    # The same space.limits the API enforces: its bounds pass the SDK's own check.
    for allowed in RESOURCES.values():
        assert allowed.holds(allowed.low) and allowed.holds(allowed.high)
    body = create_body(None, CPUS.high, MEMORY_MIB.high, DISK_MIB.low, None)
    assert body == {"cpus": CPUS.high, "memory_mib": MEMORY_MIB.high, "disk_mib": DISK_MIB.low}
