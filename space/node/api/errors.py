"""Errors raised by node services.

    NodeError                  root; ``code`` is the stable wire/API code
    ├── NotFound               unknown sandbox, file, process or template
    ├── Conflict               already exists, or not allowed in the current state
    ├── InvalidArgument        a request the node or guest refused as malformed
    ├── PermissionDenied       the guest refused a file or process operation
    ├── ResourceExhausted      a limit was hit (streams, disk, memory, sandboxes)
    ├── Timeout                an operation did not finish within its deadline
    ├── Unavailable            the VM or its channel is down or broken
    │   ├── InsufficientCapacity   no room now for another VM (memory, pool, cap)
    │   └── ConnectionRefused      nothing listens on a sandbox's port (open_port)
    └── GuestError             the guest answered with an error we have no leaf for

``code`` maps to HTTP in one table (space.node.api.wire.STATUS_BY_CODE), and
``details`` is what an HTTP error answer carries besides code and message; an error
rebuilt from an answer (space.node.http) comes from ``from_answer``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "ERROR_BY_CODE",
    "Conflict",
    "ConnectionRefused",
    "GuestError",
    "InsufficientCapacity",
    "InvalidArgument",
    "NodeError",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "Timeout",
    "Unavailable",
    "error_for_code",
]


class NodeError(Exception):
    code = "internal"

    def __init__(self, message: str, *, sandbox_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.sandbox_id = sandbox_id

    @property
    def details(self) -> dict[str, Any]:
        """What an HTTP error answer carries besides code and message."""
        return {"sandbox_id": self.sandbox_id} if self.sandbox_id else {}

    @classmethod
    def from_answer(
        cls, message: str, details: Mapping[str, Any], *, sandbox_id: str | None
    ) -> NodeError:
        """The error an HTTP error answer of this class's code stands for."""
        return cls(message, sandbox_id=sandbox_id)


class NotFound(NodeError):
    code = "not_found"


class Conflict(NodeError):
    code = "conflict"


class InvalidArgument(NodeError):
    code = "invalid_argument"


class PermissionDenied(NodeError):
    code = "permission_denied"


class ResourceExhausted(NodeError):
    code = "resource_exhausted"


class Timeout(NodeError):
    code = "timeout"


class Unavailable(NodeError):
    code = "unavailable"


#: When to try again after a capacity refusal: room comes back as sandboxes are deleted
#: or hibernated, which no node can foresee; half a minute is a polite default.
_RETRY_AFTER_S = 30


class InsufficientCapacity(Unavailable):
    """The node has no room now for the VMs asked for: nothing was started.

    ``resource`` is what ran short: ``memory`` (host memory available now, less the
    reserve and what starts in flight hold), ``committed_memory`` (what the live VMs may
    grow to, against the overcommit limit), ``pool`` (free space in the btrfs pool, less
    its reserve) or ``sandboxes`` (the operator's cap). ``needed`` and ``available`` are
    in ``unit`` (``MiB`` or ``sandboxes``); ``retry_after_s`` is a hint, not a promise.
    Answered as HTTP 503 with a Retry-After header (space.node.api.http_errors).
    """

    code = "capacity"

    def __init__(
        self,
        message: str,
        *,
        sandbox_id: str | None = None,
        resource: str = "",
        needed: int = 0,
        available: int = 0,
        unit: str = "MiB",
        retry_after_s: int = _RETRY_AFTER_S,
    ) -> None:
        super().__init__(message, sandbox_id=sandbox_id)
        self.resource = resource
        self.needed = needed
        self.available = available
        self.unit = unit
        self.retry_after_s = retry_after_s

    @property
    def details(self) -> dict[str, Any]:
        return super().details | {
            "resource": self.resource,
            "needed": self.needed,
            "available": self.available,
            "unit": self.unit,
            "retry_after_s": self.retry_after_s,
        }

    @classmethod
    def from_answer(
        cls, message: str, details: Mapping[str, Any], *, sandbox_id: str | None
    ) -> NodeError:
        """Rebuilt from the answer's details; a malformed detail takes its default."""

        def number(name: str, default: int) -> int:
            value = details.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            return default

        return cls(
            message,
            sandbox_id=sandbox_id,
            resource=str(details.get("resource", "")),
            needed=number("needed", 0),
            available=number("available", 0),
            unit=str(details.get("unit", "MiB")),
            retry_after_s=max(1, number("retry_after_s", _RETRY_AFTER_S)),
        )


class ConnectionRefused(Unavailable):
    """open_port found nothing listening on the port in the guest (answered 502)."""

    code = "connection_refused"


class GuestError(NodeError):
    code = "internal"


# Wire error codes of the guest (space.protocol.ErrorCode values) to node errors.
_GUEST_CODES: dict[str, type[NodeError]] = {
    "not_found": NotFound,
    "already_exists": Conflict,
    "invalid_argument": InvalidArgument,
    "permission_denied": PermissionDenied,
    "is_a_directory": InvalidArgument,
    "not_a_directory": InvalidArgument,
    "not_empty": Conflict,
    "conflict": Conflict,
    "resource_exhausted": ResourceExhausted,
    "timeout": Timeout,
    "unsupported": InvalidArgument,
    "connection_refused": ConnectionRefused,
}


def error_for_code(code: str, message: str, *, sandbox_id: str | None = None) -> NodeError:
    """Build the node error for a guest's wire error code (unknown codes: GuestError)."""
    leaf = _GUEST_CODES.get(code, GuestError)
    # The guest's code stays in the message only where the leaf's own code loses it.
    text = message if leaf.code == code else f"{code}: {message}"
    return leaf(text, sandbox_id=sandbox_id)


#: The one table of the node's own error codes → node errors (others: NodeError), for
#: every answer that carries one: the HTTP API's, the root broker's.
ERROR_BY_CODE: dict[str, type[NodeError]] = {
    cls.code: cls
    for cls in (
        NotFound,
        Conflict,
        InvalidArgument,
        PermissionDenied,
        ResourceExhausted,
        Timeout,
        Unavailable,
        InsufficientCapacity,
        ConnectionRefused,
    )
}
