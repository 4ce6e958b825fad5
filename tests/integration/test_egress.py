"""Egress from a real guest through the node's gateway, into a namespace the test made.

Every test runs on a VM and on a gVisor sandbox (GUESTS): one node and one sandbox
serve each guest type's run of the module (tests/egress_guest.py has the policy and
the records, tests/egress_world.py the map of the little internet). Every refusal is
checked twice where it can be: the guest got no answer, and the server it aimed at
saw nothing.
"""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from space.node.api import (
    ExecExited,
    ExecRequest,
    ExecStream,
    InvalidArgument,
    SandboxSpec,
    SecretGrant,
)
from space.node.core.config import NodeConfig
from space.node.egress.audit import DEFAULT_BURST, DEFAULT_RATE_PER_S, DROP_DECISION

from ..egress_guest import GUESTS, POLICY, SANDBOX, Guest, booted_guest, output
from ..egress_world import OTHER, PRIVATE, UPSTREAM
from .test_pause_resume import _one

pytestmark = pytest.mark.vm


#: The one private address the operator of this module's node lets policies name (the
#: world's private canary; not the host's end of that link, HOST_PRIVATE_SIDE).
LISTED = f"{PRIVATE}/32"


@pytest.fixture(scope="module", params=GUESTS)
def guest(node_config: NodeConfig, request: pytest.FixtureRequest) -> Iterator[Guest]:
    config = replace(node_config, egress_operator_ranges=(LISTED,))
    with booted_guest(config, guest=request.param) as booted:
        yield booted


def test_an_allowed_domain_is_reached_by_name_over_http(guest: Guest) -> None:
    result = guest.probe("http", host="allowed.test")
    assert result["ok"], result
    assert "upstream host=allowed.test" in result["detail"]
    assert any(e.decision == "allow" and e.host == "allowed.test" for e in guest.audit())


def test_a_wildcard_rule_admits_one_label_and_tls_passes_with_a_matching_sni(
    guest: Guest,
) -> None:
    assert guest.probe("http", host="a.allowed.test")["ok"]
    result = guest.probe("tls", host="tls.allowed.test", sni="tls.allowed.test")
    assert result["ok"], result
    assert "tls host=tls.allowed.test" in result["detail"]


def test_a_cidr_rule_admits_its_address_and_port_directly(guest: Guest) -> None:
    result = guest.probe("http", host=UPSTREAM, port=8080)
    assert result["ok"], result
    assert "upstream:8080" in result["detail"]


def test_negative_a_domain_no_rule_names_does_not_even_resolve(guest: Guest) -> None:
    result = guest.probe("resolve", name="other.test")
    assert not result["ok"]
    assert all(name != "other.test" for name, _ in guest.world.asked)


def test_negative_a_direct_ip_no_rule_names_is_refused(guest: Guest) -> None:
    assert not guest.probe("http", host=OTHER)["ok"]
    assert not guest.probe("http", host=UPSTREAM, port=80)["ok"]
    assert not guest.world.hits_of("other")


def test_negative_an_allowed_domain_on_another_port_is_refused(guest: Guest) -> None:
    before = len(guest.world.hits_of("upstream:8080"))
    assert not guest.probe("http", host="a.allowed.test", port=8080)["ok"]
    assert len(guest.world.hits_of("upstream:8080")) == before


def test_negative_dns_rebinding_never_reaches_a_private_or_loopback_address(
    guest: Guest,
) -> None:
    results = [guest.probe("http", host="rebind.test")["ok"] for _ in range(6)]
    assert any(results), "the public answers should have passed"
    assert not all(results), "the private answers should have been refused"
    assert not guest.world.hits_of("private")
    assert not guest.world.hits_of("loopback")


@pytest.mark.parametrize("name", ["private.test", "loop.test", "meta.test", "host.test"])
def test_negative_an_allowed_name_resolving_to_a_forbidden_address_is_refused(
    guest: Guest, name: str
) -> None:
    port = 8080 if name == "host.test" else 80
    assert not guest.probe("http", host=name, port=port)["ok"]
    assert not guest.world.hits_of("private")
    assert not guest.world.hits_of("loopback")
    assert not guest.world.hits_of("host")
    denied = [e for e in guest.audit() if e.host == name and e.decision == "deny"]
    assert denied and "blocked address" in denied[-1].reason


