"""The host's own addresses as a predicate the gateway asks at every connect.

Read again every few seconds (addresses come and go while the gateway runs); the
reading itself is space.node.api.host_addresses, which the control plane uses too.
"""

from __future__ import annotations

import time
from ipaddress import IPv4Address, IPv6Address
from pathlib import Path

from space.node.api.host_addresses import FIB_TRIE, host_addresses

__all__ = ["LocalAddresses"]


class LocalAddresses:
    """Whether an address is the host's own, from ``host_addresses`` at most
    ``refresh_s`` old."""

    def __init__(self, refresh_s: float = 5.0, path: Path = FIB_TRIE):
        self._refresh_s, self._path = refresh_s, path
        self._at, self._addresses = -refresh_s, frozenset[IPv4Address]()

    def __call__(self, address: IPv4Address | IPv6Address) -> bool:
        now = time.monotonic()
        if now - self._at >= self._refresh_s:
            self._addresses, self._at = host_addresses(self._path), now
        return address in self._addresses
