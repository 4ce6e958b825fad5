"""Errors raised by the SPACE SDK.

Everything the SDK raises on purpose derives from ``SpaceError``; no httpx, OSError or
JSON exception crosses the public API (connection failures, protocol errors and client
deadlines are translated here).

    SpaceError                 root; carries code, status_code, sandbox_id, operation
    ├── NotFound               404 not_found: unknown sandbox, process, file, template
    ├── Conflict               409 conflict: already exists, wrong state
    ├── InvalidArgument        422 invalid_argument (and 400): malformed or out of range
    ├── AuthenticationError    401 unauthenticated: missing or unknown API key
    ├── PermissionDenied       403 permission_denied: the guest refused
    ├── ResourceExhausted      429 resource_exhausted: a quota or size limit was hit
    ├── Timeout                504 timeout, or a client-side deadline passed
    ├── Unavailable            503 unavailable, or the API could not be reached
    │   └── InsufficientCapacity   503 capacity: no node has room now; retry later
    ├── InternalError          500 internal, or an answer the SDK cannot understand
    ├── CommandExitError       a command exited non-zero and ``check=True`` was asked
    └── BuildError             a template build failed: ``step`` and the node's message

``_ERROR_TABLE`` is the one table from HTTP status / wire code to class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from space.sdk._models import CommandResult

__all__ = [
    "AuthenticationError",
    "BuildError",
    "CommandExitError",
    "Conflict",
    "InsufficientCapacity",
    "InternalError",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "SpaceError",
    "Timeout",
    "Unavailable",
]


class SpaceError(Exception):
    """Root of every SDK error.

    ``code`` is the wire error code (``"not_found"``...), ``status_code`` the HTTP status
    when the error came from an answer, ``operation`` what the SDK was doing
    (``"commands.run"``), ``sandbox_id`` the sandbox concerned, ``message`` the server's
    (or the SDK's) own words.
    """

    code = "internal"

    def __init__(
        self,
        message: str,
        *,
        sandbox_id: str | None = None,
        operation: str | None = None,
        status_code: int | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.sandbox_id = sandbox_id
        self.operation = operation
        self.status_code = status_code
        self.details = details or {}

    def __str__(self) -> str:
        context = [
            f"{name}={value}"
            for name, value in (
                ("operation", self.operation),
                ("sandbox", self.sandbox_id),
                ("status", self.status_code),
            )
            if value is not None
        ]
        suffix = f" ({', '.join(context)})" if context else ""
        return f"{self.message}{suffix}"


class NotFound(SpaceError):
    code = "not_found"


class Conflict(SpaceError):
    code = "conflict"


class InvalidArgument(SpaceError):
    code = "invalid_argument"


class AuthenticationError(SpaceError):
    code = "unauthenticated"


class PermissionDenied(SpaceError):
    code = "permission_denied"


class ResourceExhausted(SpaceError):
    """A quota or size limit was hit; nothing was made or changed.

    For a tenant's quota (``GET /v1/quota``), ``quota`` names it, ``limit`` and ``used``
    are its limit and what the tenant holds, ``requested`` what the refused request
    asked for (all in the quota's unit); None for other limits.
    """

    code = "resource_exhausted"

    @property
    def quota(self) -> str | None:
        value = self.details.get("quota")
        return value if isinstance(value, str) else None

    @property
    def limit(self) -> int | None:
        return _whole(self.details.get("limit"))

    @property
    def used(self) -> int | None:
        return _whole(self.details.get("used"))

    @property
    def requested(self) -> int | None:
        return _whole(self.details.get("requested"))


def _whole(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class Timeout(SpaceError):
    code = "timeout"


class Unavailable(SpaceError):
    code = "unavailable"


class InsufficientCapacity(Unavailable):
    """No node has room for the sandbox now (nothing was created); try again later.

    ``resource`` names what ran short (``memory``, ``committed_memory``, ``pool`` or
    ``sandboxes``), ``retry_after_s`` when to try again (the answer's Retry-After);
    ``details`` also holds ``needed`` and ``available`` in ``details["unit"]``.
    """

    code = "capacity"

    @property
    def resource(self) -> str | None:
        value = self.details.get("resource")
        return value if isinstance(value, str) else None

    @property
    def retry_after_s(self) -> int | None:
        value = self.details.get("retry_after_s")
        return value if isinstance(value, int) and not isinstance(value, bool) else None


class InternalError(SpaceError):
    code = "internal"


class CommandExitError(SpaceError):
    """A command finished unsuccessfully: non-zero exit, a signal, or its timeout.

    ``result`` is the whole CommandResult (stdout, stderr, exit_code, signal, timed_out).
    """

    code = "command_exit"

    def __init__(self, result: CommandResult, *, sandbox_id: str | None = None) -> None:
        if result.timed_out:
            what = "timed out"
        elif result.signal is not None:
            what = f"was killed by signal {result.signal}"
        else:
            what = f"exited with code {result.exit_code}"
        super().__init__(f"command {what}", sandbox_id=sandbox_id, operation="commands.run")
        self.result = result
        self.exit_code = result.exit_code
        self.signal = result.signal
        self.stdout = result.stdout
        self.stderr = result.stderr


class BuildError(SpaceError):
    """A template build failed after it started; the template's tag is unchanged.

    ``step`` is the failing step's position in the build plan (from 0; None when no
    step failed, e.g. the node went away), ``error_code`` the wire code of the failure
    (``build_failed`` for a failing step), ``message`` the node's words.
    """

    code = "build_failed"

    def __init__(self, message: str, *, step: int | None, error_code: str) -> None:
        where = f"step {step}: " if step is not None else ""
        super().__init__(f"{where}{message}", operation="template.build")
        self.step = step
        self.error_code = error_code
        self.build_message = message


# The one table. A wire code decides when the body has one; the status decides for answers
# without a readable error body (a proxy's 502, an HTML error page).
_ERROR_TABLE: tuple[tuple[int, str | None, type[SpaceError]], ...] = (
    (400, None, InvalidArgument),
    (401, "unauthenticated", AuthenticationError),
    (403, "permission_denied", PermissionDenied),
    (404, "not_found", NotFound),
    (409, "conflict", Conflict),
    (422, "invalid_argument", InvalidArgument),
    (429, "resource_exhausted", ResourceExhausted),
    (500, "internal", InternalError),
    (502, None, Unavailable),
    # A bare 503 (no readable code) is Unavailable: the last row of a status decides.
    (503, "capacity", InsufficientCapacity),
    (503, "unavailable", Unavailable),
    (504, "timeout", Timeout),
)
_BY_CODE = {code: cls for _, code, cls in _ERROR_TABLE if code is not None}
_BY_STATUS = {status: cls for status, _, cls in _ERROR_TABLE}


def error_class(*, code: str | None, status_code: int | None) -> type[SpaceError]:
    """The class for a wire code, else for an HTTP status, else InternalError."""
    if code is not None and code in _BY_CODE:
        return _BY_CODE[code]
    if status_code is not None:
        return _BY_STATUS.get(status_code, InternalError)
    return InternalError