@pytest.mark.parametrize(
    "spelling",
    [
        "169.254.169.254",
        "2852039166",
        "0xA9FEA9FE",
        "0251.0376.0251.0376",
        "169.254.43518",
        "0xa9.0xfe.0xa9.0xfe",
        "::ffff:169.254.169.254",
        "::ffff:a9fe:a9fe",
    ],
)
def test_negative_metadata_addresses_in_every_spelling_are_refused(
    guest: Guest, spelling: str
) -> None:
    result = guest.probe("http", host="metadata", address=spelling)
    assert not result["ok"], result


def test_negative_a_private_range_the_operator_did_not_list_is_refused_and_nothing_changes(
    guest: Guest,
) -> None:
    # Probe 7 of issue 17: this policy let a guest fetch from the host's private network.
    cidr = str(ipaddress.ip_network(f"{PRIVATE}/30", strict=False))
    opened: dict[str, object] = {"allow": [{"cidr": cidr, "ports": [80]}]}
    with pytest.raises(InvalidArgument, match=re.escape(f"{cidr} is a private range")):
        guest.h.run(guest.node.set_egress(SANDBOX, opened))
    before = len(guest.world.hits_of("private"))
    assert not guest.probe("http", host=PRIVATE, port=80)["ok"]
    assert len(guest.world.hits_of("private")) == before
    assert guest.probe("http", host="allowed.test")["ok"]  # the old policy stands


def test_a_private_address_the_operator_listed_is_reached_by_a_cidr_rule(guest: Guest) -> None:
    rules = POLICY["allow"]
    assert isinstance(rules, list)
    opened: dict[str, object] = {"allow": [*rules, {"cidr": LISTED, "ports": [80]}]}
    before = len(guest.world.hits_of("private"))
    try:
        guest.h.run(guest.node.set_egress(SANDBOX, opened))
        result = guest.probe("http", host=PRIVATE, port=80)
        assert result["ok"], result
        assert len(guest.world.hits_of("private")) == before + 1
    finally:
        guest.h.run(guest.node.set_egress(SANDBOX, POLICY))
    assert not guest.probe("http", host=PRIVATE, port=80)["ok"]


def test_a_live_policy_change_takes_effect_within_a_second(guest: Guest) -> None:
    narrowed: dict[str, object] = {"allow": [{"domain": "a.allowed.test"}]}
    try:
        started = time.monotonic()
        guest.h.run(guest.node.set_egress(SANDBOX, narrowed))
        took = time.monotonic() - started
        assert took < 1.0
        assert not guest.probe("http", host="allowed.test")["ok"]
        assert guest.probe("http", host="a.allowed.test")["ok"]
        guest.h.run(guest.node.set_egress(SANDBOX, None))
        assert not guest.probe("http", host="a.allowed.test")["ok"]
        assert not guest.probe("resolve", name="a.allowed.test")["ok"]
    finally:
        guest.h.run(guest.node.set_egress(SANDBOX, POLICY))
    assert guest.probe("http", host="allowed.test")["ok"]


_FETCH_TLS = "import urllib.request as u; print(u.urlopen('https://tls.allowed.test/').read())"


def test_a_policy_opened_on_a_running_sandbox_serves_https_at_once(guest: Guest) -> None:
    """A sandbox made without a policy has a closed namespace; opening it installs the
    CA in the running guest, and TLS through the gateway verifies at once."""
    node, run, other = guest.node, guest.h.run, "egress-opened"
    run(node.create_sandbox(SandboxSpec(sandbox_id=other, guest=guest.type)))
    try:
        request = ExecRequest(argv=["python3", "-c", _FETCH_TLS])
        stream = run(node.exec(other, request))
        assert run(_exit_code(stream)) != 0  # closed: no DNS, no way out
        run(node.set_egress(other, POLICY))
        assert "tls host=tls.allowed.test" in run(output(node, request, other))
    finally:
        run(node.delete_sandbox(other))


async def _exit_code(stream: ExecStream) -> int | None:
    code = None
    async for event in stream:
        if isinstance(event, ExecExited):
            code = event.exit_code
    return code


