"""No answer to a tenant quotes a node-internal name (issue 17): a node's errors, build
log lines, stream errors and sandbox errors name its templates as ``t<16 hex>.<name>``
and its store by host path; every way they reach a tenant is driven here over a node
that quotes both, and no answer body may contain either."""

from __future__ import annotations

import re
from collections.abc import AsyncIterable
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from space.control.node_text import NODE_PATH, scrub
from space.control.reconcile import notice_failed_vms
from space.control.template_names import tenant_prefix
from space.node.api import (
    BuildEvent,
    BuildFailed,
    BuildLog,
    Conflict,
    ExecOutput,
    InsufficientCapacity,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    PoolInfo,
    SandboxState,
    Unavailable,
)
from tests.unit._fake_templates import FakeBuildStream
from tests.unit.fakes import FakeNode, Harness, control_app
from tests.unit.test_control_templates import archive

pytestmark = pytest.mark.anyio

_INTERNAL_NAME = re.compile(r"t[0-9a-f]{16}\.")
_DIGEST = "d1" * 32
_HOST_ROOT = "/var/lib/space/pool"


def _leak(tenant: str = "acme") -> str:
    """A node's message quoting an internal template name and two store paths."""
    name = tenant_prefix(tenant) + "py"
    return (
        f"template {name} failed: cannot snapshot '{_HOST_ROOT}/templates/{name}/{_DIGEST}'"
        f" as {_HOST_ROOT}/sandboxes/sb-0123/disk.img (also {tenant_prefix('other')}x)"
    )


def _assert_clean(answer: httpx.Response) -> None:
    assert not _INTERNAL_NAME.search(answer.text), answer.text
    assert _HOST_ROOT not in answer.text and "/sandboxes/sb-" not in answer.text, answer.text


class LeakyNode(FakeNode):
    """A FakeNode whose builds and template deletes quote internal names."""

    async def build_template(self, context: AsyncIterable[bytes]) -> FakeBuildStream:
        await super().build_template(context)
        events: list[BuildEvent] = [
            BuildLog(f"step 1/1 run: {_leak()}"),
            BuildFailed("build_failed", _leak(), 1),
        ]
        return FakeBuildStream("b-leak", events)

    async def delete_template(self, ref: str) -> None:
        raise Conflict(_leak())


async def _sandbox(h: Harness, key: dict[str, str]) -> str:
    answer = await h.client.post("/v1/sandboxes", json={}, headers=key)
    assert answer.status_code == 201, answer.text
    sid: str = answer.json()["id"]
    return sid


