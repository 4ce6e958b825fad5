"""The artifact store (issue 19): snapshots and hibernated sandboxes kept off the node,
so they can be restored on any node and survive the loss of the one that made them.

- ``ArtifactStore``: the interface (async, streamed both ways) and its errors and name
  rules (``_store``); backends ``FilesystemStore`` (a directory; ``_fs``) and
  ``S3Store`` (a bucket through boto3; ``_s3``);
- ``SealedStore``: any store with every object sealed under its own data key, wrapped
  under the cluster's ``MasterKey`` (``_sealed``, on space.node.vmm.sealed_state);
- bundles: a sandbox's artifacts as parts plus a manifest written last, restorable only
  when complete (``_bundles``);
- ``open_artifact_store``: the sealed store a NodeConfig describes (``_open``).

The node layer only: the control plane does not import it. Nothing on the node uses it
yet (snapshot, hibernate and restore are to be wired to it).
"""

from __future__ import annotations

from space.node.artifacts._bundles import (
    MAX_PARTS,
    Bundle,
    Manifest,
    PartInfo,
    bundle_complete,
    delete_bundle,
    get_bundle,
    put_bundle,
    read_manifest,
)
from space.node.artifacts._fs import FilesystemStore
from space.node.artifacts._open import open_artifact_store
from space.node.artifacts._s3 import S3Settings, S3Store
from space.node.artifacts._sealed import MasterKey, SealedStore
from space.node.artifacts._store import (
    MAX_NAME_BYTES,
    ArtifactStore,
    BundleIncomplete,
    ChecksumMismatch,
    InvalidName,
    NotAuthentic,
    ObjectInfo,
    ObjectTooLarge,
    StoreUnavailable,
    WrongMasterKey,
    check_name,
)

__all__ = [
    "MAX_NAME_BYTES",
    "MAX_PARTS",
    "ArtifactStore",
    "Bundle",
    "BundleIncomplete",
    "ChecksumMismatch",
    "FilesystemStore",
    "InvalidName",
    "Manifest",
    "MasterKey",
    "NotAuthentic",
    "ObjectInfo",
    "ObjectTooLarge",
    "PartInfo",
    "S3Settings",
    "S3Store",
    "SealedStore",
    "StoreUnavailable",
    "WrongMasterKey",
    "bundle_complete",
    "check_name",
    "delete_bundle",
    "get_bundle",
    "open_artifact_store",
    "put_bundle",
    "read_manifest",
]
