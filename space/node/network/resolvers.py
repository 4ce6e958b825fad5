"""Which DNS servers the egress gateway asks: configured, or the host's own."""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Sequence
from ipaddress import IPv4Address

__all__ = ["parse_resolvers", "system_resolvers"]


def parse_resolvers(specs: Sequence[str]) -> list[tuple[str, int]]:
    """``["203.0.113.2", "203.0.113.3:5353"]`` as (address, port); ValueError if bad."""
    out = []
    for spec in specs:
        host, _, port = spec.rpartition(":") if spec.count(":") == 1 else (spec, "", "53")
        out.append((str(ipaddress.IPv4Address(host)), int(port)))
        if not 0 < out[-1][1] < 65536:
            raise ValueError(f"bad resolver port in {spec!r}")
    return out


def system_resolvers(path: str = "/etc/resolv.conf") -> list[str]:
    """The IPv4 nameservers of the host's resolv.conf (127.0.0.53 and the like too)."""
    found = []
    with contextlib.suppress(OSError), open(path, encoding="utf-8") as file:
        for line in file:
            words = line.split()
            if len(words) >= 2 and words[0] == "nameserver":
                with contextlib.suppress(ValueError):
                    found.append(str(IPv4Address(words[1])))
    return found
