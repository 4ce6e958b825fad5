"""The gateway process outlives its node: a new node adopts one of its own version,
replaces one of another, and starts one where none answers. Real processes, no
namespaces (nothing is attached)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from space.node.api import InvalidArgument, PolicyBounds
from space.node.network.gateway_client import GatewayProcess, fingerprint
from tests.root_broker import gateway_broker

RESOLVERS = ["127.0.0.1:53"]


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


async def _start(directory: Path, resolvers: list[str] = RESOLVERS) -> GatewayProcess:
    return await GatewayProcess.start(directory, resolvers, None, broker=gateway_broker(directory))


def _crash(gateway: GatewayProcess) -> None:
    """What a node that died leaves: the gateway runs on, nobody talks to it."""
    gateway._disconnect()


def test_a_new_node_adopts_the_running_gateway_of_its_version(egress_dir: Path) -> None:
    async def scenario() -> None:
        first = await _start(egress_dir)
        _crash(first)
        second = await _start(egress_dir)
        assert second.pid == first.pid and _alive(second.pid)
        await second.retain()  # it answers requests
        await second.close()  # nothing attached: it ends
        assert not _alive(first.pid)
        assert not (egress_dir / "control.sock").exists()

    asyncio.run(scenario())


def test_a_gateway_of_another_version_is_replaced(egress_dir: Path) -> None:
    async def scenario() -> None:
        old = await _start(egress_dir, ["127.0.0.1:53"])
        _crash(old)
        new = await _start(egress_dir, ["127.0.0.2:53"])
        assert new.pid != old.pid and _alive(new.pid)
        assert not _alive(old.pid)
        await new.close()

    asyncio.run(scenario())


def test_a_stale_socket_without_a_gateway_is_replaced_by_a_new_one(egress_dir: Path) -> None:
    egress_dir.mkdir(parents=True)
    (egress_dir / "control.sock").write_text("left by a host that rebooted")

    async def scenario() -> None:
        gateway = await _start(egress_dir)
        assert _alive(gateway.pid)
        await gateway.close()

    asyncio.run(scenario())


def test_a_killed_gateway_is_started_again_on_the_next_request(egress_dir: Path) -> None:
    async def scenario() -> None:
        gateway = await _start(egress_dir)
        first = gateway.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        await asyncio.sleep(0.2)
        await gateway.retain()
        assert gateway.pid != first and _alive(gateway.pid)
        await gateway.close()

    asyncio.run(scenario())


def test_the_fingerprint_follows_configuration(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("one")
    base = fingerprint(RESOLVERS, ca)
    assert fingerprint(RESOLVERS, ca) == base
    assert fingerprint(["127.0.0.2:53"], ca) != base
    ca.write_text("two")
    assert fingerprint(RESOLVERS, ca) != base
    assert fingerprint(RESOLVERS, None) != base
    ca.write_text("one")
    assert fingerprint(RESOLVERS, ca, PolicyBounds()) == base
    assert fingerprint(RESOLVERS, ca, PolicyBounds.of(["10.254.77.0/30"])) != base
    assert fingerprint(RESOLVERS, ca, PolicyBounds(allow_wide_any_port=True)) != base


def test_a_failed_start_leaves_an_adopted_gateway_and_ends_its_own(egress_dir: Path) -> None:
    async def scenario() -> None:
        own = await _start(egress_dir)
        started = own.pid
        await own.abandon()  # this node started it: it ends
        assert started is not None and not _alive(started)
        first = await _start(egress_dir)
        pid = first.pid
        _crash(first)
        adopted = await _start(egress_dir)
        await adopted.abandon()  # another node's: it keeps serving
        assert _alive(pid)
        last = await _start(egress_dir)
        assert last.pid == pid
        await last.close()
        assert not _alive(pid)

    asyncio.run(scenario())


PRIVATE_POLICY = {"allow": [{"cidr": "10.99.0.0/30", "ports": [80]}]}


def test_negative_the_gateway_process_refuses_a_private_rule_its_operator_did_not_list(
    egress_dir: Path, tmp_path: Path
) -> None:
    # The node checks first; the gateway, told the bounds as options, checks again.
    (tmp_path / "ca").write_text("not a CA")

    async def scenario() -> None:
        strict = await _start(egress_dir)
        try:
            with pytest.raises(InvalidArgument, match=r"10\.99\.0\.0/30 is a private range"):
                await strict.attach("sb", tmp_path / "no-netns", PRIVATE_POLICY, tmp_path / "ca")
        finally:
            await strict.close()
        listed = PolicyBounds.of(["10.99.0.0/24"])
        opened = await GatewayProcess.start(
            egress_dir, RESOLVERS, None, listed, broker=gateway_broker(egress_dir)
        )
        try:
            # Past the policy now: what fails is the CA, which is none.
            with pytest.raises(InvalidArgument, match="cannot load the CA"):
                await opened.attach("sb", tmp_path / "no-netns", PRIVATE_POLICY, tmp_path / "ca")
        finally:
            await opened.close()

    asyncio.run(scenario())
