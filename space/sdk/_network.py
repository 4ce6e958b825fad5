"""A sandbox's network: ``sandbox.network`` (async core) and the ``allow`` helper.

A sandbox reaches the network only through its node's egress gateway, which lets
through what its policy allows and logs every decision. The policy is JSON::

    {"allow": [{"domain": "*.example.com", "ports": [443]},
               {"domain": "pypi.org"},
               {"cidr": "203.0.113.0/24", "ports": [5432]}]}

``*`` is one whole label; ports default to [80, 443]; no rules is no network at all
(DNS included). ``allow("pypi.org", "*.github.com:443")`` writes such a policy from
short strings. The server checks every policy and answers InvalidArgument with the
path of the bad item.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Any

from space.limits import MAX_EGRESS_LOG_EVENTS
from space.sdk._http import ApiClient, json_object, listed
from space.sdk._models import EgressEvent, EgressLog
from space.sdk.errors import InternalError, InvalidArgument

__all__ = ["DEFAULT_LOG_LIMIT", "MAX_LOG_LIMIT", "AsyncNetwork", "allow"]

#: How many events ``log()`` returns by default, and at most (the API's bounds).
DEFAULT_LOG_LIMIT = 100
MAX_LOG_LIMIT = MAX_EGRESS_LOG_EVENTS
#: ``host``, ``host:ports``, ``[v6-network]`` or ``[v6-network]:ports``.
_BRACKETED = re.compile(r"^\[(?P<host>[^\[\]]+)\](?::(?P<ports>.*))?$")
_PORTS = re.compile(r"^[0-9]{1,5}(,[0-9]{1,5})*$")


def allow(*rules: str) -> dict[str, Any]:
    """An egress policy allowing each of ``rules``; no rules is no network.

    A rule is a domain (``pypi.org``, ``*.github.com``) or an IP network
    (``203.0.113.0/24``; a single address is its /32 or /128), optionally followed by
    ``:PORT`` or ``:PORT,PORT`` (default 80 and 443). IPv6 networks go in brackets:
    ``[2001:db8::/32]:443``. Raises InvalidArgument for a rule it cannot split (an
    empty host, a bad port, an IPv6 network without brackets); domain names and
    networks themselves are checked by the server.
    """
    return {"allow": [_rule(text) for text in rules]}


def _rule(text: object) -> dict[str, Any]:
    if not isinstance(text, str) or not text or text != text.strip():
        raise InvalidArgument(f"an egress rule is a non-empty string without spaces: {text!r}")
    host, ports = _split(text)
    rule: dict[str, Any] = {"cidr": host} if _is_network(host) else {"domain": host}
    if ports is not None:
        rule["ports"] = _ports(text, ports)
    return rule


def _split(text: str) -> tuple[str, str | None]:
    """(host, ports or None) of a rule; the ports follow the last colon."""
    bracketed = _BRACKETED.match(text)
    if bracketed is not None:
        return _network(text, bracketed["host"]), bracketed["ports"]
    if "[" in text or "]" in text:
        raise InvalidArgument(f"egress rule {text!r}: unbalanced brackets")
    host, colon, ports = text.rpartition(":")
    if not colon:
        return text, None
    if ":" in host:
        raise InvalidArgument(
            f"egress rule {text!r}: more than one colon; an IPv6 network goes in brackets,"
            " e.g. [2001:db8::/32]:443"
        )
    if not host:
        raise InvalidArgument(f"egress rule {text!r}: no host before the port")
    return host, ports


def _network(text: str, host: str) -> str:
    """The IPv6 network written in brackets in ``text``."""
    if ":" not in host:
        raise InvalidArgument(f"egress rule {text!r}: brackets are for IPv6 networks only")
    return host


def _is_network(host: str) -> bool:
    if "/" in host or ":" in host:
        return True
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


def _ports(text: str, ports: str) -> list[int]:
    if not _PORTS.match(ports):
        raise InvalidArgument(f"egress rule {text!r}: ports are numbers like 443 or 80,443")
    numbers = [int(port) for port in ports.split(",")]
    if not all(1 <= port <= 65535 for port in numbers):
        raise InvalidArgument(f"egress rule {text!r}: a port is 1 to 65535")
    return numbers


def _is_int(value: object) -> bool:
    # bool is an int subclass; log(True) is a mistake, not one event.
    return isinstance(value, int) and not isinstance(value, bool)


class AsyncNetwork:
    """``sandbox.network``: the sandbox's egress policy and the log of its decisions."""

    def __init__(self, api: ApiClient, sandbox_id: str) -> None:
        self._api = api
        self._sandbox_id = sandbox_id

    async def get_policy(self) -> dict[str, Any]:
        """The sandbox's egress policy (canonical JSON; ``{"allow": []}``: no network)."""
        body = await self._api.request_json(
            "GET", self._path(), operation="network.get_policy", sandbox_id=self._sandbox_id
        )
        return json_object(body)

    async def set_policy(self, policy: Mapping[str, Any]) -> dict[str, Any]:
        """Replace the egress policy (``allow(...)`` writes one); returns it canonical.

        Takes effect for new connections and DNS queries within a second. Idempotent.
        Raises InvalidArgument (the server's message names the bad item; the old
        policy stays), NotFound. If the sandbox's node fails (Unavailable...), the new
        policy is recorded anyway and reaches the node when the call is repeated.
        """
        body = await self._api.request_json(
            "PUT",
            self._path(),
            operation="network.set_policy",
            sandbox_id=self._sandbox_id,
            json_body=dict(policy),
        )
        return json_object(body)

    async def log(self, limit: int = DEFAULT_LOG_LIMIT) -> EgressLog:
        """The sandbox's latest ``limit`` (1 to 1000) egress decisions, oldest first (a
        sequence), and ``dropped``: how many the node's audit dropped over its budget.

        Raises InvalidArgument for a ``limit`` out of range (nothing is sent), NotFound.
        """
        if not _is_int(limit) or not 1 <= limit <= MAX_LOG_LIMIT:
            raise InvalidArgument(f"limit must be 1 to {MAX_LOG_LIMIT}, got {limit!r}")
        operation = "network.log"
        body = await self._api.request_json(
            "GET",
            self._path("/log"),
            operation=operation,
            sandbox_id=self._sandbox_id,
            params={"limit": str(limit)},
        )
        events = tuple(
            EgressEvent.from_wire(json_object(e)) for e in listed(body, "events", operation)
        )
        # A control plane older than issue 17 answers no count: nothing was dropped.
        dropped = json_object(body).get("dropped", 0)
        if not _is_int(dropped) or dropped < 0:
            raise InternalError(f"malformed drop count in answer: {dropped!r}")
        return EgressLog(events, dropped)

    def _path(self, suffix: str = "") -> str:
        return f"/v1/sandboxes/{self._sandbox_id}/egress{suffix}"
