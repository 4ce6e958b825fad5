"""The exported names of ``space`` and ``space.sdk`` are a deliberate, pinned list."""

from __future__ import annotations

import space
import space.sdk
import space.sdk.errors

SDK_NAMES = {
    "AsyncCommandHandle", "AsyncCommands", "AsyncFiles", "AsyncSandbox", "AsyncTemplate",
    "BuildError", "Template", "TemplateInfo",
    "AuthenticationError", "ByteStream", "CommandExitError", "CommandHandle",
    "CommandResult", "Commands", "Conflict", "ConnectionConfig", "FileInfo", "Files",
    "InternalError", "InvalidArgument", "NotFound", "PermissionDenied", "PoolInfo",
    "ProcessInfo", "ResourceExhausted", "Sandbox", "SandboxInfo", "SnapshotInfo", "SpaceError",
    "Timeout", "Unavailable",
    "AsyncNetwork", "EgressEvent", "Network", "allow",
    "AsyncSecrets", "SecretBinding", "SecretInfo", "Secrets",
    "AsyncSpace", "Space",
}  # fmt: skip

TOP_NAMES = {
    "AsyncSandbox", "AuthenticationError", "CommandExitError", "CommandHandle",
    "CommandResult", "Conflict", "FileInfo", "InternalError", "InvalidArgument", "NotFound",
    "PermissionDenied", "ProcessInfo", "ResourceExhausted", "Sandbox", "SandboxInfo",
    "SpaceError", "Timeout", "Unavailable",
    "AsyncSpace", "Space",
}  # fmt: skip


def test_space_sdk_exports_exactly_the_pinned_names() -> None:
    assert set(space.sdk.__all__) == SDK_NAMES
    assert all(hasattr(space.sdk, name) for name in SDK_NAMES)


def test_space_exports_exactly_the_pinned_names() -> None:
    assert set(space.__all__) == TOP_NAMES
    assert all(getattr(space, n) is getattr(space.sdk, n) for n in TOP_NAMES)


def test_exported_classes_claim_the_public_module_not_a_private_one() -> None:
    # Users see space.sdk names; private modules stay an implementation detail.
    for name in SDK_NAMES:
        module = getattr(space.sdk, name).__module__
        assert module == "space.sdk.errors" or module.startswith("space.sdk._"), name


def test_every_sdk_error_derives_from_space_error() -> None:
    for name in space.sdk.errors.__all__:
        assert issubclass(getattr(space.sdk.errors, name), space.sdk.errors.SpaceError)
