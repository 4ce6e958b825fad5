"""SPACE: a Sandboxed Platform for Agentic Code Execution.

The top-level package re-exports the SDK; the server side lives in ``space.control``
and ``space.node`` and is imported only by the ``space serve`` / ``space node`` commands.

The SDK is imported on first use of a name here, not with the package: a process that
needs only ``space.protocol`` (a gVisor sandbox's channel relay, one per sandbox) stays
small and starts fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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


def __getattr__(name: str) -> object:
    if name in __all__:
        return getattr(importlib.import_module("space.sdk"), name)
    raise AttributeError(f"module 'space' has no attribute {name!r}")
