"""The SDK installs on its own: the base package, without the ``server`` extra, in a
fresh virtual environment (tests/sdk_alone.py), brings no server code and no server
dependency. tests/integration/test_sdk_alone_session.py drives a real platform with it.
"""

from __future__ import annotations

import subprocess
import textwrap
import tomllib
from pathlib import Path

import pytest

from tests.sdk_alone import ROOT, make_sdk_venv

#: What an SDK-only install must not contain, imported or installed.
SERVER_ONLY = ("fastapi", "sqlalchemy", "mitmproxy", "uvicorn", "alembic", "pydantic", "qemu")

_CHECK = textwrap.dedent("""\
    import importlib.util, json, sys
    import space, space.sdk, space.cli, space.limits
    from space import Sandbox, AsyncSpace
    imported = sorted(m for m in sys.modules if m.split(".")[0] in {server_only!r})
    ours = sorted(m for m in sys.modules if m.startswith(("space.node", "space.control")))
    installed = sorted(n for n in {server_only!r} if importlib.util.find_spec(n))
    print(json.dumps({{"imported": imported, "ours": ours, "installed": installed}}))
    """)


@pytest.fixture(scope="module")
def sdk_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_sdk_venv(tmp_path_factory.mktemp("sdk-alone"))


def test_the_base_install_imports_the_sdk_and_cli_and_nothing_of_the_server(
    sdk_venv: Path,
) -> None:
    check = _CHECK.format(server_only=SERVER_ONLY)
    out = subprocess.run(
        [sdk_venv / "bin" / "python", "-c", check],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=sdk_venv,  # not the checkout: the installed package, not the source tree
    ).stdout
    assert out.strip() == '{"imported": [], "ours": [], "installed": []}'


def test_the_client_cli_runs_from_the_base_install(sdk_venv: Path) -> None:
    result = subprocess.run(
        [sdk_venv / "bin" / "space", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "exec" in result.stdout


def test_negative_server_commands_say_the_extra_is_missing(sdk_venv: Path) -> None:
    result = subprocess.run(
        [sdk_venv / "bin" / "space", "serve", "--data-dir", str(sdk_venv / "data")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "space[server]" in result.stderr


def test_the_base_install_declares_only_the_sdks_dependencies() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split("=")[0].split("<")[0] for dep in project["dependencies"]}
    assert names == {"httpx", "click"}
    assert "space[server]" in project["optional-dependencies"]["dev"]
