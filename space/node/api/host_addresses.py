"""The host's own IPv4 addresses, as the kernel's local routes list them.

Policies may not name them (space.node.api.egress_policy.PolicyBounds) and the gateway
refuses to connect to them whatever a policy says: a sandbox must never reach the node
or a control plane on the same host. Part of the contract because the control plane
checks policies against its host's addresses too; stdlib only, one small file read.
"""

from __future__ import annotations

import contextlib
from ipaddress import IPv4Address
from pathlib import Path

__all__ = ["host_addresses"]

FIB_TRIE = Path("/proc/net/fib_trie")


def host_addresses(path: Path = FIB_TRIE) -> frozenset[IPv4Address]:
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
