"""SPACE: a Sandboxed Platform for Agentic Code Execution.

The top-level package re-exports the SDK; the server side lives in ``space.control``
and ``space.node`` and is imported only by the ``space serve`` / ``space node`` commands.
"""

from __future__ import annotations

from space.sdk import (
    AsyncSandbox,
    AsyncSpace,
    AuthenticationError,
    CommandExitError,
    CommandHandle,
    CommandResult,
    Conflict,
    FileInfo,
    InsufficientCapacity,
    InternalError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ProcessInfo,
    ResourceExhausted,
    Sandbox,
    SandboxInfo,
    Space,
    SpaceError,
    Timeout,
    Unavailable,
)

__all__ = [
    "AsyncSandbox",
    "AsyncSpace",
    "AuthenticationError",
    "CommandExitError",
    "CommandHandle",
    "CommandResult",
    "Conflict",
    "FileInfo",
    "InsufficientCapacity",
    "InternalError",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ProcessInfo",
    "ResourceExhausted",
    "Sandbox",
    "SandboxInfo",
    "Space",
    "SpaceError",
    "Timeout",
    "Unavailable",
]
__version__ = "0.1.0"
