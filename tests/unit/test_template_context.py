"""unpack_context: a build context tar stream unpacked under a directory, hostile or not."""

from __future__ import annotations

import asyncio
import gzip
import io
import os
import stat
import tarfile
import threading
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest

from space.node.templates import TemplateSpecError, context, unpack_context

pytestmark = pytest.mark.anyio

SPEC = b'name = "demo"\nbase = "debian:bookworm"\n'


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    path = tmp_path / "ctx"
    path.mkdir()
    return path


def _file(name: str, data: bytes = b"", mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    return info, data


def _member(name: str, kind: bytes, **attrs: object) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type = kind
    for key, value in attrs.items():
        setattr(info, key, value)
    return info, b""


def _tar(members: Iterable[tuple[tarfile.TarInfo, bytes]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as archive:
        for info, data in members:
            archive.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buffer.getvalue()


def _with_spec(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    return _tar([_file("space.toml", SPEC), *members])


async def _chunks(data: bytes, size: int = 1000) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def _refused(data: bytes, dest: Path, match: str) -> TemplateSpecError:
    with pytest.raises(TemplateSpecError, match=match) as caught:
        await unpack_context(_chunks(data), dest)
    # Nothing left beside dest: no spool, nothing written outside it.
    assert _names(dest.parent) == [dest.name]
    return caught.value


def _names(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def _tree(root: Path) -> dict[str, tuple[str, int, bytes]]:
    found = {}
    for path in sorted(root.rglob("*")):
        mode = path.lstat().st_mode
        kind = "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"
        data = path.read_bytes() if kind == "file" else b""
        found[str(path.relative_to(root))] = (kind, stat.S_IMODE(mode), data)
    return found


GOOD = [
    _member("./", tarfile.DIRTYPE, mode=0o755),
    _file("./space.toml", SPEC),
    _member("./app", tarfile.DIRTYPE, mode=0o2750),
    _file("./app/server.py", b"print('hi')\n", 0o755),
    _file("./app/suid", b"x", 0o4777),
    _file("lib//deep/./util.py", b"pass\n", 0o600),
    _member("empty/", tarfile.DIRTYPE, mode=0o500),
]
GOOD_TREE = {
    "space.toml": ("file", 0o644, SPEC),
    "app": ("dir", 0o750, b""),
    "app/server.py": ("file", 0o755, b"print('hi')\n"),
    "app/suid": ("file", 0o755, b"x"),
    "lib": ("dir", 0o755, b""),
    "lib/deep": ("dir", 0o755, b""),
    "lib/deep/util.py": ("file", 0o600, b"pass\n"),
    "empty": ("dir", 0o700, b""),
}


async def test_a_good_archive_is_unpacked_with_exec_bits_kept_and_setuid_dropped(
    dest: Path,
) -> None:
    spec = await unpack_context(_chunks(_tar(GOOD)), dest)
    assert spec == dest / "space.toml"
    assert _tree(dest) == GOOD_TREE
    assert _names(dest.parent) == [dest.name]


async def test_the_servers_owner_only_umask_does_not_change_the_modes_unpacked(
    dest: Path,
) -> None:
    # space serve runs under umask 077 (issue 18); the tree goes to the guest as is.
    os.umask(0o077)  # restored by tests/conftest.py
    await unpack_context(_chunks(_tar(GOOD)), dest)
    assert _tree(dest) == GOOD_TREE


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
async def test_a_gzipped_archive_unpacks_the_same_in_every_tar_format(dest: Path, fmt: int) -> None:
    await unpack_context(_chunks(gzip.compress(_tar(GOOD, fmt))), dest)
    assert _tree(dest) == GOOD_TREE


async def test_long_names_within_the_limit_are_unpacked(dest: Path) -> None:
    name = "/".join(["d" * 200] * 4) + "/f.txt"
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        target = dest / str(fmt)
        target.mkdir()
        await unpack_context(
            _chunks(_tar([_file("space.toml", SPEC), _file(name, b"1")], fmt)), target
        )
        assert (target / name).read_bytes() == b"1"


async def test_exactly_the_entry_and_byte_limits_are_accepted(
    dest: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(context, "MAX_ENTRIES", 3)
    monkeypatch.setattr(context, "MAX_FILE_BYTES", len(SPEC) + 10)
    await unpack_context(_chunks(_with_spec(_file("a", b"x" * 6), _file("b", b"y" * 4))), dest)
    assert (dest / "b").read_bytes() == b"yyyy"


async def test_negative_one_entry_over_the_limit_is_refused(
    dest: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(context, "MAX_ENTRIES", 3)
    data = _with_spec(_file("a"), _file("b"), _file("c"))
    await _refused(data, dest, "more than 3 members")


async def test_negative_one_byte_over_the_file_bytes_limit_is_refused(
    dest: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(context, "MAX_FILE_BYTES", len(SPEC) + 10)
    data = _with_spec(_file("a", b"x" * 6), _file("b", b"y" * 5))
    error = await _refused(data, dest, f"more than {len(SPEC) + 10} bytes of files")
    assert error.key == "context" and f"brings them to {len(SPEC) + 11}" in error.problem
    assert not (dest / "b").exists()


async def test_negative_an_upload_over_the_archive_limit_is_refused_while_spooling(
    dest: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = gzip.compress(_tar(GOOD))
    monkeypatch.setattr(context, "MAX_ARCHIVE_BYTES", len(data) - 1)
    await _refused(data, dest, f"archive larger than {len(data) - 1} bytes")
    assert _names(dest) == []
    monkeypatch.setattr(context, "MAX_ARCHIVE_BYTES", len(data))
    await unpack_context(_chunks(data), dest)


async def test_negative_extended_headers_stop_at_the_decompressed_bound(
    dest: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(context, "MAX_FILE_BYTES", 4096)
    monkeypatch.setattr(context, "MAX_ENTRIES", 4)
    limit = 4096 + 4 * 8 * 1024
    info, data = _file("commented", b"1")
    info.pax_headers = {"comment": "c" * 20_000}
    await unpack_context(_chunks(gzip.compress(_with_spec((info, data)))), dest)
    info.pax_headers = {"comment": "c" * 40_000}
    other = dest.parent / "other"
    other.mkdir()
    with pytest.raises(TemplateSpecError, match=f"unpacks to more than {limit} bytes"):
        await unpack_context(_chunks(gzip.compress(_with_spec((info, data)))), other)


def _pax_member(name: str, global_headers: dict[str, str] | None = None) -> bytes:
    """The blocks of one empty file with a pax header (and a global one, if given)."""
    info, _ = _file(name)
    info.pax_headers = {"comment": "c"}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", pax_headers=global_headers) as archive:
        archive.addfile(info, io.BytesIO(b""))
    blocks = 3 if global_headers is None else 5
    return buffer.getvalue()[: blocks * 512]


async def test_negative_a_run_of_extended_headers_is_refused(dest: Path) -> None:
    # Each pax header followed by another: tarfile would recurse through them all.
    pax_header = _pax_member("x")[:1024]
    data = _tar([_file("space.toml", SPEC)])
    await _refused(pax_header * 4 + data, dest, "more than 3 extended headers before one member")
    await unpack_context(_chunks(pax_header * 2 + data), dest)


async def test_negative_more_than_16_pax_global_headers_are_refused(dest: Path) -> None:
    data = _tar([_file("space.toml", SPEC)])
    members = [_pax_member(f"f{n}", {f"k{n}": "v"}) for n in range(17)]
    await _refused(b"".join(members) + data, dest, "more than 16 pax global headers")
    other = dest.parent / "other"
    other.mkdir()
    await unpack_context(_chunks(b"".join(members[:16]) + data), other)
    assert (other / "f15").exists()


@pytest.mark.parametrize(
    ("member", "match"),
    [
        (_member("link", tarfile.SYMTYPE, linkname="/etc/passwd"), "'link' is a symlink"),
        (_member("hard", tarfile.LNKTYPE, linkname="space.toml"), "'hard' is a hard link"),
        (_member("tty", tarfile.CHRTYPE, devmajor=4, devminor=1), "'tty' is a character dev"),
        (_member("disk", tarfile.BLKTYPE, devmajor=8), "'disk' is a block device"),
        (_member("pipe", tarfile.FIFOTYPE), "'pipe' is a FIFO"),
        (_member("cont", tarfile.CONTTYPE), "'cont' is a contiguous file"),
    ],
)
async def test_negative_members_that_are_not_files_or_directories_are_refused(
    dest: Path, member: tuple[tarfile.TarInfo, bytes], match: str
) -> None:
    error = await _refused(_tar([member, _file("space.toml", SPEC)]), dest, match)
    assert (error.file, error.key) == (None, "context")
    assert _names(dest) == []


async def test_negative_a_symlink_after_files_is_refused_and_never_created(dest: Path) -> None:
    data = _with_spec(_member("app", tarfile.SYMTYPE, linkname=".."), _file("app/x", b"1"))
    await _refused(data, dest, "'app' is a symlink")
    assert not (dest / "app").is_symlink()


async def test_negative_a_gnu_sparse_file_is_refused(dest: Path) -> None:
    info, data = _file("holes", b"x" * 10)
    info.pax_headers = {
        "GNU.sparse.major": "1",
        "GNU.sparse.minor": "0",
        "GNU.sparse.realsize": "10",
    }
    await _refused(_with_spec((info, data)), dest, "'holes' is a sparse file")


async def test_negative_an_oversized_extended_header_is_refused_before_it_is_read(
    dest: Path,
) -> None:
    info, data = _file("big-header", b"1")
    info.pax_headers = {"comment": "c" * (64 * 1024)}
    await _refused(_with_spec((info, data)), dest, "extended header of 655")


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("../escape", "has '..'"),
        ("app/../../escape", "has '..'"),
        ("/etc/cron.d/x", "is absolute"),
        ("caf\udce9", "is not UTF-8"),
    ],
)
async def test_negative_names_that_leave_the_root_or_are_malformed_are_refused(
    dest: Path, name: str, match: str
) -> None:
    await _refused(_with_spec(_file(name, b"boom")), dest, match)
    assert not (dest.parent / "escape").exists()


async def test_negative_a_pax_path_holding_a_nul_is_refused(dest: Path) -> None:
    info, data = _file("a", b"1")
    info.pax_headers = {"path": "a\x00b"}
    await _refused(_with_spec((info, data)), dest, "holds a NUL")


async def test_negative_a_name_one_byte_over_the_path_limit_is_refused(
    dest: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(context, "MAX_PATH_BYTES", 20)
    await unpack_context(_chunks(_with_spec(_file("d" * 20))), dest)
    other = dest.parent / "other"
    other.mkdir()
    with pytest.raises(TemplateSpecError, match="member name of 21 bytes"):
        await unpack_context(_chunks(_with_spec(_file("d" * 21))), other)


@pytest.mark.parametrize(
    "members",
    [
        [_file("a", b"1"), _file("./a", b"2")],
        [_member("d", tarfile.DIRTYPE), _member("d/", tarfile.DIRTYPE)],
        [_file("d/f", b"1"), _file("d", b"2")],
        [_file("d", b"1"), _member("d", tarfile.DIRTYPE)],
        [_file("space.toml", b"2")],
    ],
)
async def test_negative_a_path_given_twice_is_refused(
    dest: Path, members: list[tuple[tarfile.TarInfo, bytes]]
) -> None:
    await _refused(_with_spec(*members), dest, "appears twice")
    assert (dest / "space.toml").read_bytes() == SPEC


async def test_negative_a_member_under_a_file_is_refused(dest: Path) -> None:
    await _refused(_with_spec(_file("f", b"1"), _file("f/g", b"2")), dest, "'f' is a file")


async def test_negative_an_archive_without_space_toml_at_its_root_is_refused(dest: Path) -> None:
    data = _tar([_file("sub/space.toml", SPEC)])
    error = await _refused(data, dest, "space.toml: missing at the archive's root")
    assert (error.file, error.key) == (Path("space.toml"), "")


async def test_negative_space_toml_as_a_directory_is_refused(dest: Path) -> None:
    data = _tar([_member("space.toml", tarfile.DIRTYPE), _file("space.toml/x", SPEC)])
    error = await _refused(data, dest, "a directory, not a regular file")
    assert error.file == Path("space.toml")


# gzip without a timestamp: the same bytes, so the same test ids, in every xdist worker.
@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "empty or truncated"),
        (b"not a tar at all " * 64, "not a tar archive, or a corrupt one"),
        (gzip.compress(b"not a tar at all " * 64, mtime=0), "not a tar archive, or a corrupt one"),
        (b"\x1f\x8b" + b"garbage" * 100, "not a valid gzip'd tar archive"),
        (gzip.compress(_tar(GOOD), mtime=0)[:-40], "not a valid gzip'd tar archive"),
        (_tar(GOOD)[:1536], "empty or truncated"),
        (_tar(GOOD)[:1000], "empty or truncated"),
        (_tar(GOOD)[:1100], "not a valid tar archive: unexpected end of data"),
        (_tar(GOOD)[:512] + b"\x01" * 512 + _tar(GOOD)[1024:], "corrupt"),
    ],
)
async def test_negative_input_that_is_not_a_whole_tar_is_refused(
    dest: Path, data: bytes, match: str
) -> None:
    await _refused(data, dest, match)


async def test_negative_writing_never_follows_a_symlink_already_in_dest(
    dest: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (dest / "app").symlink_to(outside)
    with pytest.raises(OSError):
        await unpack_context(_chunks(_with_spec(_file("app/x", b"1"))), dest)
    (dest / "app").unlink()
    (dest / "space.toml").unlink()
    (dest / "space.toml").symlink_to(outside / "spec")
    with pytest.raises(FileExistsError):
        await unpack_context(_chunks(_tar([_file("space.toml", SPEC)])), dest)
    assert _names(outside) == []


async def test_a_cancelled_unpack_stops_its_worker_thread_before_it_returns() -> None:
    started = threading.Event()
    saw_stop: list[bool] = []

    def work(stop: threading.Event) -> None:
        started.set()
        saw_stop.append(stop.wait(10))

    task = asyncio.ensure_future(context._in_thread(work))
    await asyncio.to_thread(started.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert saw_stop == [True]


def test_the_tarfile_hooks_that_refuse_sparse_maps_still_exist() -> None:
    # Private tarfile methods overridden by the strict TarInfo: a Python that renames
    # them must fail here rather than silently read sparse maps again.
    for name in ("_proc_gnusparse_00", "_proc_gnusparse_01", "_proc_gnusparse_10"):
        assert callable(getattr(tarfile.TarInfo, name))
    assert os.O_NOFOLLOW and os.O_EXCL
