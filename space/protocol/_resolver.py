"""The guest's resolver file: what spaced writes for a VM (from ``space.net=``) and what
the node's root gives a gVisor sandbox, naming the egress gateway, the same text."""

from __future__ import annotations

import ipaddress

__all__ = ["resolv_conf_text"]


def resolv_conf_text(nameserver: ipaddress.IPv4Address) -> str:
    """/etc/resolv.conf naming one resolver, retried briefly (2 s, 2 attempts)."""
    return f"nameserver {nameserver}\noptions timeout:2 attempts:2\n"
