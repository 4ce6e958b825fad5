"""One sandbox with egress, in a node of its own, next to a test-made internet.

The sandbox is a VM or a gVisor sandbox (GUESTS): the egress tests run on both.

The shared fixture of the egress tests (tests/integration/test_egress.py, and the red
team's tests/security/test_egress_redteam.py). POLICY is the sandbox's allow-list and
RECORDS what the world's DNS server answers (the world itself: tests/egress_world.py).
``booted_guest`` makes the world, starts a node resolving through it, creates the
sandbox SANDBOX under POLICY and uploads the probe scripts into it; on exit it tears
all of it down and checks that nothing was left. ``Guest.probe`` runs an attempt of
tests/integration/egress_probe.py inside the sandbox, ``Guest.run_probe`` one of any
uploaded script. The ``assert_*`` helpers check what an attempt that must fail left
behind, in the guest, the world and the audit log.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from space.node.agent import Node
from space.node.api import (
    EgressEvent,
    EgressPolicy,
    ExecExited,
    ExecOutput,
    ExecRequest,
    SandboxSpec,
)
from space.node.core.config import NodeConfig

from .egress_world import HOST_SIDE, OTHER, PRIVATE, UPSTREAM, World, egress_world
from .integration.conftest import NodeHarness, release_data_dir, started_node

__all__ = [
    "CANARIES",
    "GUESTS",
    "POLICY",
    "PROBE",
    "RECORDS",
    "SANDBOX",
    "Guest",
    "asked_about",
    "assert_no_answer",
    "assert_no_server_answer",
    "assert_world_untouched",
    "booted_guest",
    "denials_since",
    "output",
    "private_node_config",
]

SANDBOX = "egress-1"
#: The guest types every egress test runs on (the red team's too).
GUESTS = ("qemu", "gvisor")
PROBE = Path(__file__).parent / "integration" / "egress_probe.py"
#: Where the scripts go in the guest (a script's name is its file name there).
GUEST_DIR = "/tmp"

POLICY: dict[str, object] = {
    "allow": [
        {"domain": "allowed.test", "ports": [80, 443, 8080]},
        {"domain": "*.allowed.test", "ports": [80, 443]},
        {"domain": "rebind.test", "ports": [80]},
        {"domain": "private.test"},
        {"domain": "loop.test"},
        {"domain": "meta.test"},
        {"domain": "host.test", "ports": [8080]},
        {"cidr": f"{UPSTREAM}/32", "ports": [8080]},
    ]
}

RECORDS: dict[str, list[str] | list[list[str]]] = {
    "allowed.test": [UPSTREAM],
    "a.allowed.test": [UPSTREAM],
    "tls.allowed.test": [UPSTREAM],
    "other.test": [OTHER],
    "rebind.test": [[UPSTREAM], [PRIVATE], ["127.0.0.1"]],
    "private.test": [PRIVATE],
    "loop.test": ["127.0.0.1"],
    "meta.test": ["169.254.169.254"],
    "host.test": [HOST_SIDE],
    # Names the red team tries: no rule allows them, and each points at the "other"
    # server, so that a leak would show as a hit there.
    "evil.test": [OTHER],
    "allowed.test.evil.test": [OTHER],
    "evilallowed.test": [OTHER],
    "a.b.allowed.test": [OTHER],
    # Allowed by "*.allowed.test" but never connected to: had the upstream resolver
    # been asked, its answer (not a synthetic address) would show it.
    "direct.allowed.test": [OTHER],
}


class Guest:
    """The sandbox, seen from inside: ``probe`` runs egress_probe.py in it."""

    def __init__(self, harness: NodeHarness, world: World, guest: str) -> None:
        self.h, self.world, self.type = harness, world, guest

    @property
    def node(self) -> Node:
        return self.h.node

    def probe(self, kind: str, **args: Any) -> dict[str, Any]:
        """egress_probe.py's attempt ``kind``: ``{"ok": bool, "detail": ...}``."""
        return self.run_probe("probe.py", kind, **args)

    def run_probe(self, script: str, kind: str, **args: Any) -> dict[str, Any]:
        """The attempt ``kind`` of the uploaded ``script``, as root in the guest (60 s
        at most); its one line of JSON. AssertionError if the script itself failed."""
        request = ExecRequest(
            argv=["python3", f"{GUEST_DIR}/{script}", json.dumps({"kind": kind, **args})],
            user="root",
            timeout_s=60,
        )
        out = self.h.run(output(self.node, request))
        return dict(json.loads(out.strip().splitlines()[-1]))

    def audit(self) -> list[EgressEvent]:
        """The sandbox's latest 1000 egress events, oldest first."""
        return self.h.run(self.node.egress_log(SANDBOX, limit=1000)).events


