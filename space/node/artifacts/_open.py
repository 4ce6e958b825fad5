"""The node's artifact store, as its configuration describes it."""

from __future__ import annotations

from pathlib import Path

from space.keyfile import KeyFileProblem, read_key_file
from space.node.api import InvalidArgument
from space.node.artifacts._fs import FilesystemStore
from space.node.artifacts._s3 import S3Settings, S3Store
from space.node.artifacts._sealed import MasterKey, SealedStore
from space.node.artifacts._store import ArtifactStore
from space.node.core.config import ArtifactStoreConfig, NodeConfig

__all__ = ["open_artifact_store"]

_MAX_CREDENTIALS_BYTES = 4096


def open_artifact_store(config: NodeConfig, *, create_key: bool = True) -> SealedStore | None:
    """The node's sealed artifact store, or None if it has none configured.

    Loads the master key from ``config.effective_artifact_key_file``, made there first
    if absent and ``create_key`` (the first node of a cluster; copy the file to the
    others). Raises KeyFileError or InvalidArgument for unusable key or credentials
    files. Connects to nothing: the first call on the store does.
    """
    settings = config.artifact_store
    if settings is None:
        return None
    master = MasterKey.load(config.effective_artifact_key_file, create=create_key)
    return SealedStore(backend(settings), master)


def backend(settings: ArtifactStoreConfig) -> ArtifactStore:
    """The unsealed backend the settings name."""
    max_bytes = settings.max_object_gib << 30
    if settings.kind == "fs":
        assert settings.path is not None  # checked by ArtifactStoreConfig
        return FilesystemStore(settings.path, max_object_bytes=max_bytes)
    assert settings.s3_bucket is not None
    key_id, secret = _credentials(settings.s3_credentials_file)
    s3 = S3Settings(
        bucket=settings.s3_bucket,
        endpoint_url=settings.s3_endpoint_url,
        region=settings.s3_region,
        access_key_id=key_id,
        secret_access_key=secret,
        part_bytes=settings.s3_part_mib << 20,
    )
    return S3Store(s3, max_object_bytes=max_bytes)


def _credentials(path: Path | None) -> tuple[str | None, str | None]:
    """(access key id, secret key) from an owner-only file of those two lines."""
    if path is None:
        return None, None
    what = "the S3 credentials file"
    try:
        text = read_key_file(path, what=what, max_bytes=_MAX_CREDENTIALS_BYTES).decode()
    except FileNotFoundError:
        raise InvalidArgument(f"cannot open {what} {path}: it is missing") from None
    except (KeyFileProblem, UnicodeDecodeError) as exc:
        raise InvalidArgument(str(exc)) from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) != 2:
        raise InvalidArgument(
            f"{what} {path} must hold two lines (access key id, secret key), not {len(lines)}"
        )
    return lines[0], lines[1]
