"""The node's template catalog: references, tags moving only on success, deletion."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from space.node.agent._catalog import Build, Catalog
from space.node.api import Conflict, InvalidArgument, NotFound
from space.node.core.template import BASE, READY_SHAPE, Shape, Template
from space.node.storage.btrfs import BtrfsPool, TemplateVolume

BASE_DIGEST = "b" * 64


def _volume(pool: BtrfsPool, name: str, digest: str, disk_mib: int = 2048) -> TemplateVolume:
    path = pool.root / "templates" / name / digest
    path.mkdir(parents=True)
    (path / ".complete").write_text(digest)
    with open(path / "rootfs.img", "wb") as image:
        os.truncate(image.fileno(), disk_mib << 20)
    return TemplateVolume(name, digest, path)


@pytest.fixture
def pool(tmp_path: Path) -> BtrfsPool:
    return BtrfsPool(tmp_path / "pool", image=None, mounted_here=False)


def _catalog(pool: BtrfsPool, state: Path) -> Catalog:
    volume = _volume(pool, BASE, BASE_DIGEST, 1024)
    base = Template(BASE, "latest", volume, "console=ttyS0", 1024, pristine=True)
    catalog = Catalog(base, pool, state)
    catalog.load()
    return catalog


def _build(digest: str) -> Build:
    return Build(digest, "debian:bookworm", 1.0, Shape(2, 512, 2048), {"A": "1"}, "/w", "run")


def test_references_resolve_by_name_tag_and_digest(pool: BtrfsPool, tmp_path: Path) -> None:
    catalog = _catalog(pool, tmp_path / "state")
    _volume(pool, "py", "1" * 64)
    catalog.add("py", "v1", _build("1" * 64))
    catalog.add("py", "latest", _build("1" * 64))
    assert catalog.resolve("py").digest == "1" * 64
    assert catalog.resolve("py:v1").shape == Shape(2, 512, 2048)
    assert catalog.resolve("py@" + "1" * 64).tag == "latest"
    assert catalog.resolve("base").pristine and catalog.resolve("base").shape == READY_SHAPE
    assert catalog.by_digest("1" * 64) is not None
    assert [f"{t.name}:{t.tag}" for t in catalog.tagged()] == ["base:latest", "py:latest", "py:v1"]
    assert len(catalog.builds()) == 2


def test_tags_survive_a_restart_and_builds_without_subvolume_are_dropped(
    pool: BtrfsPool, tmp_path: Path
) -> None:
    catalog = _catalog(pool, tmp_path / "state")
    kept = _volume(pool, "py", "1" * 64)
    catalog.add("py", "v1", _build("1" * 64))
    lost = _volume(pool, "py", "2" * 64)
    catalog.add("py", "v2", _build("2" * 64))
    (lost.path / ".complete").unlink()  # as if the subvolume were gone
    again = Catalog(catalog.base, pool, tmp_path / "state")
    dropped = again.load()
    assert again.resolve("py:v1").volume == kept
    assert any("2" * 12 in line for line in dropped)
    with pytest.raises(NotFound):
        again.resolve("py:v2")


def test_removing_a_tag_orphans_a_build_only_when_no_other_tag_names_it(
    pool: BtrfsPool, tmp_path: Path
) -> None:
    catalog = _catalog(pool, tmp_path / "state")
    _volume(pool, "py", "1" * 64)
    catalog.add("py", "v1", _build("1" * 64))
    catalog.add("py", "latest", _build("1" * 64))
    assert catalog.remove("py:v1") == []
    assert [t.digest for t in catalog.remove("py")] == ["1" * 64]
    assert [t.name for t in catalog.tagged()] == ["base"]
    assert not (tmp_path / "state" / "py.json").exists()


def test_removing_by_digest_removes_every_tag_of_that_build(
    pool: BtrfsPool, tmp_path: Path
) -> None:
    catalog = _catalog(pool, tmp_path / "state")
    for digest in ("1" * 64, "2" * 64):
        _volume(pool, "py", digest)
    catalog.add("py", "a", _build("1" * 64))
    catalog.add("py", "b", _build("1" * 64))
    catalog.add("py", "c", _build("2" * 64))
    assert [t.digest for t in catalog.remove("py@" + "1" * 64)] == ["1" * 64]
    assert [t.tag for t in catalog.tagged()] == ["latest", "c"]


def test_a_tag_moved_to_a_new_build_orphans_the_old_one_unless_another_tag_names_it(
    pool: BtrfsPool, tmp_path: Path
) -> None:
    catalog = _catalog(pool, tmp_path / "state")
    for digest in ("1" * 64, "2" * 64, "3" * 64):
        _volume(pool, "py", digest)
    assert catalog.add("py", "v1", _build("1" * 64))[1] == []
    catalog.add("py", "stable", _build("1" * 64))
    assert catalog.add("py", "v1", _build("2" * 64))[1] == []  # "stable" keeps build 1
    _, orphans = catalog.add("py", "v1", _build("3" * 64))
    assert [t.digest for t in orphans] == ["2" * 64]
    assert catalog.resolve("py:v1").digest == "3" * 64
    assert catalog.resolve("py:stable").digest == "1" * 64


@pytest.mark.parametrize("ref", ["Py", "py:", "py@abc", "py:v1@" + "1" * 64, ""])
def test_negative_a_malformed_reference_is_invalid(
    pool: BtrfsPool, tmp_path: Path, ref: str
) -> None:
    with pytest.raises(InvalidArgument):
        _catalog(pool, tmp_path / "state").resolve(ref)


def test_negative_base_cannot_be_removed_and_unknown_refs_are_not_found(
    pool: BtrfsPool, tmp_path: Path
) -> None:
    catalog = _catalog(pool, tmp_path / "state")
    with pytest.raises(Conflict):
        catalog.remove("base")
    for ref in ("nope", "base:v2", "base@" + "c" * 64):
        with pytest.raises(NotFound):
            catalog.resolve(ref)
    with pytest.raises(NotFound):
        catalog.remove("nope:v1")
