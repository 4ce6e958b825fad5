"""Database, keys, placement, the reaper and reconciliation of the control plane."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, select

from space.control import ControlSettings, NodeRegistry, create_key, list_keys, revoke_key
from space.control.errors import STATUS_BY_CODE, ApiError
from space.control.keys import KEY_PREFIX, hash_key
from space.control.reconcile import reap_expired
from space.control.store import Database
from space.control.store.db import alembic_config
from space.control.store.models import ApiKeyRow, Base, TenantRow
from space.node.api import SandboxSpec
from tests.ports import free_port
from tests.unit.fakes import FakeClock, FakeNode, control_app, wait_for

# DB-level: each test runs on SQLite and on PostgreSQL (issue 19).
pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("on_both_databases")]


@pytest.mark.empty_database
def test_migrations_produce_exactly_the_models_schema(
    tmp_path: Path, on_both_databases: str
) -> None:
    db = Database(on_both_databases)
    try:
        db.upgrade()
        with db.engine.connect() as connection:
            diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
            tables = set(inspect(connection).get_table_names())
        assert diff == []
        assert {"tenants", "api_keys", "nodes", "sandboxes", "alembic_version"} <= tables
    finally:
        db.dispose()


@pytest.mark.empty_database
def test_migrations_are_idempotent(tmp_path: Path, on_both_databases: str) -> None:
    db = Database(on_both_databases)
    try:
        db.upgrade()
        db.upgrade()
        with db.engine.connect() as connection:
            assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
    finally:
        db.dispose()


def test_a_key_is_shown_once_and_only_its_hash_is_stored(
    tmp_path: Path, on_both_databases: str
) -> None:
    settings = ControlSettings(data_dir=tmp_path, database_url=on_both_databases)
    key = create_key(settings, "acme")
    assert key.startswith(KEY_PREFIX) and len(key) >= len(KEY_PREFIX) + 43
    db = Database(settings.database_url)
    try:
        rows = db.call(lambda s: list(s.scalars(select(ApiKeyRow))))
    finally:
        db.dispose()
    assert [row.key_hash for row in rows] == [hash_key(key)]
    assert all(key not in (row.prefix, row.key_hash) for row in rows)
    if on_both_databases.startswith("sqlite"):
        stored = Path(on_both_databases.removeprefix("sqlite:///")).read_bytes()
        assert key.encode() not in stored


def test_keys_are_listed_per_tenant_and_revoked_idempotently(
    tmp_path: Path, on_both_databases: str
) -> None:
    settings = ControlSettings(data_dir=tmp_path, database_url=on_both_databases)
    create_key(settings, "acme")
    create_key(settings, "beta")
    (acme,) = list_keys(settings, "acme")
    assert acme.tenant == "acme" and acme.revoked_at is None
    revoke_key(settings, acme.id)
    revoke_key(settings, acme.id)
    assert list_keys(settings, "acme")[0].revoked_at is not None
    assert list_keys(settings, "beta")[0].revoked_at is None


def test_negative_bad_tenant_names_and_unknown_key_ids_are_refused(
    tmp_path: Path, on_both_databases: str
) -> None:
    settings = ControlSettings(data_dir=tmp_path, database_url=on_both_databases)
    with pytest.raises(ApiError) as bad:
        create_key(settings, "no spaces please")
    assert bad.value.code == "invalid_argument"
    with pytest.raises(ApiError) as missing:
        revoke_key(settings, "key_missing")
    assert missing.value.code == "not_found"
    assert list_keys(settings) == []


def test_the_error_table_matches_the_documented_statuses() -> None:
    assert STATUS_BY_CODE == {
        "unauthenticated": 401,
        "permission_denied": 403,
        "not_found": 404,
        "conflict": 409,
        "invalid_argument": 422,
        "resource_exhausted": 429,
        "internal": 500,
        "connection_refused": 502,
        "capacity": 503,
        "unavailable": 503,
        "timeout": 504,
    }
    doc = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    for code, status in STATUS_BY_CODE.items():
        assert f"| {status} | `{code}` |" in doc


async def test_new_sandboxes_spread_over_nodes(tmp_path: Path) -> None:
    first, second = FakeNode("n1"), FakeNode("n2")
    registry = NodeRegistry()
    registry.register("n1", first)
    registry.register("n2", second)
    async with control_app(tmp_path, first, registry=registry) as h:
        headers = h.key("acme")
        for _ in range(4):
            assert (await h.client.post("/v1/sandboxes", json={}, headers=headers)).is_success
        assert len(first.boxes) == 2 and len(second.boxes) == 2


async def test_the_node_token_file_is_made_private_on_first_start(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        token_file = h.settings.token_file
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
    async with control_app(tmp_path):
        assert token_file.read_text().strip() == token


async def test_the_reaper_deletes_sandboxes_once_the_clock_passes_their_timeout(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    async with control_app(tmp_path, clock=clock) as h:
        headers = h.key("acme")
        short = (
            await h.client.post("/v1/sandboxes", json={"timeout_s": 60}, headers=headers)
        ).json()
        forever = (
            await h.client.post("/v1/sandboxes", json={"timeout_s": None}, headers=headers)
        ).json()
        clock.now += 59
        assert await reap_expired(h.app.state.ctx) == []
        assert short["id"] in h.node.boxes
        clock.now += 1
        assert await reap_expired(h.app.state.ctx) == [short["id"]]
        assert short["id"] not in h.node.boxes
        gone = await h.client.get(f"/v1/sandboxes/{short['id']}", headers=headers)
        assert gone.status_code == 404
        assert forever["id"] in h.node.boxes


async def test_the_reaper_loop_runs_rounds_until_cancelled(tmp_path: Path) -> None:
    clock = FakeClock()
    async with control_app(tmp_path, clock=clock, reaper_interval_s=0.01) as h:
        headers = h.key("acme")
        body = {"timeout_s": 60}
        short = (await h.client.post("/v1/sandboxes", json=body, headers=headers)).json()
        clock.now += 60
        await wait_for(lambda: short["id"] not in h.node.boxes)


@pytest.mark.empty_database
def test_migrations_downgrade_to_the_initial_schema_and_back(
    tmp_path: Path, on_both_databases: str
) -> None:
    db = Database(on_both_databases)
    try:
        db.upgrade()
        config = alembic_config()
        with db.engine.begin() as connection:
            config.attributes["connection"] = connection
            command.downgrade(config, "0001")
        with db.engine.connect() as connection:
            assert "snapshots" not in inspect(connection).get_table_names()
            columns = {c["name"] for c in inspect(connection).get_columns("sandboxes")}
            assert "idle_timeout_s" not in columns
        db.upgrade()
        with db.engine.connect() as connection:
            assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
    finally:
        db.dispose()


async def test_startup_reconciles_the_database_with_the_node(tmp_path: Path) -> None:
    node = FakeNode()
    async with control_app(tmp_path, node) as h:
        headers = h.key("acme")
        lost = (await h.client.post("/v1/sandboxes", json={}, headers=headers)).json()["id"]
        kept = (await h.client.post("/v1/sandboxes", json={}, headers=headers)).json()["id"]
    # While the control plane is down, the node loses one sandbox and gains a stray one.
    del node.boxes[lost]
    await node.create_sandbox(SandboxSpec(sandbox_id="sb-stray"))
    async with control_app(tmp_path, node) as h:
        assert "sb-stray" not in node.boxes
        assert kept in node.boxes
        row = (await h.client.get(f"/v1/sandboxes/{lost}", headers=headers)).json()
        assert row["state"] == "error"
        assert (await h.client.get(f"/v1/sandboxes/{kept}", headers=headers)).json()[
            "state"
        ] == "running"


def test_negative_a_write_a_constraint_refuses_is_our_conflict_not_the_drivers(
    on_both_databases: str,
) -> None:
    db = Database(on_both_databases)
    try:
        db.upgrade()
        db.call(lambda s: s.add(TenantRow(id="acme", created_at=1.0)))
        with pytest.raises(ApiError) as refused:
            db.call(lambda s: s.add(TenantRow(id="acme", created_at=2.0)))
        assert refused.value.code == "conflict" and "INSERT" not in refused.value.message
        kept = db.call(lambda s: s.get(TenantRow, "acme"))
        assert kept is not None and kept.created_at == 1.0
    finally:
        db.dispose()


@pytest.mark.parametrize(
    "url", ["mysql://u@h/db", "postgres-ish://x", "not a url", "oracle+cx://u:pw@h/db"]
)
def test_negative_a_database_url_of_another_scheme_is_invalid_argument(url: str) -> None:
    with pytest.raises(ApiError) as refused:
        Database(url)
    assert refused.value.code == "invalid_argument"
    assert "sqlite:///" in refused.value.message and "pw" not in refused.value.message


async def test_negative_an_unreachable_database_is_unavailable_without_its_password() -> None:
    db = Database(f"postgresql://space:hunter2@127.0.0.1:{free_port()}/space")
    try:
        with pytest.raises(ApiError) as down:
            await db.run(lambda s: s.get(TenantRow, "acme"))
        assert down.value.code == "unavailable" and "hunter2" not in down.value.message
        with pytest.raises(ApiError, match="unavailable"):
            db.upgrade()
    finally:
        db.dispose()
