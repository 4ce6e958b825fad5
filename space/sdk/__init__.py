"""The SPACE Python SDK: sandboxes (sync and async), their commands, files, snapshots
and network, templates, and secrets.

    from space import Sandbox

    with Sandbox.create() as sbx:
        print(sbx.commands.run("python3 -c 'print(6 * 7)'").stdout)

The API URL and key come from ``api_url=``/``api_key=``, else SPACE_API_URL /
SPACE_API_KEY. Each classmethod call above opens its own connection; ``Space`` (or
``AsyncSpace``) holds one that many calls share:

    from space import Space

    with Space(api_key=key) as space, space.sandboxes.create() as sbx:
        print(space.templates.list(), sbx.commands.run("uname -r").stdout)

Errors are ``space.sdk.errors.SpaceError`` and its leaves.
"""

from __future__ import annotations

from space.sdk._client import AsyncSpace
from space.sdk._commands import AsyncCommandHandle, AsyncCommands
from space.sdk._files import AsyncFiles, ByteStream
from space.sdk._http import ConnectionConfig
from space.sdk._metrics import SandboxMetric
from space.sdk._models import (
    CommandResult,
    EgressEvent,
    EgressLog,
    FileInfo,
    PoolInfo,
    PortsInfo,
    ProcessInfo,
    PtySize,
    SandboxInfo,
    SecretBinding,
    SecretInfo,
    SnapshotInfo,
    TemplateInfo,
)
from space.sdk._network import AsyncNetwork, allow
from space.sdk._sandbox import AsyncSandbox
from space.sdk._secrets import AsyncSecrets
from space.sdk._sync import (
    CommandHandle,
    Commands,
    Files,
    Network,
    Sandbox,
    Secrets,
    Space,
    Template,
)
from space.sdk._templates import AsyncTemplate
from space.sdk._watch import AsyncDirWatcher, FilesystemEvent
from space.sdk.errors import (
    AuthenticationError,
    BuildError,
    CommandExitError,
    Conflict,
    InsufficientCapacity,
    InternalError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SpaceError,
    Timeout,
    Unavailable,
)

__all__ = [
    "AsyncCommandHandle",
    "AsyncCommands",
    "AsyncDirWatcher",
    "AsyncFiles",
    "AsyncNetwork",
    "AsyncSandbox",
    "AsyncSecrets",
    "AsyncSpace",
    "AsyncTemplate",
    "AuthenticationError",
    "BuildError",
    "ByteStream",
    "CommandExitError",
    "CommandHandle",
    "CommandResult",
    "Commands",
    "Conflict",
    "ConnectionConfig",
    "EgressEvent",
    "EgressLog",
    "FileInfo",
    "Files",
    "FilesystemEvent",
    "InsufficientCapacity",
    "InternalError",
    "InvalidArgument",
    "Network",
    "NotFound",
    "PermissionDenied",
    "PoolInfo",
    "PortsInfo",
    "ProcessInfo",
    "PtySize",
    "ResourceExhausted",
    "Sandbox",
    "SandboxInfo",
    "SandboxMetric",
    "SecretBinding",
    "SecretInfo",
    "Secrets",
    "SnapshotInfo",
    "Space",
    "SpaceError",
    "Template",
    "TemplateInfo",
    "Timeout",
    "Unavailable",
    "allow",
]
