"""Synthetic ("fake") addresses that stand for names, one map per sandbox.

The gateway answers a DNS query for an allowed name with an address of 198.18.0.0/15
(RFC 2544's benchmarking range, never routed on the internet). When the guest connects
to it, ``name_for`` tells the gateway which name the guest meant; the gateway resolves
that name itself, so what the guest connects to is decided at connect time, not by the
guest's cache.
"""

from __future__ import annotations

from collections import OrderedDict
from ipaddress import IPv4Address, IPv4Network, IPv6Address, ip_address

from space.node.api import InvalidArgument

__all__ = ["FAKE_NETWORK", "FakeIps"]

#: The range fake addresses come from (RFC 2544, section C.2.2).
FAKE_NETWORK = IPv4Network("198.18.0.0/15")
# 198.18.0.0 looks like a network address and 198.18.0.1 like a gateway to the guest's
# tools; neither is handed out.
_FIRST = int(FAKE_NETWORK.network_address) + 2
_LAST = int(FAKE_NETWORK.broadcast_address)
_SIZE = _LAST - _FIRST + 1


class FakeIps:
    """A bounded two-way map name <-> fake IPv4 address for one sandbox.

    At most ``capacity`` names are mapped; mapping one more evicts the least recently
    used name (use is ``address_for`` or ``name_for``). Addresses are allocated by
    walking the range cyclically, so an address freed by an eviction is handed out
    again only after every other address of the range has been, and a guest that
    kept a stale address does not reach a different name soon after.

    Names are taken as given: callers pass normalized names. Not thread-safe (the
    gateway runs on one event loop).
    """

    def __init__(self, capacity: int = 4096) -> None:
        """Raise InvalidArgument unless 1 <= ``capacity`` <= the range's size."""
        if not 1 <= capacity <= _SIZE:
            raise InvalidArgument(f"capacity must be within 1..{_SIZE}, got {capacity!r}")
        self._capacity = capacity
        self._by_name: OrderedDict[str, int] = OrderedDict()
        self._by_address: dict[int, str] = {}
        self._next = _FIRST

    def __len__(self) -> int:
        return len(self._by_name)

    @staticmethod
    def contains(address: IPv4Address | IPv6Address | str) -> bool:
        """Whether ``address`` is in 198.18.0.0/15 (mapped or not); False for garbage."""
        if isinstance(address, str):
            try:
                address = ip_address(address)
            except ValueError:
                return False
        return isinstance(address, IPv4Address) and address in FAKE_NETWORK

    def address_for(self, name: str) -> IPv4Address:
        """The fake address of ``name``, mapping it first if needed (then it may evict).

        Idempotent while ``name`` stays mapped: the same name gets the same address.
        """
        number = self._by_name.get(name)
        if number is None:
            if len(self._by_name) >= self._capacity:
                _, evicted = self._by_name.popitem(last=False)
                del self._by_address[evicted]
            number = self._allocate()
            self._by_name[name] = number
            self._by_address[number] = name
        else:
            self._by_name.move_to_end(name)
        return IPv4Address(number)

    def name_for(self, address: IPv4Address) -> str | None:
        """The name ``address`` stands for, or None if it is not mapped (now)."""
        name = self._by_address.get(int(address))
        if name is not None:
            self._by_name.move_to_end(name)
        return name

    def _allocate(self) -> int:
        # Fewer than capacity <= _SIZE addresses are in use, so this ends within
        # capacity steps.
        while True:
            number = self._next
            self._next = number + 1 if number < _LAST else _FIRST
            if number not in self._by_address:
                return number
