"""The node options that matter once there are several nodes (issue 19): the node key
they share, the CA they verify each other with, and the artifact store they keep
snapshots and hibernated sandboxes in. ``space serve`` and ``space node`` both take them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click

__all__ = ["cluster_files", "cluster_options", "cluster_settings"]

_FILE = click.Path(dir_okay=False, path_type=Path)


def cluster_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add the options; the command passes what it got to ``cluster_settings``."""
    options = (
        click.option(
            "--node-key-file", "key_file", type=_FILE, default=None,
            help="The node key sealing disks and saved memory (default: DATA_DIR/node.key)."
            " Nodes that move sandboxes between them must share it.",
        ),
        click.option(
            "--peer-ca-file", type=_FILE, default=None,
            help="CA bundle other nodes' TLS certificates (a sandbox or template is pulled"
            " from them) and an https control plane's are verified with (default: the"
            " system's).",
        ),
        click.option(
            "--artifact-store", default=None, metavar="URL",
            help="Where snapshots and hibernated sandboxes are also kept, so they restore on"
            " any node: file:///shared/dir or s3://bucket (default: none).",
        ),
        click.option(
            "--artifact-s3-endpoint", default=None, metavar="URL",
            help="An S3-compatible endpoint, http(s)://host[:port] (default: AWS).",
        ),
        click.option("--artifact-s3-region", default="us-east-1", show_default=True),
        click.option(
            "--artifact-s3-credentials-file", type=_FILE, default=None,
            help="Owner-only file of two lines: access key id, secret key"
            " (default: boto3's own chain, e.g. AWS_ACCESS_KEY_ID).",
        ),
        click.option(
            "--artifact-key-file", type=_FILE, default=None,
            help="The store's master key, the same file on every node"
            " (default: DATA_DIR/artifact.key, made if absent).",
        ),
    )  # fmt: skip
    for option in reversed(options):
        command = option(command)
    return command


def cluster_settings(options: dict[str, Any]) -> dict[str, Any]:
    """Take the options ``cluster_options`` added out of ``options`` (a command's keyword
    arguments) and answer them as NodeConfig keyword arguments. Raises click.BadParameter
    for an artifact store URL or setting that does not hold."""
    from space.node.api import InvalidArgument
    from space.node.core.config import ArtifactStoreConfig

    url = options.pop("artifact_store")
    s3 = {
        "s3_endpoint_url": options.pop("artifact_s3_endpoint"),
        "s3_region": options.pop("artifact_s3_region"),
        "s3_credentials_file": options.pop("artifact_s3_credentials_file"),
    }
    settings: dict[str, Any] = {
        "key_file": options.pop("key_file"),
        "peer_ca_file": options.pop("peer_ca_file"),
        "artifact_key_file": options.pop("artifact_key_file"),
    }
    if url is None:
        if s3["s3_endpoint_url"] or s3["s3_credentials_file"]:
            raise click.BadParameter("the --artifact-s3-* options need --artifact-store s3://…")
        return settings
    parts = urlsplit(url)
    try:
        if parts.scheme == "file" and not parts.netloc and not s3["s3_endpoint_url"]:
            store = ArtifactStoreConfig(kind="fs", path=Path(parts.path))
        elif parts.scheme == "s3" and not parts.path.strip("/"):
            store = ArtifactStoreConfig(kind="s3", s3_bucket=parts.netloc, **s3)
        else:
            raise InvalidArgument("file:///absolute/dir or s3://bucket")
    except InvalidArgument as exc:
        raise click.BadParameter(str(exc), param_hint="--artifact-store") from None
    return {**settings, "artifact_store": store}


def cluster_files(settings: dict[str, Any]) -> tuple[Path, ...]:
    """The files of ``cluster_settings``' answer that the node agent reads after it
    drops root (so its user must be able to), those that exist already."""
    store = settings.get("artifact_store")
    paths = (
        settings["key_file"],
        settings["peer_ca_file"],
        settings["artifact_key_file"],
        None if store is None else store.s3_credentials_file,
    )
    return tuple(path for path in paths if path is not None and path.exists())
