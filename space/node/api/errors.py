"""Errors raised by node services.

    NodeError                  root; ``code`` is the stable wire/API code
    ├── NotFound               unknown sandbox, file, process or template
    ├── Conflict               already exists, or not allowed in the current state
    ├── InvalidArgument        a request the node or guest refused as malformed
    ├── PermissionDenied       the guest refused a file or process operation
    ├── ResourceExhausted      a limit was hit (streams, disk, memory, sandboxes)
    ├── Timeout                an operation did not finish within its deadline
    ├── Unavailable            the VM or its channel is down or broken
    └── GuestError             the guest answered with an error we have no leaf for

The control plane maps ``code`` to HTTP in one table (space/control/errors.py).
"""

from __future__ import annotations

__all__ = [
    "Conflict",
    "GuestError",
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
    def details(self) -> dict[str, str]:
        """What an HTTP error answer carries besides code and message."""
        return {"sandbox_id": self.sandbox_id} if self.sandbox_id else {}


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
    "resource_exhausted": ResourceExhausted,
    "timeout": Timeout,
    "unsupported": InvalidArgument,
}


def error_for_code(code: str, message: str, *, sandbox_id: str | None = None) -> NodeError:
    """Build the node error for a guest's wire error code (unknown codes: GuestError)."""
    leaf = _GUEST_CODES.get(code, GuestError)
    # The guest's code stays in the message only where the leaf's own code loses it.
    text = message if leaf.code == code else f"{code}: {message}"
    return leaf(text, sandbox_id=sandbox_id)