async def output(node: Node, request: ExecRequest, sandbox_id: str = SANDBOX) -> str:
    """The stdout of ``request`` run in the sandbox; AssertionError unless it exits 0."""
    stream = await node.exec(sandbox_id, request)
    out = b""
    async for event in stream:
        if isinstance(event, ExecOutput) and event.stream == "stdout":
            out += event.data
        elif isinstance(event, ExecExited):
            assert event.exit_code == 0, out
    return out.decode()


@contextlib.contextmanager
def booted_guest(
    node_config: NodeConfig,
    *,
    guest: str = "qemu",
    scripts: Mapping[str, Path] | None = None,
    watch_strays: bool = False,
) -> Iterator[Guest]:
    """The world, a node on ``node_config`` resolving through it, and SANDBOX (of the
    guest type ``guest``, one of GUESTS) under POLICY with ``scripts`` (name in the
    guest -> file here; default: egress_probe.py as "probe.py") uploaded to GUEST_DIR.
    ``watch_strays``: see egress_world. Teardown deletes the sandbox, stops the node
    and the world, and fails on anything left."""
    with egress_world(watch_strays=watch_strays) as world:
        world.records.update(RECORDS)
        config = replace(
            node_config, egress_resolvers=(world.resolver,), egress_upstream_ca=world.upstream_ca
        )
        if guest == "gvisor":  # a gVisor sandbox needs no ready state: boot no VM for one
            config = replace(config, ready_state=False)
        with started_node(config) as harness:
            spec = SandboxSpec(sandbox_id=SANDBOX, egress=POLICY, guest=guest)
            harness.run(harness.node.create_sandbox(spec))
            for name, path in (scripts or {"probe.py": PROBE}).items():
                upload = harness.node.write_file(
                    SANDBOX, f"{GUEST_DIR}/{name}", _chunks(path.read_bytes())
                )
                harness.run(upload)
            yield Guest(harness, world, guest)


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data


@contextlib.contextmanager
def private_node_config(data_dir: Path) -> Iterator[NodeConfig]:
    """A NodeConfig on ``data_dir`` (an empty directory) for a module of its own, as
    tests/integration's ``node_config`` makes one per session; on exit, fails if any
    VM, mount, loop device, namespace or gateway of it is left."""
    if os.geteuid() != 0:
        pytest.fail("egress tests boot QEMU VMs on a loop-mounted btrfs pool: run them as root")
    yield NodeConfig(data_dir=data_dir, pool_size_gib=8, boot_timeout_s=90.0)
    leaked = release_data_dir(data_dir)
    assert not leaked, f"left behind by the egress tests: {leaked}"


# --- checks of an attempt ----------------------------------------------------------------

#: World servers that no guest may ever reach ("stray": packets that got out past the
#: gateway, recorded with ``watch_strays``).
CANARIES = ("other", "private", "host", "loopback", "udp", "stray")
#: Failures that mean the probe broke, not that the network said no.
PROBE_BUGS = ("KeyError", "TypeError", "NameError", "AttributeError", "ValueError", "error")


def assert_no_answer(result: dict[str, Any]) -> None:
    """The attempt failed, and on the network (not on a bug of the probe)."""
    assert not result["ok"], f"the guest got an answer: {result}"
    kind = str(result["detail"]).split(":")[0]
    assert kind not in PROBE_BUGS, f"the probe broke: {result}"


def assert_no_server_answer(result: dict[str, Any]) -> None:
    """No server's reply reached the guest: an error, or at most the gateway's own
    refusal (an HTTP 421 once it parses HTTP); the world's servers all answer 200."""
    if result["ok"]:
        detail = str(result["detail"])
        assert "200 OK" not in detail and " host=" not in detail, f"a server answered: {result}"
    else:
        assert_no_answer(result)


def assert_world_untouched(guest: Guest, since: int, *servers: str) -> None:
    """No canary was ever hit; since hit number ``since``, no server got a byte of the
    guest's (nor, for ``servers``, a connection at all); the upstream resolver was only
    ever asked for A records of names POLICY allows (by the gateway, at connect time)."""
    world = guest.world
    canaries = [hit for hit in world.hits if hit.server in CANARIES]
    assert not canaries, f"canaries were hit: {canaries}"
    late = [hit for hit in world.hits[since:] if hit.data or hit.server in servers]
    assert not late, f"servers were reached: {late}"
    policy = EgressPolicy.parse(POLICY)
    asked = [(n, t) for n, t in list(world.asked) if t != 1 or not policy.domain_rule_for(n)]
    assert not asked, f"the upstream resolver was asked: {asked}"


def asked_about(world: World, fragment: str) -> list[str]:
    """The names the world's DNS server was asked that contain ``fragment``."""
    return [name for name, _ in list(world.asked) if fragment in name.lower()]


def denials_since(guest: Guest, started: float) -> list[EgressEvent]:
    """The gateway's refusals for the sandbox from ``started`` (epoch seconds) on."""
    return [e for e in guest.audit() if e.time >= started and e.decision == "deny"]
