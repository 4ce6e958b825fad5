"""Nothing leaks by inheritance (issue 18): every child the node starts gets
child_environment(), never the server's own, so SPACE_MASTER_KEY stays in the server."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from space.node.core.environment import CHILD_PATH, child_environment
from space.node.core.run import run
from space.node.images._command import run_command
from space.node.network.gateway_client import GatewayProcess
from space.node.templates.packages import _AptRoot
from tests.root_broker import gateway_broker

SECRET = "master-key-that-must-stay-in-the-server"


@pytest.fixture
def secret_in_environ(monkeypatch: pytest.MonkeyPatch) -> str:
    """SPACE_MASTER_KEY (and an operator's own variable) set in this process's environ."""
    monkeypatch.setenv("SPACE_MASTER_KEY", SECRET)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    return SECRET


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if item)
    return {key.decode(): value.decode() for key, value in pairs}


def test_a_child_environment_is_path_and_lang_only(secret_in_environ: str) -> None:
    assert child_environment() == {"PATH": CHILD_PATH, "LANG": "C.UTF-8"}
    assert secret_in_environ not in child_environment().values()


def test_extras_are_added_and_win_over_the_defaults() -> None:
    env = child_environment(LANG="C", APT_CONFIG="/x")
    assert env == {"PATH": CHILD_PATH, "LANG": "C", "APT_CONFIG": "/x"}
    env["MORE"] = "1"  # a fresh dict each call: changing one changes no other
    assert "MORE" not in child_environment()


def test_a_host_command_runs_with_the_child_environment_only(secret_in_environ: str) -> None:
    out = asyncio.run(run("env", "-0"))
    seen = dict(item.split("=", 1) for item in out.split("\0") if item)
    assert seen == child_environment()


def test_an_image_build_command_runs_with_the_child_environment_only(
    secret_in_environ: str,
) -> None:
    out = run_command(["env"], timeout_s=10, env={"LC_ALL": "C"})
    seen = dict(line.split("=", 1) for line in out.splitlines())
    assert seen == child_environment(LC_ALL="C")


def test_apt_runs_with_its_own_config_and_nothing_of_the_server(
    tmp_path: Path, secret_in_environ: str
) -> None:
    env = _AptRoot(tmp_path, "amd64").environment()
    assert SECRET not in env.values()
    assert set(env) == {"PATH", "LANG", "APT_CONFIG", "LC_ALL", "DEBIAN_FRONTEND"}


def test_the_egress_gateway_starts_without_the_servers_environment(
    egress_dir: Path, secret_in_environ: str
) -> None:
    async def scenario() -> None:
        gateway = await GatewayProcess.start(
            egress_dir, ["127.0.0.1:53"], None, broker=gateway_broker(egress_dir)
        )
        try:
            assert gateway.pid is not None  # it answered: it imports with a minimal env
            env = _environ_of(gateway.pid)
            assert SECRET not in env.values()
            assert set(env) == {"PATH", "LANG", "PYTHONPATH", "PYTHONUNBUFFERED"}
        finally:
            await gateway.close()

    asyncio.run(scenario())


def test_the_gateway_control_socket_is_its_owners_and_the_node_agents_only(
    egress_dir: Path,
) -> None:
    async def scenario() -> None:
        gateway = await GatewayProcess.start(
            egress_dir, ["127.0.0.1:53"], None, broker=gateway_broker(egress_dir)
        )
        try:
            sock, directory = os.stat(egress_dir / "control.sock"), os.stat(egress_dir)
            assert (sock.st_mode & 0o777, sock.st_gid) == (0o660, os.getegid())
            # The agent's group, set-group-id: what the gateway makes stays in it.
            assert (directory.st_mode & 0o7777, directory.st_gid) == (0o2770, os.getegid())
        finally:
            await gateway.close()

    asyncio.run(scenario())
