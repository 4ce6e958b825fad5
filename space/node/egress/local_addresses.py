"""The host's own IPv4 addresses, as the kernel's local routes list them.

The gateway refuses to connect to them whatever a policy says, and policies may not
name them (space.node.api.egress_policy.PolicyBounds): a sandbox must never reach the
node or a control plane on the same host. Stdlib only, cheap: the control plane reads
them too.
"""

from __future__ import annotations

import contextlib
import time
from ipaddress import IPv4Address, IPv6Address
from pathlib import Path

__all__ = ["LocalAddresses", "host_addresses"]

_FIB_TRIE = Path("/proc/net/fib_trie")


def host_addresses(path: Path = _FIB_TRIE) -> frozenset[IPv4Address]:
    """Every IPv4 address of the host's network namespace (none if unreadable)."""
    found, last = set(), None
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            text = line.strip()
            if text.startswith(("|--", "+--")):
                last = text[3:].strip().split("/")[0]
            elif text.startswith("/32 host LOCAL") and last:
                with contextlib.suppress(ValueError):
                    found.add(IPv4Address(last))
    return frozenset(found)


class LocalAddresses:
    """``host_addresses`` as a predicate, read again every few seconds (addresses come
    and go while the gateway runs)."""

    def __init__(self, refresh_s: float = 5.0, path: Path = _FIB_TRIE):
        self._refresh_s, self._path = refresh_s, path
        self._at, self._addresses = -refresh_s, frozenset[IPv4Address]()

    def __call__(self, address: IPv4Address | IPv6Address) -> bool:
        now = time.monotonic()
        if now - self._at >= self._refresh_s:
            self._addresses, self._at = host_addresses(self._path), now
        return address in self._addresses
