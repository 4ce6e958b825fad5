"""A sandbox's own network namespace: the guest's link, nftables, and nothing else.

Every sandbox VM's QEMU runs inside a namespace that holds only ``lo`` and ``tap0``.
A gVisor sandbox's namespace has the same shape, ``tap0`` being there one end of a veth
pair whose other end, ``eth0``, sits alone in a second namespace (``guest_netns``):
runsc takes that link over with gVisor's own network stack (``--network=sandbox``),
so the guest's packets arrive on ``tap0`` as a VM's do and meet the same ruleset, and
its sockets are gVisor's, never the host kernel's. There is no veth to the host and
no address of the host in either (the guest's one route points at the gateway), so
the guest has no path to the host's services, other sandboxes, the control plane or
metadata addresses: the only sockets it can reach are the egress gateway's, bound
*inside* the namespace (space.node.egress). nftables in the namespace sends every TCP
connection and DNS query arriving on ``tap0`` to those sockets and drops everything
else; while the sandbox has no egress policy it drops (resets) everything, DNS
included. Namespaces are made and changed by the node's root broker
(space.node.privileged); this module names them, writes their ruleset and asks.

All namespaces use the same addresses, IP and MAC on both ends (the guest is always
192.0.2.2), so a guest's memory image (a VM's, whose network setup and ARP cache are
part of its RAM, or a gVisor checkpoint, which holds its network stack) runs in any
namespace: ready states, warm-pool sandboxes, snapshots and forks need no
re-addressing.

Names are ``sp<node tag>-<vm tag>`` (a gVisor guest's second one adds ``g``): the node
tag (from the run directory root) lets a node find its own stray namespaces after a
crash without touching another node's.
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
    "GUEST_LINK",
    "GUEST_MAC",
    "KERNEL_ARG",
    "NETNS_DIR",
    "PREFIX_LEN",
    "PROXY_PORT",
    "TAP",
    "create",
    "delete",
    "exists",
    "guest_netns",
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
#: A gVisor guest's link, alone in its own namespace (``guest_netns``).
GUEST_LINK = "eth0"
#: The gateway's transparent TCP listener inside each namespace.
PROXY_PORT = 15001
DNS_PORT = 53
#: What the guest's init reads to configure its NIC (space.guest._network).
KERNEL_ARG = f"space.net={GUEST_ADDRESS}/{PREFIX_LEN},{GATEWAY_ADDRESS}"

_TABLE = "space"
_GUEST_SUFFIX = "g"


def _tag(text: str, length: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def node_prefix(run_root: Path) -> str:
    """The name prefix of every namespace a node with this run root makes."""
    return f"sp{_tag(str(run_root), 6)}-"


def netns_name(run_dir: Path) -> str:
    """The namespace of the VM whose sockets live in ``run_dir`` (15 characters)."""
    return f"{node_prefix(run_dir.parent)}{_tag(run_dir.name, 6)}"


def guest_netns(name: str) -> str:
    """The namespace holding a gVisor guest's link, beside its namespace ``name``."""
    return f"{name}{_GUEST_SUFFIX}"


def netns_path(name: str) -> Path:
    return NETNS_DIR / name


def exists(name: str) -> bool:
    return netns_path(name).exists()


def node_netns(run_root: Path) -> list[str]:
    """Names of the namespaces this node made (by prefix), a gVisor guest's second
    one under the name of its first (``delete`` removes both)."""
    prefix = node_prefix(run_root)
    try:
        names = {p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix)}
    except FileNotFoundError:
        return []
    return sorted({name.removesuffix(_GUEST_SUFFIX) for name in names})


async def create(run_root: Path, name: str, *, veth: bool = False) -> bool:
    """Make the namespace with its link and a closed ruleset (asked of the root broker
    of the node of ``run_root``): a VM's tap, or with ``veth`` a gVisor guest's veth
    pair and its second namespace; a no-op if they exist. Whether it made them (so
    closed). Raises Unavailable and leaves nothing behind."""
    return bool(await broker_for(run_root).call(CreateNetns(name=name, veth=veth)))


async def delete(run_root: Path, name: str) -> None:
    """Remove the namespace and a gVisor guest's second one (their links and rules go
    with them); idempotent."""
    await broker_for(run_root).call(DeleteNetns(name=name))


async def set_open(run_root: Path, name: str, is_open: bool) -> None:
    """Send the guest's TCP and DNS to the gateway (open), or reset everything (closed).
    Atomic: nft applies the whole ruleset in one transaction."""
    await broker_for(run_root).call(SetEgress(name=name, open=is_open))


def ruleset(is_open: bool) -> str:
    """The namespace's nftables ruleset (inet: IPv4 and IPv6 alike).

    One ruleset for both guest types, whose packets arrive on the tap (a VM's) or on
    the veth's end of the same name (a gVisor guest's): the prerouting chain sends
    them to the gateway and the input chain admits only those. The rest it refuses
    (TCP with a reset, UDP with port unreachable: gVisor's stack ignores an ICMP
    admin-prohibited for UDP), so a guest's client fails at once instead of waiting
    out its timeouts, whatever the guest type. Nothing in the
    namespace originates traffic but the gateway's replies (a reply conntrack finds
    invalid, out of window under load, is dropped, never answered with a reset that
    would cut the guest's connection).
    """
    redirect = (
        f'iifname "{TAP}" meta l4proto {{ tcp, udp }} th dport {DNS_PORT} '
        f"redirect to :{DNS_PORT}\n"
        f'    iifname "{TAP}" meta l4proto tcp redirect to :{PROXY_PORT}'
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
    return f"""\
table inet {_TABLE}
delete table inet {_TABLE}
table inet {_TABLE} {{
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    {redirect}
  }}
  chain input {{
    type filter hook input priority filter; policy drop;
    iif "lo" accept
    {accept}
    iifname "{TAP}" meta l4proto tcp reject with tcp reset
    iifname "{TAP}" meta l4proto udp reject with icmpx port-unreachable
    iifname "{TAP}" reject with icmpx admin-prohibited
  }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
  }}
  chain output {{
    type filter hook output priority filter; policy drop;
    oif "lo" accept
    ct state established,related accept
  }}
}}
"""
