"""A program with only the SDK installed (no server extra) drives a real platform:
create, exec, files, kill (issue 16). The platform runs from the full install."""

from __future__ import annotations

import json
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..sdk_alone import make_sdk_venv
from .platform import Platform, running_platform

pytestmark = pytest.mark.vm

_SESSION = textwrap.dedent("""\
    import json, sys
    from space import Sandbox
    sbx = Sandbox.create(memory_mib=256)
    result = sbx.commands.run("echo hello from $(hostname)")
    sbx.files.write("/home/user/note.txt", "written by the SDK alone")
    note = sbx.files.read("/home/user/note.txt")
    killed = sbx.kill()
    servers = sorted(m for m in sys.modules if m.startswith(("fastapi", "space.node")))
    print(json.dumps({"id": sbx.sandbox_id, "out": result.stdout, "code": result.exit_code,
                      "note": note, "killed": killed, "servers": servers}))
    """)


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("space-sdk-alone")) as p:
        yield p


def test_an_sdk_only_install_creates_runs_writes_and_kills_a_sandbox(
    platform: Platform, tmp_path: Path
) -> None:
    sdk = make_sdk_venv(tmp_path)
    key = platform.create_key("sdk-alone")
    out = subprocess.run(
        [sdk / "bin" / "python", "-c", _SESSION],
        env={"SPACE_API_URL": platform.url, "SPACE_API_KEY": key, "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    session = json.loads(out.stdout)
    assert session["out"] == f"hello from {session['id']}\n" and session["code"] == 0
    assert session["note"] == "written by the SDK alone"
    assert session["killed"] is True and session["servers"] == []
