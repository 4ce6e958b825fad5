"""Each sandbox's network namespace, made and changed as root: its link (a VM's tap, or
a gVisor guest's veth pair into a second namespace), its nftables ruleset, and the
egress gateway's listeners inside it. Names, addresses and the ruleset itself are
space.node.network.netns's."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
from pathlib import Path

from space.node.api import Unavailable
from space.node.core.run import run
from space.node.network.netns import (
    DNS_PORT,
    GATEWAY_ADDRESS,
    GATEWAY_MAC,
    GUEST_ADDRESS,
    GUEST_LINK,
    GUEST_MAC,
    NETNS_DIR,
    PREFIX_LEN,
    PROXY_PORT,
    TAP,
    exists,
    guest_netns,
    netns_path,
    ruleset,
)
from space.node.privileged.netns_socket import bind_in_netns

__all__ = [
    "address_guest",
    "bind_listeners",
    "create",
    "delete",
    "readable_directory",
    "set_open",
]


def readable_directory(path: Path) -> None:
    """Make ``path`` a directory anyone may list (0755), as iproute2 means /run/netns
    to be: made by the first ``ip netns add`` under a root server's umask (077) it
    would be root's alone, and the node agent lists its namespaces there."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o755)
    if stat.S_IMODE(os.stat(path).st_mode) & 0o555 != 0o555:
        os.chmod(path, 0o755)


async def create(name: str, *, veth: bool = False) -> bool:
    """Make the namespace with its link and a closed ruleset: a tap, or with ``veth``
    one end of a veth pair whose other end is a gVisor guest's link, addressed, alone
    in the second namespace; a no-op if they exist (either half of a pair alone, left
    by a crash, is made again). Whether it made them (closed).

    Raises Unavailable (the failing command's message) and leaves nothing behind.
    """
    guest = guest_netns(name)
    if exists(name) and (not veth or exists(guest)):
        return False
    await delete(name)
    readable_directory(NETNS_DIR)
    await run("ip", "netns", "add", name)
    try:
        if veth:
            await run("ip", "netns", "add", guest)
            link = f"link add {TAP} type veth peer name {GUEST_LINK} netns {guest}"
        else:
            link = f"tuntap add dev {TAP} mode tap"
        await _batch(
            name,
            "link set lo up",
            link,
            f"link set {TAP} address {GATEWAY_MAC}",
            f"address add {GATEWAY_ADDRESS}/{PREFIX_LEN} dev {TAP}",
            f"link set {TAP} up",
        )
        # What the ruleset refuses is answered at once, every time: past the kernel's
        # per-peer ICMP limit (a burst of 6, then one a second) a guest's resolver,
        # its queries unanswered, waited out its timeouts (2 s each) for every name.
        await _in_netns(
            name, "sysctl", "-q", "-w", f"net.ipv6.conf.{TAP}.disable_ipv6=1",
            "net.ipv4.icmp_ratelimit=0",
        )  # fmt: skip
        if veth:
            await _in_netns(
                guest, "sysctl", "-q", "-w", f"net.ipv6.conf.{GUEST_LINK}.disable_ipv6=1"
            )
            await _batch(
                guest,
                "link set lo up",
                f"link set {GUEST_LINK} address {GUEST_MAC}",
                f"link set {GUEST_LINK} up",
            )
            await address_guest(name)
        await set_open(name, False)
    except BaseException:
        await delete(name)
        raise
    return True


async def address_guest(name: str) -> None:
    """Give a gVisor guest's link (in the second namespace of ``name``) its address
    and default route, as before each runsc run or restore: runsc moves them into
    gVisor's stack, taking them off the link, and reads them from there."""
    await _batch(
        guest_netns(name),
        f"address replace {GUEST_ADDRESS}/{PREFIX_LEN} dev {GUEST_LINK}",
        f"route replace default via {GATEWAY_ADDRESS} dev {GUEST_LINK}",
    )


async def delete(name: str) -> None:
    """Remove the namespace and a gVisor guest's second one (their links and rules go
    with them); idempotent."""
    for each in (name, guest_netns(name)):
        if exists(each):
            await run("ip", "netns", "delete", each, check=False)
        if exists(each):  # a bind mount left by a failed ``ip netns add``
            os.unlink(netns_path(each))


async def set_open(name: str, is_open: bool) -> None:
    """Send the guest's TCP and DNS to the gateway (open), or reset everything (closed).

    Atomic: nft applies the whole ruleset in one transaction.
    """
    await _in_netns(name, "nft", "-f", "-", stdin=ruleset(is_open))


async def bind_listeners(name: str) -> list[socket.socket]:
    """The gateway's TCP and UDP listeners, bound in ``name``. Raises Unavailable."""
    path = netns_path(name)
    try:
        tcp = await asyncio.to_thread(
            bind_in_netns, path, socket.SOCK_STREAM, (GATEWAY_ADDRESS, PROXY_PORT)
        )
    except OSError as exc:
        raise Unavailable(f"cannot listen in {path}: {exc}") from exc
    try:
        udp = await asyncio.to_thread(
            bind_in_netns, path, socket.SOCK_DGRAM, (GATEWAY_ADDRESS, DNS_PORT)
        )
    except OSError as exc:
        tcp.close()
        raise Unavailable(f"cannot listen in {path}: {exc}") from exc
    return [tcp, udp]


async def _batch(name: str, *commands: str) -> None:
    """iproute2 ``commands`` in ``name``, one process for all."""
    await run("ip", "-n", name, "-batch", "-", stdin="\n".join(commands) + "\n")


async def _in_netns(name: str, *argv: str, stdin: str | None = None) -> None:
    await run("nsenter", f"--net={netns_path(name)}", "--", *argv, stdin=stdin)
