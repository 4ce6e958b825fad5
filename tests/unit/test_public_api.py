"""The exported names of ``space`` and ``space.sdk`` are a deliberate, pinned list."""

from __future__ import annotations

import space
import space.node.api
import space.node.artifacts
import space.sdk
import space.sdk.errors

SDK_NAMES = {
    "AsyncCommandHandle", "AsyncCommands", "AsyncDirWatcher", "AsyncFiles", "FilesystemEvent",
    "AsyncSandbox", "AsyncTemplate",
    "BuildError", "Template", "TemplateInfo",
    "AuthenticationError", "ByteStream", "CommandExitError", "CommandHandle",
    "CommandResult", "Commands", "Conflict", "ConnectionConfig", "FileInfo", "Files",
    "InsufficientCapacity", "InternalError", "InvalidArgument", "NotFound", "PermissionDenied",
    "PoolInfo", "ProcessInfo", "PtySize", "ResourceExhausted", "Sandbox", "SandboxInfo",
    "SnapshotInfo", "SpaceError", "Timeout", "Unavailable",
    "AsyncNetwork", "EgressEvent", "EgressLog", "Network", "allow",
    "AsyncSecrets", "SecretBinding", "SecretInfo", "Secrets",
    "AsyncSpace", "Space",
    "SandboxMetric", "PortsInfo",
}  # fmt: skip

TOP_NAMES = {
    "AsyncSandbox", "AuthenticationError", "CommandExitError", "CommandHandle",
    "CommandResult", "Conflict", "FileInfo", "InsufficientCapacity", "InternalError",
    "InvalidArgument", "NotFound", "PermissionDenied", "ProcessInfo", "ResourceExhausted",
    "Sandbox", "SandboxInfo", "SpaceError", "Timeout", "Unavailable",
    "AsyncSpace", "Space",
}  # fmt: skip


#: The node's contract: all the control plane may use of a node (tests/unit/test_layers.py).
NODE_API_NAMES = {
    "BUILD_ID_HEADER", "BuildEvent", "BuildFailed", "BuildLog", "BuildStream", "ERROR_BY_CODE",
    "BuildSucceeded", "CapacityInfo", "CidrRule", "Conflict", "DomainRule", "EgressEvent",
    "ConnectionRefused", "PortTunnel", "MAX_TUNNEL_CHUNK_BYTES",
    "EgressLog",
    "EgressPolicy", "ExecEvent", "ExecExited", "ExecOutput", "ExecRequest", "ExecStream",
    "ExportTicket", "ImportResult", "TemplateImport", "TemplateTicket",
    "FILE_STAT_HEADER", "FileReader", "FileStat", "GuestError", "InsufficientCapacity",
    "InvalidArgument", "MAX_BUILD_LOG_BYTES", "MAX_EGRESS_LOG_EVENTS", "MAX_FORK_CHILDREN",
    "MAX_GRANTS", "NDJSON", "NODE_API_PREFIX", "NodeError", "NodeInfo", "NodeService", "NotFound",
    "PermissionDenied", "PolicyBounds", "PoolInfo", "ProcessInfo", "ProcessSelector", "PtySize",
    "ResourceExhausted",
    "STATUS_BY_CODE", "WatchEvent", "WatchStream", "decode_watch_event", "watch_lines",
    "SandboxSpec", "SandboxState", "SandboxStatus", "SecretGrant", "SnapshotInfo", "TENANT_PREFIX",
    "TemplateInfo", "Timeout", "Unavailable", "Verdict", "blocked_category",
    "build_event_line", "build_lines", "check_grants", "check_header_name",
    "check_host_patterns", "check_secret_name", "check_secret_value", "closed_policy",
    "decode", "decode_build_event", "decode_child_ids", "decode_egress_policy",
    "decode_exec_request", "decode_grants", "decode_pty_size", "decode_snapshot_id",
    "decode_templates",
    "encode", "encode_exec_request", "encode_grants", "encode_templates", "error_for_code",
    "error_line", "event_line", "host_addresses", "host_matches", "ndjson_lines", "normalize_name",
    "parse_ip_literal", "snapshot_archive",
    "MAX_METRICS_SAMPLES", "METRICS_INTERVAL_S", "SandboxMetrics", "EGRESS_DECISIONS",
    "GUEST_CHOICES", "GUEST_TYPES",
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


def test_the_node_contract_exports_exactly_the_pinned_names() -> None:
    assert set(space.node.api.__all__) == NODE_API_NAMES
    assert all(hasattr(space.node.api, name) for name in NODE_API_NAMES)


#: The artifact store (issue 19): the node layer's, not the control plane's.
ARTIFACT_NAMES = {
    "MAX_NAME_BYTES", "MAX_PARTS", "ArtifactStore", "Bundle", "BundleIncomplete",
    "ChecksumMismatch", "FilesystemStore", "InvalidName", "Manifest", "MasterKey",
    "NotAuthentic", "ObjectInfo", "ObjectTooLarge", "PartInfo", "S3Settings", "S3Store",
    "SealedStore", "StoreUnavailable", "WrongMasterKey", "bundle_complete", "check_name",
    "delete_bundle", "get_bundle", "open_artifact_store", "put_bundle", "read_manifest",
}  # fmt: skip


def test_the_artifact_store_exports_exactly_the_pinned_names_all_errors_node_errors() -> None:
    artifacts = space.node.artifacts
    assert set(artifacts.__all__) == ARTIFACT_NAMES
    errors = [getattr(artifacts, n) for n in ARTIFACT_NAMES]
    for error in [e for e in errors if isinstance(e, type) and issubclass(e, Exception)]:
        assert issubclass(error, space.node.api.NodeError), error
