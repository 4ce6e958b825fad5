"""A sandbox's own network namespace: a tap for its VM, nftables, and nothing else.

Every sandbox VM's QEMU runs inside a namespace that holds only ``lo`` and ``tap0``;
a gVisor sandbox runs in one of the same shape, its guest's sockets the namespace's
own (runsc ``--network=host``), so its traffic starts in the namespace instead of
arriving on the tap. There is no veth and no address of the host in it (its one route
points at the tap), so the guest has no path to the host's services, other sandboxes,
the control plane or metadata addresses: the only sockets it can reach are the egress
gateway's, bound *inside* the namespace (space.node.egress). nftables in the namespace
sends every TCP connection and DNS query of the guest to those sockets (from the tap
or from the namespace itself alike) and drops everything else; while the sandbox has
no egress policy it drops (resets) everything, DNS included. Namespaces are made and
changed by the node's root broker (space.node.privileged); this module names them,
writes their ruleset and asks.

All namespaces use the same addresses, IP and MAC on both ends (the guest is always
192.0.2.2), so a VM's memory image, whose network setup and ARP cache are part of its
RAM, runs in any namespace: ready states,
warm-pool VMs, snapshots and forks need no re-addressing.

Names are ``sp<node tag>-<vm tag>``: the node tag (from the run directory root) lets a
node find its own stray namespaces after a crash without touching another node's.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from space.node.privileged import broker_for
from space.node.privileged.requests import CreateNetns, DeleteNetns, SetEgress

__all__ = [
    "DNS_PORT",
    "GATEWAY_ADDRESS",
    "GATEWAY_MAC",
    "GUEST_ADDRESS",
    "GUEST_MAC",
    "KERNEL_ARG",
    "NETNS_DIR",
    "PREFIX_LEN",
    "PROXY_PORT",
    "TAP",
    "create",
    "delete",
    "exists",
    "netns_name",
    "netns_path",
    "node_netns",
    "ruleset",
    "set_open",
]

log = logging.getLogger(__name__)

NETNS_DIR = Path("/run/netns")
TAP = "tap0"
#: TEST-NET-1 (RFC 5737): never routed anywhere, so it cannot shadow a destination.
GUEST_ADDRESS = "192.0.2.2"
GATEWAY_ADDRESS = "192.0.2.1"
PREFIX_LEN = 30
GUEST_MAC = "52:54:00:00:00:02"
#: The tap's own MAC, the same in every namespace: a guest's ARP cache is part of its
#: memory, so a fork child or a VM made from a snapshot, woken in a new namespace,
#: would otherwise send every frame to the old tap's random MAC (issue 12).
GATEWAY_MAC = "52:54:00:00:00:01"
#: The gateway's transparent TCP listener inside each namespace.
PROXY_PORT = 15001
DNS_PORT = 53
#: A gVisor guest's loopback: the namespace's own, the one destination of its own that
#: does not go to the gateway.
LOOPBACK_NET = "127.0.0.0/8"
#: What the guest's init reads to configure its NIC (space.guest._network).
KERNEL_ARG = f"space.net={GUEST_ADDRESS}/{PREFIX_LEN},{GATEWAY_ADDRESS}"

_TABLE = "space"


def _tag(text: str, length: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def node_prefix(run_root: Path) -> str:
    """The name prefix of every namespace a node with this run root makes."""
    return f"sp{_tag(str(run_root), 6)}-"


def netns_name(run_dir: Path) -> str:
    """The namespace of the VM whose sockets live in ``run_dir`` (15 characters)."""
    return f"{node_prefix(run_dir.parent)}{_tag(run_dir.name, 6)}"


def netns_path(name: str) -> Path:
    return NETNS_DIR / name


def exists(name: str) -> bool:
    return netns_path(name).exists()


def node_netns(run_root: Path) -> list[str]:
    """Names of the namespaces this node made (by prefix)."""
    prefix = node_prefix(run_root)
    try:
        return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix))
    except FileNotFoundError:
        return []


async def create(run_root: Path, name: str) -> None:
    """Make the namespace with its tap and a closed ruleset (asked of the root broker
    of the node of ``run_root``); a no-op if it exists. Raises Unavailable and leaves
    nothing behind."""
    await broker_for(run_root).call(CreateNetns(name=name))


async def delete(run_root: Path, name: str) -> None:
    """Remove the namespace (its tap and rules go with it); idempotent."""
    await broker_for(run_root).call(DeleteNetns(name=name))


async def set_open(run_root: Path, name: str, is_open: bool) -> None:
    """Send the guest's TCP and DNS to the gateway (open), or reset everything (closed).
    Atomic: nft applies the whole ruleset in one transaction."""
    await broker_for(run_root).call(SetEgress(name=name, open=is_open))


def ruleset(is_open: bool) -> str:
    """The namespace's nftables ruleset (inet: IPv4 and IPv6 alike).

    One ruleset for both guest types. A VM's packets arrive on the tap: the prerouting
    chain sends them to the gateway and the input chain admits only those. A gVisor
    guest's sockets are the namespace's own, so its packets are locally originated: the
    output hooks do the same for them (a nat chain sends TCP and DNS to the gateway,
    the filter chain lets through only what goes there, its own loopback and replies).
    Nothing else in a VM's namespace originates traffic but the gateway's replies:
    only new connections are rejected there (a fast refusal for a gVisor guest); a
    reply conntrack finds invalid (out of window, under load) is dropped, as it always
    was, never answered with a reset that would cut the guest's connection.
    """
    redirect = (
        f'iifname "{TAP}" meta l4proto {{ tcp, udp }} th dport {DNS_PORT} '
        f"redirect to :{DNS_PORT}\n"
        f'    iifname "{TAP}" meta l4proto tcp redirect to :{PROXY_PORT}'
        if is_open
        else ""
    )
    # The guest's own loopback stays its own; everything else of TCP and DNS (its
    # "NIC" address, the gateway's, included) goes to the gateway, as a VM's does.
    own_dnat = (
        f"ip daddr != {LOOPBACK_NET} meta l4proto {{ tcp, udp }} th dport {DNS_PORT} "
        f"dnat ip to {GATEWAY_ADDRESS}:{DNS_PORT}\n"
        f"    ip daddr != {LOOPBACK_NET} meta l4proto tcp "
        f"dnat ip to {GATEWAY_ADDRESS}:{PROXY_PORT}"
        if is_open
        else ""
    )
    accept = (
        f'iifname "{TAP}" ip daddr {GATEWAY_ADDRESS} tcp dport {{ {DNS_PORT}, {PROXY_PORT} }} '
        f"accept\n"
        f'    iifname "{TAP}" ip daddr {GATEWAY_ADDRESS} udp dport {DNS_PORT} accept'
        if is_open
        else ""
    )
    # By destination, not "oif": the output hooks see the device a packet was routed
    # to before the nat chain turned it to the gateway's (local) address.
    own_accept = (
        f"ip daddr {GATEWAY_ADDRESS} tcp dport {{ {DNS_PORT}, {PROXY_PORT} }} accept\n"
        f"    ip daddr {GATEWAY_ADDRESS} udp dport {DNS_PORT} accept"
        if is_open
        else ""
    )
    return f"""\
table inet {_TABLE}
delete table inet {_TABLE}
table inet {_TABLE} {{
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    {redirect}
  }}
  chain output_nat {{
    type nat hook output priority -100; policy accept;
    {own_dnat}
  }}
  chain input {{
    type filter hook input priority filter; policy drop;
    iif "lo" accept
    {accept}
    iifname "{TAP}" meta l4proto tcp reject with tcp reset
    iifname "{TAP}" reject with icmpx admin-prohibited
  }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
  }}
  chain output {{
    type filter hook output priority filter; policy drop;
    ct state established,related accept
    ip daddr {LOOPBACK_NET} accept
    ip6 daddr ::1 accept
    {own_accept}
    ct state new meta l4proto tcp reject with tcp reset
    ct state new reject with icmpx admin-prohibited
  }}
}}
"""
