"""``space control`` (the control plane alone) and ``--database`` (issue 19)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from space.cli import main
from space.control import ControlSettings, create_key
from tests.ports import free_port
from tests.postgres import PostgresCluster

_REPO = Path(__file__).resolve().parents[2]
_START_TIMEOUT_S = 60.0


@contextlib.contextmanager
def _space_control(data_dir: Path, database_url: str, port: int) -> Iterator[str]:
    """``space control`` in a process of its own; stopped (SIGTERM, then SIGKILL) after."""
    log = data_dir.parent / "control.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "space.cli", "control", "--data-dir", str(data_dir),
             "--listen", f"127.0.0.1:{port}"],
            cwd=_REPO, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "SPACE_DATABASE_URL": database_url},
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_serving(url, process, log)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
    assert process.returncode == 0, log.read_text()


def _wait_serving(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"space control exited {process.returncode}:\n{log.read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/v1/sandboxes", timeout=2).status_code == 401:
                return
        time.sleep(0.1)
    pytest.fail(f"space control did not serve within {_START_TIMEOUT_S} s:\n{log.read_text()}")


def test_space_control_serves_the_api_on_postgresql_without_a_node(
    tmp_path: Path, postgres: PostgresCluster
) -> None:
    with postgres.database() as database_url:
        key = create_key(ControlSettings(data_dir=tmp_path, database_url=database_url), "acme")
        with _space_control(tmp_path / "control", database_url, free_port()) as url:
            headers = {"Authorization": f"Bearer {key}"}
            listed = httpx.get(url + "/v1/sandboxes", headers=headers, timeout=10)
            assert listed.status_code == 200 and listed.json() == {"sandboxes": []}
            quota = httpx.get(url + "/v1/quota", headers=headers, timeout=10)
            assert quota.status_code == 200
            templates = httpx.get(url + "/v1/templates", headers=headers, timeout=10)
            assert templates.status_code == 200 and templates.json() == {"templates": []}
            token = (tmp_path / "control" / "node-token").read_text().strip()
            nodes = httpx.get(url + "/v1/nodes", headers={"Authorization": f"Bearer {token}"})
            assert nodes.status_code == 200 and nodes.json() == {"nodes": []}
            created = httpx.post(url + "/v1/sandboxes", json={}, headers=headers, timeout=10)
            assert created.status_code == 503
            assert created.json()["error"]["code"] == "unavailable"
            assert "no node" in created.json()["error"]["message"]


def test_space_keys_create_writes_to_the_database_it_is_given(
    tmp_path: Path, database_url: str
) -> None:
    result = CliRunner().invoke(
        main, ["keys", "create", "--tenant", "acme", "--data-dir", str(tmp_path / "d"),
               "--database", database_url],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    from space.control import list_keys

    settings = ControlSettings(data_dir=tmp_path / "other", database_url=database_url)
    assert [info.tenant for info in list_keys(settings)] == ["acme"]


@pytest.mark.parametrize("command", ["control", "serve"])
def test_negative_a_database_url_of_another_scheme_exits_2_naming_the_accepted_ones(
    tmp_path: Path, command: str
) -> None:
    result = CliRunner().invoke(
        main, [command, "--data-dir", str(tmp_path), "--database", "mysql://u@h/db"]
    )
    assert result.exit_code == 2
    assert "unsupported database URL (scheme 'mysql')" in result.stderr
    assert "sqlite:///" in result.stderr and "postgresql://" in result.stderr


def test_negative_an_unreachable_database_is_one_clear_line_without_the_password(
    tmp_path: Path,
) -> None:
    url = f"postgresql://space:hunter2@127.0.0.1:{free_port()}/space"
    result = CliRunner().invoke(main, ["control", "--data-dir", str(tmp_path), "--database", url])
    assert result.exit_code == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: unavailable: database ") and "refused" in line
    assert "hunter2" not in result.output + result.stderr


def test_negative_without_postgresql_installed_the_fixture_fails_saying_to_run_setup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests import postgres as fixture

    monkeypatch.setattr(fixture, "_ROOT", tmp_path)  # no <version>/bin/initdb here
    with pytest.raises(pytest.fail.Exception, match=r"run scripts/setup\.sh"):
        fixture.postgres_bin()
