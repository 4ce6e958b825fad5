"""E2B's internet access and ``network`` options as a SPACE egress policy (issue 5).

E2B sandboxes reach the internet unless ``allow_internet_access`` is false; SPACE's
policy is an allow-list through the node's egress gateway, which resolves only names a
domain rule allows and keeps private, loopback and metadata addresses closed whatever
the rules. So:

- internet access (E2B's default) is ``INTERNET``: any public host by name (names of
  up to ``MAX_NAME_LABELS`` labels: ``*`` matches one whole label) or by address, on
  ports 80 and 443 (the ports a wide rule may name unless the operator allows more);
- ``allow_internet_access: false`` is no network at all, plus what ``allowOut`` lists;
- ``allowOut`` entries (a domain pattern, an address, a CIDR) become rules on ports 80
  and 443; ``0.0.0.0/0`` (E2B's ALL_TRAFFIC) is ``INTERNET``;
- ``denyOut`` may only be ``["0.0.0.0/0"]`` (deny all but ``allowOut``): a deny-list
  has no SPACE equivalent and is refused rather than ignored.

The result is checked by the egress parser like any policy (400 naming the bad rule).
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING, Any

from space.control.e2b._errors import E2BError

if TYPE_CHECKING:  # _shapes reads policies back with network_info
    from space.control.e2b._shapes import E2BNetwork

__all__ = [
    "ALL_TRAFFIC",
    "INTERNET",
    "MAX_NAME_LABELS",
    "egress_policy",
    "network_info",
    "public_traffic",
]

ALL_TRAFFIC = "0.0.0.0/0"
MAX_NAME_LABELS = 10
INTERNET: tuple[dict[str, Any], ...] = (
    *({"domain": ".".join(["*"] * labels)} for labels in range(1, MAX_NAME_LABELS + 1)),
    {"cidr": "0.0.0.0/0"},
    {"cidr": "::/0"},
)
#: ``network`` fields with no SPACE equivalent, refused unless absent.
_UNSUPPORTED = ("rules", "egressProxy", "dnsServers", "maskRequestHost", "httpsPorts")


def egress_policy(allow_internet_access: bool | None, network: E2BNetwork | None) -> dict[str, Any]:
    """The egress policy (JSON, not yet validated) for E2B's options; E2BError(400)
    for an option SPACE cannot honour."""
    internet = allow_internet_access is not False
    allow: list[str] = []
    if network is not None:
        _refuse_unsupported(network)
        deny = network.denyOut or []
        if any(entry != ALL_TRAFFIC for entry in deny):
            raise E2BError(
                400,
                "network.denyOut: only 0.0.0.0/0 (deny all but allowOut) is supported: "
                "SPACE egress policies are allow-lists",
            )
        internet = internet and not deny
        allow = list(network.allowOut or [])
    if ALL_TRAFFIC in allow:
        internet = True
        allow = [entry for entry in allow if entry != ALL_TRAFFIC]
    rules = [_rule(entry) for entry in allow]
    return {"allow": [*INTERNET, *rules] if internet else rules}


def _refuse_unsupported(network: E2BNetwork) -> None:
    for name in _UNSUPPORTED:
        if getattr(network, name) is not None:
            raise E2BError(400, f"network.{name} is not supported by SPACE")


def public_traffic(network: E2BNetwork | None) -> bool:
    """Whether a sandbox's ports take requests without its traffic token: only when
    ``network.allowPublicTraffic`` is true. Omitted, E2B applies the project's default;
    SPACE's is the token (space.control.ports)."""
    return network is not None and network.allowPublicTraffic is True


def _rule(entry: str) -> dict[str, str]:
    """A CIDR rule for an address or network, else a domain rule."""
    try:
        return {"cidr": str(ipaddress.ip_network(entry))}
    except ValueError:
        return {"domain": entry}


def _target(rule: dict[str, Any]) -> str:
    return str(rule.get("domain") or rule.get("cidr"))


def network_info(policy: dict[str, Any] | None) -> tuple[bool, dict[str, list[str]]]:
    """How E2B reads a sandbox's (canonical) policy: whether it has internet access (all
    of ``INTERNET``), and ``network`` with the other rules as ``allowOut`` (without
    internet access, ``denyOut`` is all traffic)."""
    targets = [_target(rule) for rule in (policy or {}).get("allow", [])]
    internet = {_target(rule) for rule in INTERNET} <= set(targets)
    others = [t for t in targets if not internet or t not in {_target(r) for r in INTERNET}]
    return internet, {"allowOut": others, "denyOut": [] if internet else [ALL_TRAFFIC]}
