"""The artifact store's settings in NodeConfig, checked before anything starts, and the
sealed store a node opens from them (space/node/artifacts/_open.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from space.node.api import InvalidArgument
from space.node.artifacts import (
    FilesystemStore,
    S3Store,
    SealedStore,
    WrongMasterKey,
    open_artifact_store,
)
from space.node.core.config import ArtifactStoreConfig, NodeConfig
from space.node.core.keys import KeyFileError
from tests.unit._artifacts import pieces, read

pytestmark = pytest.mark.anyio


def test_no_store_is_the_default_and_the_key_file_sits_in_the_data_dir(tmp_path: Path) -> None:
    config = NodeConfig(data_dir=tmp_path)
    assert config.artifact_store is None
    assert open_artifact_store(config) is None
    assert not (tmp_path / "artifact.key").exists()  # no store, no key made
    assert config.effective_artifact_key_file == tmp_path / "artifact.key"
    chosen = NodeConfig(data_dir=tmp_path, artifact_key_file=Path("/etc/space/artifact.key"))
    assert chosen.effective_artifact_key_file == Path("/etc/space/artifact.key")


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"kind": "ftp"}, "kind"),
        ({"kind": "fs"}, "absolute path"),
        ({"kind": "fs", "path": Path("relative")}, "absolute path"),
        ({"kind": "fs", "path": Path("/a"), "s3_bucket": "b-1"}, "no s3_"),
        ({"kind": "s3"}, "bucket"),
        ({"kind": "s3", "s3_bucket": "Upper"}, "bucket"),
        ({"kind": "s3", "s3_bucket": "ab"}, "bucket"),
        ({"kind": "s3", "s3_bucket": "b-1", "path": Path("/a")}, "no path"),
        ({"kind": "s3", "s3_bucket": "b-1", "s3_endpoint_url": "ftp://x"}, "s3_endpoint_url"),
        ({"kind": "s3", "s3_bucket": "b-1", "s3_endpoint_url": "http://h/p"}, "endpoint"),
        ({"kind": "s3", "s3_bucket": "b-1", "s3_region": "US EAST"}, "s3_region"),
        ({"kind": "s3", "s3_bucket": "b-1", "s3_part_mib": 4}, "s3_part_mib"),
        ({"kind": "s3", "s3_bucket": "b-1", "s3_part_mib": 5121}, "s3_part_mib"),
        ({"kind": "fs", "path": Path("/a"), "max_object_gib": 0}, "max_object_gib"),
        ({"kind": "fs", "path": Path("/a"), "max_object_gib": True}, "max_object_gib"),
    ],
)
def test_negative_bad_store_settings_are_refused_naming_the_setting(
    settings: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidArgument, match=named):
        ArtifactStoreConfig(**settings)


def test_negative_a_node_config_takes_only_store_settings(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="artifact_store"):
        NodeConfig(data_dir=tmp_path, artifact_store={"kind": "fs"})  # type: ignore[arg-type]


def test_the_bounds_of_the_s3_part_size_are_taken() -> None:
    for part in (5, 5120):
        assert ArtifactStoreConfig(kind="s3", s3_bucket="b-1", s3_part_mib=part).s3_part_mib == part


async def test_two_nodes_with_one_key_file_read_each_others_objects(tmp_path: Path) -> None:
    shared = ArtifactStoreConfig(kind="fs", path=tmp_path / "shared")
    key_file = tmp_path / "cluster" / "artifact.key"
    first = open_artifact_store(
        NodeConfig(data_dir=tmp_path / "n1", artifact_store=shared, artifact_key_file=key_file)
    )
    assert isinstance(first, SealedStore) and isinstance(first.inner, FilesystemStore)
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"  # made at first use
    await first.put("snapshots/s1/disk", pieces(b"disk bytes"))
    second = open_artifact_store(
        NodeConfig(data_dir=tmp_path / "n2", artifact_store=shared, artifact_key_file=key_file),
        create_key=False,
    )
    assert second is not None
    assert await read(second, "snapshots/s1/disk") == b"disk bytes"
    # A node with a key of its own (the default file in its data dir) reads nothing.
    stranger = open_artifact_store(NodeConfig(data_dir=tmp_path / "n3", artifact_store=shared))
    assert stranger is not None and (tmp_path / "n3" / "artifact.key").exists()
    with pytest.raises(WrongMasterKey):
        await read(stranger, "snapshots/s1/disk")


def test_negative_a_key_file_that_holds_no_key_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.key"
    bad.write_text("not base64!\n")
    bad.chmod(0o600)
    store = ArtifactStoreConfig(kind="fs", path=tmp_path / "s")
    with pytest.raises(KeyFileError, match="not one base64 key"):
        open_artifact_store(
            NodeConfig(data_dir=tmp_path, artifact_store=store, artifact_key_file=bad)
        )


def test_negative_a_missing_key_file_is_not_made_when_told_not_to(tmp_path: Path) -> None:
    config = NodeConfig(
        data_dir=tmp_path, artifact_store=ArtifactStoreConfig(kind="fs", path=tmp_path / "s")
    )
    with pytest.raises(KeyFileError, match="missing"):
        open_artifact_store(config, create_key=False)


def _s3_config(tmp_path: Path, credentials: str | None, mode: int = 0o600) -> NodeConfig:
    path = None
    if credentials is not None:
        path = tmp_path / "s3.credentials"
        path.write_text(credentials)
        path.chmod(mode)
    store = ArtifactStoreConfig(
        kind="s3",
        s3_bucket="b-1",
        s3_endpoint_url="http://127.0.0.1:9",
        s3_region="eu-west-1",
        s3_credentials_file=path,
        s3_part_mib=16,
    )
    return NodeConfig(data_dir=tmp_path, artifact_store=store)


def test_an_s3_store_takes_its_credentials_from_an_owner_only_file(tmp_path: Path) -> None:
    store = open_artifact_store(_s3_config(tmp_path, "AKID\nsecret/key+1\n"))
    assert store is not None and isinstance(store.inner, S3Store)
    inner = store.inner
    assert (inner.settings.access_key_id, inner.settings.secret_access_key) == (
        "AKID",
        "secret/key+1",
    )
    assert inner.settings.part_bytes == 16 << 20 and inner.settings.region == "eu-west-1"
    assert "secret/key" not in repr(inner.settings) and "secret/key" not in repr(store)


@pytest.mark.parametrize(
    ("text", "mode", "match"),
    [("AKID\n", 0o600, "two lines"), ("a\nb\nc\n", 0o600, "two lines"), ("a\nb\n", 0o644, "chmod")],
)
def test_negative_bad_s3_credentials_files_are_refused(
    tmp_path: Path, text: str, mode: int, match: str
) -> None:
    with pytest.raises(InvalidArgument, match=match):
        open_artifact_store(_s3_config(tmp_path, text, mode))
