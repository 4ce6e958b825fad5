"""Quotas as the operator and the SDK see them (issue 17): ``space quota set/show`` on the
data dir, the ``tenant_quotas`` migration on an existing database, concurrent creates
at the boundary, and a 429's details on the SDK's ResourceExhausted."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from alembic import command
from click.testing import CliRunner
from sqlalchemy import inspect, text

from space.cli import main
from space.control import ControlSettings, create_key
from space.control.errors import ApiError
from space.control.quota_admin import set_quotas, show_quotas
from space.control.quotas import QuotaLimits
from space.control.store import Database
from space.control.store.db import alembic_config
from space.sdk import AsyncSandbox, ResourceExhausted
from tests.unit._live_api import LiveApi
from tests.unit.fakes import control_app

pytestmark = pytest.mark.anyio


def _space(data_dir: Path, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [*args, "--data-dir", str(data_dir)])
    return result.exit_code, result.stdout, result.stderr


def _table(out: str) -> dict[str, list[str]]:
    """``space quota`` output: quota name → its other columns."""
    rows = [line.split() for line in out.splitlines()]
    assert rows[0] == ["QUOTA", "LIMIT", "SET", "USED", "UNIT"]
    return {row[0]: row[1:] for row in rows[1:]}


def test_quota_set_gives_a_tenant_its_own_limits_and_show_lists_every_quota(
    tmp_path: Path,
) -> None:
    create_key(ControlSettings(data_dir=tmp_path), "acme")
    code, out, _ = _space(tmp_path, "quota", "set", "--tenant", "acme", "--vcpus", "12")
    assert code == 0 and _table(out)["vcpus"] == ["12", "own", "0", "vCPUs"]
    code, out, _ = _space(tmp_path, "quota", "show", "--tenant", "acme")
    table = _table(out)
    assert code == 0 and table["vcpus"] == ["12", "own", "0", "vCPUs"]
    default = str(QuotaLimits().running_sandboxes)
    assert table["running_sandboxes"] == [default, "default", "0", "sandboxes"]
    # The database does not know templates and builds in use: GET /v1/quota does.
    assert table["builds"][2] == "-" and table["templates"][2] == "-"


def test_quota_set_default_and_reset_put_limits_back_to_the_defaults(tmp_path: Path) -> None:
    create_key(ControlSettings(data_dir=tmp_path), "acme")
    args = ("quota", "set", "--tenant", "acme")
    _space(tmp_path, *args, "--vcpus", "12", "--snapshots", "3", "--builds", "0")
    code, out, _ = _space(tmp_path, *args, "--vcpus", "default")
    table = _table(out)
    assert code == 0 and table["vcpus"][:2] == [str(QuotaLimits().vcpus), "default"]
    assert table["snapshots"][:2] == ["3", "own"] and table["builds"][:2] == ["0", "own"]
    code, out, _ = _space(tmp_path, *args, "--reset", "--builds", "1")
    table = _table(out)
    assert table["snapshots"][:2] == [str(QuotaLimits().snapshots), "default"]
    assert table["builds"][:2] == ["1", "own"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--tenant", "nobody", "--vcpus", "1"), "error: not_found: no tenant 'nobody'"),
        (("--tenant", "acme"), "error: nothing to set"),
        (("--tenant", "acme", "--vcpus", "-1"), "-1 is negative"),
        (("--tenant", "acme", "--vcpus", "many"), "'many' is neither a whole number"),
    ],
)
def test_negative_quota_set_refuses_unknown_tenants_and_bad_values_changing_nothing(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    settings = ControlSettings(data_dir=tmp_path)
    create_key(settings, "acme")
    before = show_quotas(settings, "acme")
    code, _, err = _space(tmp_path, "quota", "set", *args)
    assert code != 0 and message in err
    assert show_quotas(settings, "acme") == before


def test_negative_an_unknown_quota_name_is_refused(tmp_path: Path) -> None:
    settings = ControlSettings(data_dir=tmp_path)
    create_key(settings, "acme")
    with pytest.raises(ApiError, match="no quota 'gpus'"):
        set_quotas(settings, "acme", {"gpus": 1})


def test_the_quotas_migration_upgrades_an_existing_database_keeping_its_rows(
    tmp_path: Path,
) -> None:
    db = Database(f"sqlite:///{tmp_path / 'space.db'}")
    try:
        config = alembic_config()
        with db.engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, "0004")
        with db.engine.begin() as connection:
            connection.execute(text("INSERT INTO tenants (id, created_at) VALUES ('acme', 1.0)"))
            assert "tenant_quotas" not in inspect(connection).get_table_names()
        db.upgrade()
        with db.engine.connect() as connection:
            assert "tenant_quotas" in inspect(connection).get_table_names()
            assert connection.execute(text("SELECT id FROM tenants")).scalars().all() == ["acme"]
    finally:
        db.dispose()
    lines = set_quotas(ControlSettings(data_dir=tmp_path), "acme", {"disk_mib": 3 << 30})
    assert [line.limit for line in lines if line.quota.name == "disk_mib"] == [3 << 30]


async def test_concurrent_creates_at_the_boundary_admit_exactly_the_limit(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        set_quotas(h.settings, "acme", {"running_sandboxes": 3})
        answers = await asyncio.gather(
            *(h.client.post("/v1/sandboxes", json={}, headers=key) for _ in range(8))
        )
        codes = sorted(answer.status_code for answer in answers)
        assert codes == [201] * 3 + [429] * 5
        listed = (await h.client.get("/v1/sandboxes", headers=key)).json()["sandboxes"]
        assert len(listed) == 3 and len(h.node.boxes) == 3


async def test_the_sdk_raises_resource_exhausted_naming_the_quota_limit_and_use(
    tmp_path: Path,
) -> None:
    api = LiveApi(tmp_path)
    set_quotas(api.settings, "acme", {"memory_mib": 512})
    async with api.running():
        sandbox = await AsyncSandbox.create(memory_mib=384, **api.connection())
        with pytest.raises(ResourceExhausted) as refused:
            await AsyncSandbox.create(memory_mib=256, **api.connection())
        error = refused.value
        assert (error.quota, error.limit, error.used, error.requested) == (
            "memory_mib", 512, 384, 256,
        )  # fmt: skip
        assert error.status_code == 429
        assert "quota memory_mib: 384 of 512 MiB in use, this create needs 256" in str(error)
        await sandbox.kill()
