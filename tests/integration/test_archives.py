"""Snapshots and hibernated sandboxes kept in the artifact store (issue 19), on real
nodes, VMs and btrfs pools, with the store an S3 bucket of a real S3-compatible HTTP
endpoint (moto's server, on loopback): what one node uploads, the other restores.

- a hibernated sandbox with a file and a background process, uploaded by the source,
  is imported by the target from the bundle alone and wakes there with both;
- a snapshot uploaded by the source makes a sandbox on the target, which copies it
  from the store first;
- a bundle not complete, or of another sandbox, is refused and leaves nothing;
- a stored snapshot whose volume is no send stream is refused, saying whether the
  read went wrong (the part is not what its manifest lists) or not.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator

import boto3
import pytest

from space.node.api import (
    InvalidArgument,
    NotFound,
    SandboxSpec,
    SandboxState,
    snapshot_archive,
)
from space.node.artifacts import (
    ArtifactStore,
    ChecksumMismatch,
    delete_bundle,
    get_bundle,
    put_bundle,
)
from space.node.core.config import ArtifactStoreConfig

from ..unit._moto import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY, moto_server
from .moves_nodes import TwoNodes, two_nodes
from .test_moves import _counter, _prepared, _read_all

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with moto_server() as url:
        yield url


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory, s3_endpoint: str) -> Iterator[TwoNodes]:
    """Two nodes and a bucket for the module: starting a node makes its ready state (a
    cold boot), and no test here needs fresh ones (each its own sandbox ids)."""
    tmp_path = tmp_path_factory.mktemp("archives")
    bucket = f"space-{secrets.token_hex(6)}"
    client = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY_ID,
        aws_secret_access_key=SECRET_ACCESS_KEY,
    )
    client.create_bucket(Bucket=bucket)
    credentials = tmp_path / "s3.credentials"
    credentials.write_text(f"{ACCESS_KEY_ID}\n{SECRET_ACCESS_KEY}\n")
    credentials.chmod(0o600)
    store = ArtifactStoreConfig(
        kind="s3", s3_bucket=bucket, s3_endpoint_url=s3_endpoint, s3_credentials_file=credentials
    )
    with two_nodes(tmp_path / "cluster", store) as pair:
        yield pair


def test_a_hibernated_sandbox_restores_from_the_store_on_another_node_with_its_process(
    nodes: TwoNodes, record_property: Callable[[str, object], None]
) -> None:
    sid = "ar-hibernated"
    source, target = nodes.source, nodes.target
    assert nodes.run(source.info()).archives and nodes.run(target.info()).archives
    before = _prepared(nodes, sid)

    start = time.monotonic()
    status = nodes.run(source.archive_sandbox(sid))
    upload_s = time.monotonic() - start
    assert status.state == SandboxState.HIBERNATED
    assert status.archive is not None and status.archive.startswith(f"sandboxes/{sid}/")
    assert nodes.run(source.archive_sandbox(sid)).archive == status.archive  # once

    start = time.monotonic()
    result = nodes.run(target.import_archive(sid, status.archive))
    import_s = time.monotonic() - start
    record_property("upload_s", round(upload_s, 2))
    record_property("import_s", round(import_s, 2))
    print(
        f"\narchive upload {upload_s:.2f} s, import {import_s:.2f} s ({result.stream_bytes} bytes)"
    )
    assert result.status.state == SandboxState.HIBERNATED
    assert result.status.archive == status.archive  # the same sandbox as the bundle, until woken

    data = nodes.run(_read_all(nodes.run(target.read_file(sid, "/home/user/moved.txt"))))
    assert data == b"made on the source"
    woken = nodes.run(target.get_sandbox(sid))
    assert woken.state == SandboxState.RUNNING and woken.archive is None
    after = _counter(nodes, target, sid)
    time.sleep(1.0)
    assert before <= after < _counter(nodes, target, sid)  # the same process, counting on

    # The source's copy is untouched (the control plane decides which goes), and the
    # bundle goes only when asked.
    assert nodes.run(source.get_sandbox(sid)).archive == status.archive
    nodes.run(source.delete_archive(status.archive))
    with pytest.raises(NotFound):
        nodes.run(target.import_archive(sid, status.archive))


def test_a_stored_snapshot_makes_a_sandbox_on_another_node(nodes: TwoNodes) -> None:
    source, target = nodes.source, nodes.target
    sid, snapshot_id = "ar-snap-source", f"sn-{secrets.token_hex(12)}"
    _prepared(nodes, sid)
    info = nodes.run(source.snapshot_sandbox(sid, snapshot_id))
    with pytest.raises(NotFound):
        nodes.run(target.fetch_snapshot(snapshot_id))  # not stored yet
    nodes.run(source.archive_snapshot(snapshot_id))
    nodes.run(source.archive_snapshot(snapshot_id))  # idempotent

    fetched = nodes.run(target.fetch_snapshot(snapshot_id))
    assert (fetched.snapshot_id, fetched.sandbox_id, fetched.memory_mib) == (
        snapshot_id,
        sid,
        info.memory_mib,
    )
    assert snapshot_id in {s.snapshot_id for s in nodes.run(target.list_snapshots())}
    spec = SandboxSpec("ar-snap-child", memory_mib=256, from_snapshot=snapshot_id)
    assert nodes.run(target.create_sandbox(spec)).state == SandboxState.RUNNING
    data = nodes.run(
        _read_all(nodes.run(target.read_file("ar-snap-child", "/home/user/moved.txt")))
    )
    assert data == b"made on the source"
    first = _counter(nodes, target, "ar-snap-child")
    time.sleep(1.0)
    assert _counter(nodes, target, "ar-snap-child") > first  # its process came with it


def test_negative_an_incomplete_or_foreign_bundle_is_refused_and_leaves_nothing(
    nodes: TwoNodes,
) -> None:
    source, target = nodes.source, nodes.target
    sid = "ar-refused"
    _prepared(nodes, sid)
    archive = nodes.run(source.archive_sandbox(sid)).archive
    assert archive is not None
    with pytest.raises(InvalidArgument, match="not an archive of"):
        nodes.run(target.import_archive("ar-other", archive))
    with pytest.raises(InvalidArgument, match="not an archive"):
        nodes.run(target.import_archive(sid, "../etc/passwd"))

    # The manifest names a part the store no longer has: not restorable.
    store = source.archives._store
    assert store is not None
    nodes.run(store.delete(f"{archive}/parts/volume"))
    with pytest.raises(NotFound, match="not complete"):
        nodes.run(target.import_archive(sid, archive))
    with pytest.raises(NotFound):
        nodes.run(target.get_sandbox(sid))
    assert not list((target.pool.root / "incoming").glob("*"))
    assert not target.pool.sandbox_path(sid).exists()


def test_negative_a_stored_snapshot_that_is_no_send_stream_says_where_it_went_wrong(
    nodes: TwoNodes,
) -> None:
    source, target = nodes.source, nodes.target
    sid, snapshot_id = "ar-bad-stream", f"sn-{secrets.token_hex(12)}"
    _prepared(nodes, sid)
    nodes.run(source.snapshot_sandbox(sid, snapshot_id))
    nodes.run(source.archive_snapshot(snapshot_id))
    store = source.archives._store
    assert store is not None
    name = snapshot_archive(snapshot_id)
    bundle = nodes.run(get_bundle(store, name))
    info = nodes.run(_whole(bundle.part("info")))
    size = bundle.manifest.part("volume").size_bytes

    # What is read is not what its manifest lists (the part replaced, at its size).
    nodes.run(store.put(f"{name}/parts/volume", _one(bytes(size))))
    with pytest.raises(ChecksumMismatch):
        nodes.run(target.fetch_snapshot(snapshot_id))
    # Stored so: the manifest lists a volume that is no send stream.
    nodes.run(_restore_as(store, name, info, bytes(4096)))
    with pytest.raises(
        InvalidArgument, match=r"not a btrfs send stream.*what was read matches its manifest"
    ):
        nodes.run(target.fetch_snapshot(snapshot_id))
    assert snapshot_id not in {s.snapshot_id for s in nodes.run(target.list_snapshots())}
    assert not list((target.pool.root / "incoming").glob("*"))


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _whole(pieces: AsyncIterator[bytes]) -> bytes:
    return b"".join([piece async for piece in pieces])


async def _restore_as(store: ArtifactStore, name: str, info: bytes, volume: bytes) -> None:
    await delete_bundle(store, name)
    await put_bundle(store, name, [("info", _one(info)), ("volume", _one(volume))])
