"""The REST API's secrets over a FakeNode: storage, bindings, grants pushed (issue 5)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import inspect, text

from space.control.reconcile import reap
from space.control.store import Database
from space.node.api import SandboxSpec, SandboxStatus, SecretGrant, Unavailable
from tests.unit.fakes import FakeNode, Harness, control_app

# DB-level: each test runs on SQLite and on PostgreSQL (issue 19).
pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("on_both_databases")]

VALUE = "sk-live-7d1f0a-never-shown"
NEW_VALUE = "sk-live-2b8e44-rotated-too"
SECRET = {"value": VALUE, "hosts": ["api.openai.com"], "env": "OPENAI_API_KEY"}
HEADER = {"value": VALUE, "hosts": ["*.example.com"], "injection": "header",
          "header": "Authorization", "format": "Bearer {value}"}  # fmt: skip


class SpecNode(FakeNode):
    """A FakeNode that keeps every spec it was asked to create."""

    def __init__(self) -> None:
        super().__init__()
        self.specs: dict[str, SandboxSpec] = {}

    async def create_sandbox(self, spec: SandboxSpec) -> SandboxStatus:
        self.specs[spec.sandbox_id] = spec
        return await super().create_sandbox(spec)


class Recording:
    """Every response body a test's client saw, to scan them all for the value."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, response: httpx.Response) -> None:
        self.bodies.append(await response.aread())


async def _put(h: Harness, key: dict[str, str], name: str, body: dict[str, Any]) -> Any:
    answer = await h.client.put(f"/v1/secrets/{name}", json=body, headers=key)
    assert answer.status_code == 200, answer.text
    return answer.json()


async def _create(h: Harness, key: dict[str, str], **body: Any) -> dict[str, Any]:
    answer = await h.client.post("/v1/sandboxes", json=body, headers=key)
    assert answer.status_code == 201, answer.text
    sandbox: dict[str, Any] = answer.json()
    return sandbox


def _grant(node: FakeNode, sandbox_id: str) -> dict[str, SecretGrant]:
    return {grant.name: grant for grant in node.grants[sandbox_id]}


