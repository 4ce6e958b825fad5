"""Assume the egress gateway is compromised (it parses every hostile byte guests send
out): what does it hold? (issue 18)

A real gateway is started the way a node starts it, its directory ``egress`` inside a
data dir (0700, root's) that also holds a master key, a node token, a node key, a
database and a pool directory, and a real sandbox namespace attached. Then:

- its /proc status shows a uid and gid not root's, no supplementary groups, every
  capability set empty and ``no_new_privs``;
- a probe with its exact uid and gid, started in its working directory, can open its
  own files but none of the data dir's, nor the sandboxes' CA keys;
- it serves the namespace through listeners the node bound there (it cannot enter a
  namespace itself), and a gateway that died is started again and handed new ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from space.node.network import ca, netns
from space.node.network.gateway_client import GatewayProcess, running_gateways
from space.node.network.netns import GATEWAY_ADDRESS, PROXY_PORT
from space.node.privileged import RootBroker
from tests.root_broker import netns_name_of, root_broker
from tests.security.access_probe import errnos_as

#: What a node's data dir holds beside ``egress`` (space.node.core.data_dir).
SECRET_FILES = ("master.key", "node-token", "node.key", "space.db")
POLICY = {"allow": [{"domain": "example.com", "ports": [443]}]}


# Try to open (list) every path named on stdin (relative ones from the working directory);
# print {path: errno or 0 when it worked}.
@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    """A node's data dir as the server leaves it; no gateway of it outlives the test."""
    directory = tmp_path / "data"
    directory.mkdir(mode=0o700)
    for name in SECRET_FILES:
        (directory / name).write_bytes(b"secret")
        (directory / name).chmod(0o600)
    (directory / "pool").mkdir(mode=0o700)
    yield directory
    for pid in running_gateways(directory / "egress"):
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"a gateway was left running: pid {pid}")


@pytest.fixture
def broker(data_dir: Path) -> Iterator[RootBroker]:
    with root_broker(data_dir) as started:
        yield started


@pytest.fixture
def namespace(broker: RootBroker) -> Iterator[Path]:
    """A sandbox's namespace (its tap holding the gateway's address), deleted after."""
    name = netns_name_of(broker)
    asyncio.run(netns.create(broker.scope.run_root, name))
    try:
        yield netns.netns_path(name)
    finally:
        asyncio.run(netns.delete(broker.scope.run_root, name))


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def _listeners_in(namespace: Path) -> set[tuple[str, str, int]]:
    """(protocol, local address, pid) of every socket listening inside ``namespace``."""
    done = subprocess.run(
        ["ip", "netns", "exec", namespace.name, "ss", "-Hlntup"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    found = set()
    for line in done.stdout.splitlines():
        fields = line.split()
        pid = int(fields[-1].split("pid=")[1].split(",")[0])
        found.add((fields[0], fields[4], pid))
    return found


def _served_by(pid: int) -> set[tuple[str, str, int]]:
    return {("tcp", f"{GATEWAY_ADDRESS}:{PROXY_PORT}", pid), ("udp", f"{GATEWAY_ADDRESS}:53", pid)}


@contextlib.asynccontextmanager
async def _serving(
    egress: Path, namespace: Path, sandbox_ca: Path, broker: RootBroker
) -> AsyncIterator[GatewayProcess]:
    """A gateway of ``egress`` started and serving sandbox sb-1 in ``namespace``."""
    gateway = await GatewayProcess.start(egress, ["127.0.0.1:53"], None, broker=broker)
    try:
        await gateway.attach("sb-1", namespace, POLICY, sandbox_ca)
        yield gateway
    finally:
        await gateway.detach("sb-1")
        await gateway.close()


def test_the_gateway_runs_with_no_privilege_and_reads_nothing_of_the_data_dir(
    data_dir: Path, namespace: Path, broker: RootBroker
) -> None:
    egress = data_dir / "egress"
    sandbox_ca = ca.ensure_ca(egress / "ca", "sb-1")

    async def scenario() -> None:
        async with _serving(egress, namespace, sandbox_ca, broker) as gateway:
            assert gateway.pid is not None
            _check_unprivileged(gateway.pid)
            assert os.readlink(f"/proc/{gateway.pid}/cwd") == str(egress)
            _check_files(gateway.pid, data_dir, sandbox_ca)
            assert _listeners_in(namespace) == _served_by(gateway.pid)

    asyncio.run(scenario())


def _check_unprivileged(pid: int) -> None:
    status = _status(pid)
    assert all(int(uid) != 0 for uid in status["Uid"].split())
    assert all(int(gid) != 0 for gid in status["Gid"].split())
    assert status["Groups"] == ""
    for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[caps], 16) == 0, caps
    assert status["NoNewPrivs"] == "1"


def _check_files(pid: int, data_dir: Path, sandbox_ca: Path) -> None:
    status = _status(pid)
    uid, gid = int(status["Uid"].split()[0]), int(status["Gid"].split()[0])
    egress = data_dir / "egress"
    forbidden = [str(data_dir / name) for name in SECRET_FILES]
    forbidden += [f"../{name}" for name in SECRET_FILES]
    forbidden += [str(data_dir / "pool"), "../pool", str(data_dir), "..", str(sandbox_ca)]
    forbidden += [f"ca/{sandbox_ca.name}", "gateway.log"]
    own = ["audit", "mitm", "."]
    found = errnos_as(uid, gid, forbidden + own, cwd=egress)
    assert {path: found[path] for path in forbidden} == dict.fromkeys(forbidden, 13)  # EACCES
    assert {path: found[path] for path in own} == dict.fromkeys(own, 0)
    assert (egress / "control.sock").stat().st_mode & 0o777 == 0o660  # the agent's group


def test_a_gateway_that_died_is_started_again_with_new_listeners(
    data_dir: Path, namespace: Path, broker: RootBroker
) -> None:
    egress = data_dir / "egress"
    sandbox_ca = ca.ensure_ca(egress / "ca", "sb-1")

    async def scenario() -> None:
        async with _serving(egress, namespace, sandbox_ca, broker) as gateway:
            await gateway.attach("sb-1", namespace, POLICY, sandbox_ca)  # idempotent
            first = gateway.pid
            assert first is not None
            os.kill(first, signal.SIGKILL)
            await gateway.retain()  # restarts it: the node tells it everything again
            assert gateway.pid is not None and gateway.pid != first
            assert _listeners_in(namespace) == _served_by(gateway.pid)

    asyncio.run(scenario())