@pytest.mark.parametrize("stopped", ["paused", "hibernated"])
def test_a_policy_opened_while_stopped_serves_https_once_resumed(
    guest: Guest, stopped: str
) -> None:
    """The CA cannot be installed in a paused or hibernated guest; resuming installs it."""
    node, run, other = guest.node, guest.h.run, f"egress-{stopped}"
    run(node.create_sandbox(SandboxSpec(sandbox_id=other, guest=guest.type)))
    try:
        stop = node.pause_sandbox if stopped == "paused" else node.hibernate_sandbox
        run(stop(other))
        run(node.set_egress(other, POLICY))
        run(node.resume_sandbox(other))
        out = run(output(node, ExecRequest(argv=["python3", "-c", _FETCH_TLS]), other))
        assert "tls host=tls.allowed.test" in out
    finally:
        run(node.delete_sandbox(other))


VALUE = "sk-live-" + "7f3a9c" * 6
PLACEHOLDER = "space_ph_" + "5e" * 16


def test_https_to_an_allowed_name_is_verified_with_the_sandbox_ca(guest: Guest) -> None:
    result = guest.probe("https", url="https://tls.allowed.test/")
    assert result["ok"], result
    assert "tls host=tls.allowed.test" in result["detail"]


def test_a_secret_reaches_only_its_bound_host_and_never_comes_back(guest: Guest) -> None:
    grant = SecretGrant(
        name="API_KEY", value=VALUE, placeholder=PLACEHOLDER, hosts=("tls.allowed.test",)
    )
    guest.h.run(guest.node.set_secrets(SANDBOX, [grant]))
    auth = {"Authorization": f"Bearer {PLACEHOLDER}"}
    echoed = guest.probe("https", url="https://tls.allowed.test/echo", headers=auth)
    assert echoed["ok"], echoed
    assert PLACEHOLDER in echoed["detail"] and VALUE not in echoed["detail"]
    assert any(VALUE in hit.data.decode() for hit in guest.world.hits_of("tls"))
    elsewhere = guest.probe("http", host="allowed.test", path="/echo", header_host=None)
    assert elsewhere["ok"]
    sent = guest.probe("https", url="https://allowed.test/echo", headers=auth)
    assert sent["ok"], sent
    unbound = [h for h in guest.world.hits_of("tls") if h.host == "allowed.test"]
    assert unbound and PLACEHOLDER in unbound[-1].data.decode()
    assert VALUE not in unbound[-1].data.decode()
    used = [e for e in guest.audit() if e.secrets]
    assert used and used[-1].secrets == ("API_KEY",) and used[-1].host == "tls.allowed.test"
    assert guest.probe("find", needle_hex=VALUE.encode().hex())["ok"]


_FETCH_WITH_SECRET = (
    "import urllib.request as u\n"
    "r = u.Request('https://tls.allowed.test/echo',"
    f" headers={{'Authorization': 'Bearer {PLACEHOLDER}'}})\n"
    "print(u.urlopen(r).read().decode())"
)


def test_a_secret_given_while_closed_is_injected_once_a_policy_opens(guest: Guest) -> None:
    """A closed sandbox is not attached to the gateway (nothing of it reaches it), so
    its grants wait in the node until a policy opens it, and then apply at once."""
    node, run, other = guest.node, guest.h.run, "egress-secret-later"
    run(node.create_sandbox(SandboxSpec(sandbox_id=other, guest=guest.type)))
    try:
        grant = SecretGrant(
            name="API_KEY", value=VALUE, placeholder=PLACEHOLDER, hosts=("tls.allowed.test",)
        )
        run(node.set_secrets(other, [grant]))
        run(node.set_egress(other, POLICY))
        out = run(output(node, ExecRequest(argv=["python3", "-c", _FETCH_WITH_SECRET]), other))
        assert PLACEHOLDER in out and VALUE not in out
        assert VALUE in guest.world.hits_of("tls")[-1].data.decode()
    finally:
        run(node.delete_sandbox(other))


_HELD = f"""
import os, socket, time
s = socket.create_connection(("{UPSTREAM}", 8080), timeout=60)
s.sendall(b"GET /held HTTP/1.1\\r\\n")
open("/tmp/held.open", "w").close()
while not os.path.exists("/tmp/held.go"):
    time.sleep(0.05)
s.sendall(b"Host: held\\r\\n\\r\\n")
data = b""
while chunk := s.recv(4096):
    data += chunk
open("/tmp/held.new", "wb").write(data)
os.replace("/tmp/held.new", "/tmp/held.out")  # never read half-written
"""


