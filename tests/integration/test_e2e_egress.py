"""Egress and secrets end to end: SDK and CLI -> REST -> control plane -> node ->
gateway -> a server in a namespace the test made, and back.

The secret is stored through the API (encrypted by the control plane), bound to one
host; the guest holds only its placeholder, and the server sees the value.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from space import Sandbox
from space.sdk import Secrets, allow

from ..egress_world import UPSTREAM, World, egress_world
from .platform import SPACE, Platform, running_platform

pytestmark = pytest.mark.vm

VALUE = "ghp_" + "Q9x2" * 9
FETCH = (
    "import os, urllib.request as u\n"
    "r = u.Request('https://tls.allowed.test/echo',"
    " headers={'Authorization': 'Bearer ' + os.environ['API_TOKEN']})\n"
    "print(u.urlopen(r, timeout=10).read().decode())\n"
)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with egress_world() as world:
        world.records.update({"tls.allowed.test": [UPSTREAM], "other.test": [UPSTREAM]})
        yield world


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, world: World) -> Iterator[Platform]:
    options = ["--egress-resolver", world.resolver, "--egress-upstream-ca", str(world.upstream_ca)]
    with running_platform(tmp_path_factory.mktemp("space-e2e-egress"), options) as p:
        yield p


def test_a_stored_secret_reaches_its_host_while_the_guest_holds_a_placeholder(
    platform: Platform, world: World
) -> None:
    key = platform.create_key("tenant-egress")
    info = Secrets.set("API_TOKEN", VALUE, ["tls.allowed.test"], api_url=platform.url, api_key=key)
    assert VALUE not in repr(info)
    sandbox = Sandbox.create(
        api_url=platform.url,
        api_key=key,
        egress=allow("tls.allowed.test:443", "other.test:443"),
        secrets=["API_TOKEN"],
    )
    try:
        env = sandbox.commands.run("env").stdout
        assert "API_TOKEN=space_ph_" in env and VALUE not in env
        fetched = sandbox.commands.run(f'python3 -c "{FETCH}"')
        assert fetched.exit_code == 0, fetched.stderr
        assert "space_ph_" in fetched.stdout and VALUE not in fetched.stdout
        assert any(VALUE in hit.data.decode() for hit in world.hits_of("tls"))
        other = sandbox.commands.run(
            f'python3 -c "{FETCH.replace("tls.allowed.test", "other.test")}"'
        )
        assert other.exit_code == 0, other.stderr
        assert VALUE not in world.hits_of("tls")[-1].data.decode()
        log = subprocess.run(
            [*SPACE, "egress", "log", sandbox.sandbox_id, "--json"],
            env={"SPACE_API_URL": platform.url, "SPACE_API_KEY": key, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        assert "API_TOKEN" in log and VALUE not in log
        assert VALUE not in (platform.data_dir / "serve.log").read_text(errors="replace")
    finally:
        sandbox.kill()


def test_negative_without_a_policy_the_sandbox_has_no_network_dns_included(
    platform: Platform,
) -> None:
    key = platform.create_key("tenant-closed")
    sandbox = Sandbox.create(api_url=platform.url, api_key=key)
    try:
        result = sandbox.commands.run(
            "python3 -c \"import socket; socket.gethostbyname('tls.allowed.test')\""
        )
        assert result.exit_code != 0
        sandbox.network.set_policy(allow("tls.allowed.test:443"))
        result = sandbox.commands.run(
            "python3 -c \"import socket; print(socket.gethostbyname('tls.allowed.test'))\""
        )
        assert result.exit_code == 0 and result.stdout.startswith("198.18."), result
    finally:
        sandbox.kill()
