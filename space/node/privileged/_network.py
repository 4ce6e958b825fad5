"""Each sandbox's network namespace, made and changed as root: its tap, its route, its
nftables ruleset, and the egress gateway's listeners inside it. Names, addresses and the
ruleset itself are space.node.network.netns's."""

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
    NETNS_DIR,
    PREFIX_LEN,
    PROXY_PORT,
    TAP,
    exists,
    netns_path,
    ruleset,
)
from space.node.privileged.netns_socket import bind_in_netns

__all__ = ["bind_listeners", "create", "delete", "readable_directory", "set_open"]


def readable_directory(path: Path) -> None:
    """Make ``path`` a directory anyone may list (0755), as iproute2 means /run/netns
    to be: made by the first ``ip netns add`` under a root server's umask (077) it
    would be root's alone, and the node agent lists its namespaces there."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o755)
    if stat.S_IMODE(os.stat(path).st_mode) & 0o555 != 0o555:
        os.chmod(path, 0o755)


async def create(name: str) -> None:
    """Make the namespace with its tap and a closed ruleset; a no-op if it exists.

    Raises Unavailable (the failing command's message) and leaves nothing behind.
    """
    if exists(name):
        return
    readable_directory(NETNS_DIR)
    await run("ip", "netns", "add", name)
    try:
        for command in (
            ("link", "set", "lo", "up"),
            ("tuntap", "add", "dev", TAP, "mode", "tap"),
            ("link", "set", TAP, "address", GATEWAY_MAC),
            ("addr", "add", f"{GATEWAY_ADDRESS}/{PREFIX_LEN}", "dev", TAP),
            ("link", "set", TAP, "up"),
            # A gVisor guest's sockets are the namespace's own: without a route they
            # fail (ENETUNREACH) before nftables could send them to the gateway. In a
            # VM's namespace nothing local uses it (its output chain rejects all else).
            ("route", "add", "default", "via", GUEST_ADDRESS, "dev", TAP),
        ):
            await run("ip", "-n", name, *command)
        await _in_netns(name, "sysctl", "-q", "-w", f"net.ipv6.conf.{TAP}.disable_ipv6=1")
        await set_open(name, False)
    except BaseException:
        await delete(name)
        raise


async def delete(name: str) -> None:
    """Remove the namespace (its tap and rules go with it); idempotent."""
    if exists(name):
        await run("ip", "netns", "delete", name, check=False)
    if exists(name):  # a bind mount left by a failed ``ip netns add``
        os.unlink(netns_path(name))


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


async def _in_netns(name: str, *argv: str, stdin: str | None = None) -> None:
    await run("nsenter", f"--net={netns_path(name)}", "--", *argv, stdin=stdin)