@pytest.mark.parametrize(
    "error",
    [Unavailable(_leak()), InvalidArgument(_leak()), NotFound(_leak())],
    ids=["failure", "refusal", "not-found"],
)
async def test_negative_a_failed_create_and_its_row_name_nothing_internal(
    tmp_path: Path, error: Exception
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        h.node.fail_create = error  # type: ignore[assignment]
        answer = await h.client.post("/v1/sandboxes", json={}, headers=key)
        assert answer.status_code >= 400
        _assert_clean(answer)
        listed = await h.client.get("/v1/sandboxes", headers=key)
        _assert_clean(listed)
        for sandbox in listed.json()["sandboxes"]:  # a failure keeps its row in error
            assert NODE_PATH in sandbox["error"]
            _assert_clean(await h.client.get(f"/v1/sandboxes/{sandbox['id']}", headers=key))


async def test_negative_no_room_anywhere_names_nothing_internal(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        h.node.fail_create = InsufficientCapacity(
            _leak(), resource="pool", needed=1, available=0, unit="MiB"
        )
        _assert_clean(await h.client.post("/v1/sandboxes", json={}, headers=h.key("acme")))


@pytest.mark.parametrize(
    ("method", "route", "body"),
    [
        ("POST", "/fork", {"count": 2}),
        ("POST", "/snapshots", {"name": "s1"}),
        ("POST", "/pause", None),
        ("POST", "/hibernate", None),
        ("POST", "/exec", {"cmd": "true"}),
        ("GET", "/processes", None),
        ("GET", "/files/stat?path=/etc/hosts", None),
        ("PUT", "/egress", {"allow": []}),
    ],
)
async def test_negative_a_node_error_on_any_sandbox_route_names_nothing_internal(
    tmp_path: Path, method: str, route: str, body: object
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        sid = await _sandbox(h, key)
        h.node.fail_next = Unavailable(_leak(), sandbox_id=sid)
        answer = await h.client.request(
            method, f"/v1/sandboxes/{sid}{route}", json=body, headers=key
        )
        assert answer.status_code == 503, answer.text
        _assert_clean(answer)
        assert NODE_PATH in answer.json()["error"]["message"]


async def test_negative_restore_and_create_from_a_snapshot_name_nothing_internal(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        sid = await _sandbox(h, key)
        taken = await h.client.post(
            f"/v1/sandboxes/{sid}/snapshots", json={"name": "s"}, headers=key
        )
        assert taken.status_code == 201, taken.text
        snapshot_id = taken.json()["id"]
        h.node.fail_next = Conflict(_leak(), sandbox_id=sid)
        body = {"snapshot_id": snapshot_id}
        restored = await h.client.post(f"/v1/sandboxes/{sid}/restore", json=body, headers=key)
        assert restored.status_code == 409
        _assert_clean(restored)
        h.node.fail_create = Unavailable(_leak())
        body = {"from_snapshot": snapshot_id}
        _assert_clean(await h.client.post("/v1/sandboxes", json=body, headers=key))
        for path in ("/v1/snapshots", f"/v1/snapshots/{snapshot_id}"):
            answer = await h.client.get(path, headers=key)
            assert answer.status_code == 200 and "template" in answer.text
            _assert_clean(answer)


async def test_negative_an_exec_stream_error_names_nothing_internal(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        sid = await _sandbox(h, key)
        h.node.scripts["leak"] = [ExecOutput("stdout", b"hi\n"), Unavailable(_leak())]
        answer = await h.client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "leak"}, headers=key)
        assert answer.status_code == 200 and '"type":"error"' in answer.text.replace(" ", "")
        _assert_clean(answer)


async def test_negative_a_sandbox_the_node_reports_in_error_names_nothing_internal(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        sid = await _sandbox(h, key)
        box = h.node.boxes[sid]
        box.status = replace(box.status, state=SandboxState.ERROR, error=_leak())
        assert await notice_failed_vms(h.app.state.ctx) == [sid]
        for path in (f"/v1/sandboxes/{sid}", "/v1/sandboxes"):
            answer = await h.client.get(path, headers=key)
            assert answer.status_code == 200 and NODE_PATH in answer.text, answer.text
            _assert_clean(answer)


async def test_negative_templates_and_their_builds_name_nothing_internal(tmp_path: Path) -> None:
    async with control_app(tmp_path, LeakyNode()) as h:
        key = h.key("acme")
        built = await h.client.post("/v1/templates", content=archive(), headers=key)
        assert "build_failed" in built.text and "step 1/1 run" in built.text
        _assert_clean(built)
        h.node.templates[(tenant_prefix("other") + "secret", "latest")] = replace(
            h.node.templates[("base", "latest")], name=tenant_prefix("other") + "secret"
        )
        h.node.templates[(tenant_prefix("acme") + "py", "v1")] = replace(
            h.node.templates[("base", "latest")], name=tenant_prefix("acme") + "py", tag="v1"
        )
        listed = await h.client.get("/v1/templates", headers=key)
        assert "py" in listed.text and "secret" not in listed.text
        _assert_clean(listed)
        deleted = await h.client.delete("/v1/templates/py:v1", headers=key)
        assert deleted.status_code == 409
        _assert_clean(deleted)


async def test_negative_pools_name_no_internal_template(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        h.node.pools = [
            PoolInfo(tenant_prefix("acme") + "py:latest", 1, 1, 0, 2, 0, 0),
            PoolInfo(tenant_prefix("other") + "x:latest", 1, 1, 0, 2, 0, 0),
            PoolInfo("base:latest", 1, 1, 0, 2, 0, 0),
        ]
        answer = await h.client.get("/v1/pools", headers=h.key("acme"))
        assert answer.status_code == 200 and "py" in answer.text
        _assert_clean(answer)


async def test_a_guest_path_in_a_node_error_is_kept(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        sid = await _sandbox(h, key)
        h.node.fail_next = PermissionDenied("cannot read /home/user/templates/notes.txt")
        answer = await h.client.get(
            f"/v1/sandboxes/{sid}/files/stat", params={"path": "/x"}, headers=key
        )
        assert answer.json()["error"]["message"] == "cannot read /home/user/templates/notes.txt"


@pytest.mark.parametrize(
    ("text", "clean"),
    [
        ("no template tca978112ca1bbdca.py:v1", "no template py:v1"),
        (f"{_HOST_ROOT}/templates/base/{_DIGEST}/rootfs.img is gone", f"{NODE_PATH} is gone"),
        ("'/mnt/p/snapshots/sn-1/mem' missing", f"'{NODE_PATH}' missing"),
        ("/home/user/sandboxes/mine and /srv/templates/site", None),
        ("start0123456789abcdef.x stays", None),
    ],
)
def test_scrub_takes_out_node_names_and_store_paths_only(text: str, clean: str | None) -> None:
    assert scrub(text) == (text if clean is None else clean)