async def test_put_answers_metadata_and_get_and_list_read_it_back(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        put = await _put(h, key, "OPENAI", SECRET)
        assert put["name"] == "OPENAI" and put["env"] == "OPENAI_API_KEY"
        assert put["hosts"] == ["api.openai.com"] and put["injection"] == "placeholder"
        assert put["header"] is None and put["format"] == "{value}"
        assert put["key_id"].startswith("mk-") and put["created_at"] == put["updated_at"]
        got = await h.client.get("/v1/secrets/OPENAI", headers=key)
        assert got.json() == put
        listed = await h.client.get("/v1/secrets", headers=key)
        assert listed.json() == {"secrets": [put]}
        default_env = await _put(h, key, "GH_TOKEN", {"value": VALUE, "hosts": ["github.com"]})
        assert default_env["env"] == "GH_TOKEN"


async def test_a_sandbox_sees_placeholders_and_its_node_gets_the_grants(tmp_path: Path) -> None:
    node = SpecNode()
    async with control_app(tmp_path, node) as h:
        key = h.key("acme")
        await _put(h, key, "OPENAI", SECRET)
        await _put(h, key, "API", HEADER)
        sandbox = await _create(h, key, env={"A": "1"}, secrets=["OPENAI", "API"])
        sid = sandbox["id"]
        shown = {s["name"]: s for s in sandbox["secrets"]}
        assert set(shown) == {"OPENAI", "API"} and shown["API"]["env"] == "API"
        placeholder = shown["OPENAI"]["placeholder"]
        assert placeholder.startswith("space_ph_") and len(placeholder) == 9 + 32
        assert node.specs[sid].env == {"A": "1", "OPENAI_API_KEY": placeholder,
                                       "API": shown["API"]["placeholder"]}  # fmt: skip
        grants = _grant(node, sid)
        assert grants["OPENAI"] == SecretGrant("OPENAI", VALUE, placeholder, ("api.openai.com",),
                                               "OPENAI_API_KEY")  # fmt: skip
        assert (grants["API"].injection, grants["API"].header) == ("header", "Authorization")
        assert grants["API"].format == "Bearer {value}"
        got = await h.client.get(f"/v1/sandboxes/{sid}", headers=key)
        assert got.json()["secrets"] == sandbox["secrets"]


async def test_a_sandbox_without_secrets_gets_no_grants_pushed(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        sandbox = await _create(h, h.key("acme"))
        assert sandbox["secrets"] == [] and h.node.grant_pushes == []


async def test_put_and_delete_push_the_change_to_every_bound_sandbox(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        await _put(h, key, "OPENAI", SECRET)
        bound = (await _create(h, key, secrets=["OPENAI"]))["id"]
        unbound = (await _create(h, key))["id"]
        await h.client.post(f"/v1/sandboxes/{bound}/hibernate", headers=key)
        await _put(h, key, "OPENAI", {**SECRET, "value": NEW_VALUE})
        assert _grant(h.node, bound)["OPENAI"].value == NEW_VALUE
        assert unbound not in h.node.grants
        assert (await h.client.delete("/v1/secrets/OPENAI", headers=key)).status_code == 204
        assert h.node.grants[bound] == []
        assert (await h.client.delete("/v1/secrets/OPENAI", headers=key)).status_code == 204
        # The binding stays: a new secret of that name is sent again.
        await _put(h, key, "OPENAI", SECRET)
        assert _grant(h.node, bound)["OPENAI"].value == VALUE


async def test_forks_keep_the_parents_placeholders_and_get_their_grants(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        await _put(h, key, "OPENAI", SECRET)
        parent = await _create(h, key, secrets=["OPENAI"])
        answer = await h.client.post(f"/v1/sandboxes/{parent['id']}/fork", headers=key)
        (child,) = answer.json()["sandboxes"]
        assert child["secrets"] == parent["secrets"]
        assert h.node.grants[child["id"]] == h.node.grants[parent["id"]]


async def test_a_sandbox_from_a_snapshot_inherits_bindings_and_placeholders(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        await _put(h, key, "OPENAI", SECRET)
        await _put(h, key, "OTHER", {"value": VALUE, "hosts": ["other.example"]})
        parent = await _create(h, key, secrets=["OPENAI"])
        snap = await h.client.post(
            f"/v1/sandboxes/{parent['id']}/snapshots", json={"name": "s"}, headers=key
        )
        snapshot_id = snap.json()["id"]
        same = await _create(h, key, from_snapshot=snapshot_id)
        assert same["secrets"] == parent["secrets"]
        more = await _create(h, key, from_snapshot=snapshot_id, secrets=["OTHER", "OPENAI"])
        shown = {s["name"]: s["placeholder"] for s in more["secrets"]}
        assert shown["OPENAI"] == parent["secrets"][0]["placeholder"]
        assert set(_grant(h.node, more["id"])) == {"OTHER", "OPENAI"}


async def test_a_restarted_node_gets_every_sandboxs_grants_again(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        await _put(h, key, "OPENAI", SECRET)
        sid = (await _create(h, key, secrets=["OPENAI"]))["id"]
        await reap(h.app.state.ctx)  # the boot id is remembered: nothing to send
        pushes = len(h.node.grant_pushes)
        await reap(h.app.state.ctx)
        assert len(h.node.grant_pushes) == pushes
        h.node.grants.clear()
        h.node.boot_id = "boot-2"
        await reap(h.app.state.ctx)
        assert _grant(h.node, sid)["OPENAI"].value == VALUE
        await reap(h.app.state.ctx)
        assert len(h.node.grant_pushes) == pushes + 1


async def test_startup_sends_grants_to_a_node_that_restarted_meanwhile(tmp_path: Path) -> None:
    node = FakeNode()
    async with control_app(tmp_path, node) as h:
        key = h.key("acme")
        await _put(h, key, "OPENAI", SECRET)
        sid = (await _create(h, key, secrets=["OPENAI"]))["id"]
    node.grants.clear()
    node.boot_id = "boot-2"
    async with control_app(tmp_path, node):
        assert _grant(node, sid)["OPENAI"].value == VALUE


async def test_negative_a_push_failing_transiently_is_retried_next_round(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        await _put(h, key, "OPENAI", SECRET)
        sid = (await _create(h, key, secrets=["OPENAI"]))["id"]
        await reap(h.app.state.ctx)
        h.node.fail_next = Unavailable("node busy")
        put = await h.client.put("/v1/secrets/OPENAI", json={**SECRET, "value": NEW_VALUE},
                                 headers=key)  # fmt: skip
        assert put.status_code == 200 and _grant(h.node, sid)["OPENAI"].value == VALUE
        await reap(h.app.state.ctx)
        assert _grant(h.node, sid)["OPENAI"].value == NEW_VALUE


async def test_negative_a_node_refusing_the_grants_at_create_leaves_an_error_row(
    tmp_path: Path,
) -> None:
    class Refusing(FakeNode):
        async def set_secrets(self, sandbox_id: str, grants: list[SecretGrant]) -> None:
            raise Unavailable("gateway down", sandbox_id=sandbox_id)

    async with control_app(tmp_path, Refusing()) as h:
        key = h.key("acme")
        await _put(h, key, "OPENAI", SECRET)
        answer = await h.client.post("/v1/sandboxes", json={"secrets": ["OPENAI"]}, headers=key)
        assert answer.status_code == 503
        sid = answer.json()["error"]["details"]["sandbox_id"]
        row = await h.client.get(f"/v1/sandboxes/{sid}", headers=key)
        assert row.json()["state"] == "error" and sid not in h.node.boxes


@pytest.mark.parametrize(
    ("name", "body", "field", "message"),
    [
        ("9BAD", SECRET, "name", "name must be a letter or _"),
        ("N", {**SECRET, "value": "a\r\nX-Evil: 1"}, "value", "control character"),
        ("N", {**SECRET, "value": "tab\there"}, "value", "control character"),
        ("N", {**SECRET, "value": ""}, "value", "non-empty"),
        ("N", {**SECRET, "hosts": ["a*.example.com"]}, "hosts", "hosts[0].domain"),
        ("N", {**SECRET, "hosts": []}, "hosts", "1..32 domain patterns"),
        # Every host under a public suffix is nobody's: a secret is bound within one
        # registrable domain (issue 17).
        *[
            ("N", {**SECRET, "hosts": ["api.example.com", host]}, "hosts", "registrable")
            for host in ("*", "*.*", "*.com", "com", "*.co.uk", "co.uk", "*.github.io")
        ],
        ("N", {**SECRET, "hosts": ["api.*.com"]}, "hosts", "hosts[0] 'api.*.com'"),
        ("N", {**HEADER, "header": "Host"}, "header", "frames the request"),
        ("N", {**HEADER, "header": "Bad Header"}, "header", "HTTP header name"),
        ("N", {**HEADER, "format": "Bearer"}, "format", "'{value}' once"),
        ("N", {**HEADER, "injection": "header", "header": None}, "format", "header must be"),
        ("N", {**SECRET, "header": "Authorization"}, "injection", "for injection 'header'"),
        ("N", {**SECRET, "env": "1X"}, "env", "env must be"),
    ],
)
async def test_negative_a_bad_secret_is_422_naming_the_field_and_nothing_is_stored(
    tmp_path: Path, name: str, body: dict[str, Any], field: str, message: str
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        answer = await h.client.put(f"/v1/secrets/{name}", json=body, headers=key)
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert message in error["message"] and error["details"]["field"] == field
        assert str(body["value"]) not in answer.text or not body["value"]
        assert (await h.client.get("/v1/secrets", headers=key)).json() == {"secrets": []}


WRONG_SHAPES = [{"value": 5, "hosts": ["a.org"]}, {"hosts": ["a.org"]}, {**SECRET, "extra": 1},
                {**SECRET, "injection": "cookie"}]  # fmt: skip


@pytest.mark.parametrize("body", WRONG_SHAPES)
async def test_negative_a_body_of_the_wrong_shape_is_422(
    tmp_path: Path, body: dict[str, Any]
) -> None:
    async with control_app(tmp_path) as h:
        answer = await h.client.put("/v1/secrets/N", json=body, headers=h.key("acme"))
        assert answer.status_code == 422 and VALUE not in answer.text


@pytest.mark.parametrize(
    ("secrets", "env", "message"),
    [
        (["MISSING"], {}, "no secret 'MISSING'"),
        (["OPENAI", "OPENAI"], {}, "given twice"),
        (["OPENAI"], {"OPENAI_API_KEY": "x"}, "sets OPENAI_API_KEY, which is set already"),
        (["OPENAI", "CLASH"], {}, "sets OPENAI_API_KEY, which is set already"),
        (["bad-name"], {}, "secrets.0"),
    ],
)
async def test_negative_a_create_naming_bad_secrets_is_422_before_any_node_call(
    tmp_path: Path, secrets: list[str], env: dict[str, str], message: str
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        await _put(h, key, "OPENAI", SECRET)
        await _put(h, key, "CLASH", {**SECRET, "env": "OPENAI_API_KEY"})
        body = {"secrets": secrets, "env": env}
        answer = await h.client.post("/v1/sandboxes", json=body, headers=key)
        assert answer.status_code == 422, answer.text
        assert message in answer.json()["error"]["message"]
        assert h.node.calls == []


async def test_negative_another_tenants_secret_is_404_and_cannot_be_bound(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        acme, evil = h.key("acme"), h.key("evil")
        await _put(h, acme, "OPENAI", SECRET)
        got = await h.client.get("/v1/secrets/OPENAI", headers=evil)
        assert got.status_code == 404 and got.json()["error"]["code"] == "not_found"
        assert (await h.client.get("/v1/secrets", headers=evil)).json() == {"secrets": []}
        assert (await h.client.delete("/v1/secrets/OPENAI", headers=evil)).status_code == 204
        assert (await h.client.get("/v1/secrets/OPENAI", headers=acme)).status_code == 200
        bind = await h.client.post("/v1/sandboxes", json={"secrets": ["OPENAI"]}, headers=evil)
        assert bind.status_code == 422 and "no secret 'OPENAI'" in bind.text
        # evil's own secret of that name is a different row, sealed for evil.
        await _put(h, evil, "OPENAI", {**SECRET, "value": NEW_VALUE})
        assert (await h.client.get("/v1/secrets/OPENAI", headers=acme)).status_code == 200
        sid = (await _create(h, acme, secrets=["OPENAI"]))["id"]
        assert _grant(h.node, sid)["OPENAI"].value == VALUE


async def test_negative_the_value_is_in_no_answer_no_log_line_and_not_in_the_database(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    recording = Recording()
    async with control_app(tmp_path) as h:
        h.client.event_hooks["response"].append(recording)
        key = h.key("acme")
        await _put(h, key, "OPENAI", SECRET)
        await _put(h, key, "API", HEADER)
        await h.client.get("/v1/secrets", headers=key)
        await h.client.get("/v1/secrets/OPENAI", headers=key)
        sandbox = await _create(h, key, secrets=["OPENAI", "API"])
        await h.client.get(f"/v1/sandboxes/{sandbox['id']}", headers=key)
        await h.client.get("/v1/sandboxes", headers=key)
        await h.client.post(f"/v1/sandboxes/{sandbox['id']}/fork", headers=key)
        await _put(h, key, "OPENAI", {**SECRET, "value": NEW_VALUE})
        await h.client.put("/v1/secrets/OPENAI", json={**SECRET, "hosts": ["*"]}, headers=key)
        await h.client.put("/v1/secrets/BAD", json={**HEADER, "header": "Host"}, headers=key)
        h.node.fail_next = Unavailable("down")
        await h.client.put("/v1/secrets/API", json=HEADER, headers=key)
        await h.client.delete("/v1/secrets/OPENAI", headers=key)
        await reap(h.app.state.ctx)
        assert _grant(h.node, sandbox["id"])["API"].value == VALUE  # it was sent
    assert len(recording.bodies) >= 13
    for secret in (VALUE, NEW_VALUE):
        assert all(secret.encode() not in body for body in recording.bodies)
        assert secret not in caplog.text
        assert all(secret not in str(record.args) for record in caplog.records)
        assert secret.encode() not in _database_bytes(h.settings.database_url)


def _database_bytes(url: str) -> bytes:
    """What the database holds: SQLite's files (WAL included) as stored; every value of
    every row of PostgreSQL's tables (bytes as they are, the rest as text)."""
    if url.startswith("sqlite:///"):
        files = sorted(Path(url.removeprefix("sqlite:///")).parent.glob("space.db*"))
        assert files
        return b"".join(path.read_bytes() for path in files)
    db = Database(url)
    try:
        with db.engine.connect() as connection:
            values = [
                value
                for table in inspect(connection).get_table_names()
                for row in connection.execute(text(f'SELECT * FROM "{table}"'))
                for value in row
            ]
    finally:
        db.dispose()
    assert values
    return b"".join(v if isinstance(v, bytes) else str(v).encode() for v in values)


@pytest.mark.parametrize(
    "hosts",
    [
        ["*.example.com"],
        ["a.*.example.com"],
        ["api.example.co.uk"],
        ["*.me.github.io"],
        ["tls.allowed.test"],  # a suffix the list does not know: registrable below it
    ],
)
async def test_a_secret_bound_within_one_registrable_domain_is_accepted(
    tmp_path: Path, hosts: list[str]
) -> None:
    async with control_app(tmp_path) as h:
        put = await _put(h, h.key("acme"), "N", {**SECRET, "hosts": hosts})
        assert put["hosts"] == hosts
