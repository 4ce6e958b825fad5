"""The image cache: build once per digest, reuse at once, never show a partial entry."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from space.node.images import ImageBuildError
from space.node.images._cache import (
    MANIFEST_NAME,
    ensure_entry,
    prune,
    read_manifest,
    remove_tree,
)

DIGEST = "ab" * 32


class _Builder:
    """A fake build step that writes two files and counts its calls."""

    def __init__(self, delay_s: float = 0.0, fail: bool = False) -> None:
        self.calls = 0
        self.delay_s = delay_s
        self.fail = fail
        self.dirs: list[Path] = []

    def __call__(self, tmp: Path) -> dict[str, object]:
        self.calls += 1
        self.dirs.append(tmp)
        (tmp / "vmlinuz").write_bytes(b"k" * 10)
        time.sleep(self.delay_s)
        if self.fail:
            raise ImageBuildError("fake step failed", command=["false"], output_tail="boom")
        (tmp / "rootfs.img").write_bytes(b"r" * 20)
        return {"template": "base"}


def test_first_call_builds_and_writes_a_manifest_with_sizes(tmp_path: Path) -> None:
    builder = _Builder()
    entry = ensure_entry(tmp_path, DIGEST, builder)
    assert entry == tmp_path / DIGEST
    manifest = json.loads((entry / MANIFEST_NAME).read_text())
    assert manifest == {
        "digest": DIGEST,
        "files": {"rootfs.img": 20, "vmlinuz": 10},
        "template": "base",
    }
    assert builder.calls == 1


def test_an_entry_built_under_umask_077_is_readable_by_every_user(tmp_path: Path) -> None:
    # space serve builds as root under umask 077, its node agent then reads as `space`.
    old = os.umask(0o077)
    try:
        entry = ensure_entry(tmp_path, DIGEST, _Builder())
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in entry.iterdir()}
    assert modes == {"rootfs.img": 0o644, "vmlinuz": 0o644, MANIFEST_NAME: 0o644}
    assert entry.stat().st_mode & 0o777 == 0o755


def test_unchanged_digest_is_reused_without_building_in_milliseconds(tmp_path: Path) -> None:
    builder = _Builder()
    ensure_entry(tmp_path, DIGEST, builder)
    start = time.monotonic()
    entry = ensure_entry(tmp_path, DIGEST, builder)
    assert time.monotonic() - start < 0.05
    assert builder.calls == 1
    assert (entry / "rootfs.img").read_bytes() == b"r" * 20


def test_concurrent_builds_of_one_digest_build_once_and_share_the_result(tmp_path: Path) -> None:
    builder = _Builder(delay_s=0.3)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_entry(tmp_path, DIGEST, builder)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert results == [tmp_path / DIGEST] * 3
    assert builder.calls == 1


def test_negative_failed_build_leaves_no_entry_and_no_temp_directory(tmp_path: Path) -> None:
    builder = _Builder(fail=True)
    with pytest.raises(ImageBuildError) as info:
        ensure_entry(tmp_path, DIGEST, builder)
    assert info.value.command == ("false",)
    assert "boom" in str(info.value)
    assert not (tmp_path / DIGEST).exists()
    assert not builder.dirs[0].exists()
    assert [p.name for p in tmp_path.iterdir()] == [f".{DIGEST}.lock"]


def test_negative_entry_with_a_wrong_file_size_is_rebuilt(tmp_path: Path) -> None:
    builder = _Builder()
    entry = ensure_entry(tmp_path, DIGEST, builder)
    (entry / "rootfs.img").write_bytes(b"truncated")
    assert read_manifest(entry, DIGEST) is None
    ensure_entry(tmp_path, DIGEST, builder)
    assert builder.calls == 2
    assert (entry / "rootfs.img").read_bytes() == b"r" * 20


def test_negative_manifest_of_another_digest_or_corrupt_is_not_complete(tmp_path: Path) -> None:
    entry = ensure_entry(tmp_path, DIGEST, _Builder())
    assert read_manifest(entry, "cd" * 32) is None
    (entry / MANIFEST_NAME).write_text("{not json")
    assert read_manifest(entry, DIGEST) is None


def test_leftover_temp_directory_of_a_crashed_build_is_removed(tmp_path: Path) -> None:
    leftover = tmp_path / f".{DIGEST}.tmp-crashed"
    (leftover / "sub").mkdir(parents=True)
    (leftover / "sub" / "half.img").write_bytes(b"x")
    ensure_entry(tmp_path, DIGEST, _Builder())
    assert not leftover.exists()
    assert (tmp_path / DIGEST / MANIFEST_NAME).exists()


def test_other_digests_stay_when_a_new_one_is_built(tmp_path: Path) -> None:
    old = ensure_entry(tmp_path, DIGEST, _Builder())
    new = ensure_entry(tmp_path, "cd" * 32, _Builder())
    assert read_manifest(old, DIGEST) is not None
    assert read_manifest(new, "cd" * 32) is not None


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")
def test_remove_tree_detaches_mounts_below_it_instead_of_deleting_through_them(
    tmp_path: Path,
) -> None:
    # As a crashed debootstrap leaves /proc mounted in its target.
    target = tmp_path / "root"
    mount_point = target / "proc"
    mount_point.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "space-test", str(mount_point)], check=True)
    try:
        (mount_point / "inside").write_text("x")
        remove_tree(target)
        assert not target.exists()
    finally:
        subprocess.run(["umount", "--lazy", str(mount_point)], capture_output=True)
    assert str(mount_point) not in Path("/proc/self/mountinfo").read_text()


def test_prune_keeps_the_current_build_and_the_newest_other_of_that_template(
    tmp_path: Path,
) -> None:
    digests = [f"{i:02x}" * 32 for i in range(4)]
    for age, digest in enumerate(digests):
        entry = ensure_entry(tmp_path, digest, _Builder())
        os.utime(entry, (1000 + age, 1000 + age))
    other = ensure_entry(tmp_path, "ff" * 32, lambda tmp: {"template": "other"})
    deleted = prune(tmp_path, template="base", keep=digests[0])
    assert sorted(deleted) == sorted(digests[1:3])
    assert read_manifest(tmp_path / digests[0], digests[0]) is not None
    assert read_manifest(tmp_path / digests[3], digests[3]) is not None
    assert other.exists()


def test_negative_prune_of_a_missing_cache_deletes_nothing(tmp_path: Path) -> None:
    assert prune(tmp_path / "absent", template="base", keep=DIGEST) == []


def test_an_entry_built_under_umask_077_is_readable_by_the_node_agent_s_user(
    tmp_path: Path,
) -> None:
    # A root server builds under umask 077 (issue 18); its agent reads the entry as
    # its own user, and an unreadable manifest would send it to the root-only lock.
    previous = os.umask(0o077)
    try:
        entry = ensure_entry(tmp_path, DIGEST, _Builder())
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in entry.iterdir()}
    assert modes == {"vmlinuz": 0o644, "rootfs.img": 0o644, MANIFEST_NAME: 0o644}
    assert entry.stat().st_mode & 0o777 == 0o755