def test_a_restarted_node_adopts_the_gateway_and_cuts_no_connection(guest: Guest) -> None:
    """The gateway outlives the node agent, as QEMU does: a connection the guest
    opened before the restart is finished after it."""
    h = guest.h
    h.run(h.node.exec(SANDBOX, ExecRequest(argv=["python3", "-c", _HELD], background=True)))
    _wait_for_file(guest, "/tmp/held.open")
    gateway = h.node._gateway.pid
    h.restart()
    assert h.node._gateway.pid == gateway, "the gateway was replaced, not adopted"
    h.run(h.node.write_file(SANDBOX, "/tmp/held.go", _one(b"")))
    assert "upstream:8080 host=held" in _wait_for_file(guest, "/tmp/held.out")
    result = guest.probe("http", host="allowed.test")
    assert result["ok"], result
    assert not guest.probe("http", host=OTHER)["ok"]
    assert guest.probe("https", url="https://tls.allowed.test/")["ok"]


def test_a_sandbox_hibernated_with_a_connection_open_wakes_with_egress(guest: Guest) -> None:
    """Saving a guest's memory with a TCP connection open (hibernate, snapshot, fork)
    works on both types, and the woken sandbox connects again through the gateway.
    gVisor saves its own network stack only once runsc may drop such connections
    (``--net-disconnect-ok``): without it the save is refused."""
    node, run, other = guest.node, guest.h.run, "egress-held"
    run(node.create_sandbox(SandboxSpec(sandbox_id=other, guest=guest.type, egress=POLICY)))
    try:
        run(node.exec(other, ExecRequest(argv=["python3", "-c", _HELD], background=True)))
        _wait_for_file(guest, "/tmp/held.open", sandbox_id=other)
        assert run(node.hibernate_sandbox(other)).state.value == "hibernated"
        run(node.resume_sandbox(other))
        out = run(output(node, ExecRequest(argv=["python3", "-c", _FETCH_TLS]), other))
        assert "tls host=tls.allowed.test" in out
    finally:
        run(node.delete_sandbox(other))


def _wait_for_file(
    guest: Guest, path: str, timeout_s: float = 30.0, *, sandbox_id: str = SANDBOX
) -> str:
    deadline = time.monotonic() + timeout_s
    script = f"cat {path} 2>/dev/null || echo absent"
    request = ExecRequest(cmd=script)
    while (out := guest.h.run(output(guest.node, request, sandbox_id))) == "absent\n":
        assert time.monotonic() < deadline, f"{path} did not appear in the guest"
        time.sleep(0.2)
    return out


_DNS_FLOOD = r"""
import re, socket, struct, time
server = re.search(r"nameserver\s+(\S+)", open("/etc/resolv.conf").read()).group(1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
started = time.monotonic()
for n in range(4000):
    labels = (f"q{n}", "flood", "test")
    name = b"".join(bytes([len(part)]) + part.encode() for part in labels) + b"\0"
    query = struct.pack(">6H", n, 0x0100, 1, 0, 0, 0) + name + struct.pack(">2H", 1, 1)
    s.sendto(query, (server, 53))
    time.sleep(0.0005)  # ~1,500 queries a second at most: the gateway's UDP buffer keeps up
print(time.monotonic() - started)
"""


def test_negative_a_dns_flood_is_audited_at_the_bound_and_the_drops_are_counted(
    guest: Guest,
) -> None:
    """Probe 10 (issue 17): a guest's DNS queries at hundreds a second wrote megabytes of
    audit. Now at most the burst plus the rate get in, and the rest are counted."""
    before = guest.h.run(guest.node.egress_log(SANDBOX, limit=1))
    started = time.monotonic()
    request = ExecRequest(argv=["python3", "-c", _DNS_FLOOD], user="root", timeout_s=300)
    guest.h.run(output(guest.node, request))
    elapsed_s = time.monotonic() - started
    time.sleep(1.5)  # past the drop report interval: the next event writes the count
    assert not guest.probe("resolve", name="other.test")["ok"]
    log = guest.h.run(guest.node.egress_log(SANDBOX, limit=1000))
    flood = [e for e in log.events if e.host is not None and e.host.endswith(".flood.test")]
    assert len(flood) <= DEFAULT_BURST + DEFAULT_RATE_PER_S * (elapsed_s + 2)
    assert log.dropped > before.dropped
    notes = [e for e in log.events if e.decision == DROP_DECISION]
    assert notes and sum(int(e.reason.split()[0]) for e in notes) <= log.dropped
    assert len(flood) + log.dropped - before.dropped <= 4000
