"""Operation handlers for files: read, write, list, stat, mkdir, remove, rename.

Symlinks are never followed on the final component (O_NOFOLLOW, lstat); a write lands
in a temp file in the target's directory and replaces the target atomically, so a
cancelled or failed write leaves the old content in place and no temp file behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import stat

from space.protocol import DATA_CHUNK_BYTES, DATA_HEADER_BYTES, Channel, ErrorCode

from ._errors import OpError
from ._request import Account, Accounts, Fields, owner_name
from ._session import Chunk, Stream, send_batches

__all__ = [
    "op_list",
    "op_mkdir",
    "op_read",
    "op_remove",
    "op_rename",
    "op_stat",
    "op_write",
    "stat_dict",
]

MAX_LIST_ENTRIES = 10_000
_OPEN_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW


def stat_dict(path: str, st: os.stat_result) -> dict[str, object]:
    if stat.S_ISREG(st.st_mode):
        kind = "file"
    elif stat.S_ISDIR(st.st_mode):
        kind = "dir"
    elif stat.S_ISLNK(st.st_mode):
        kind = "symlink"
    else:
        kind = "other"
    return {
        "name": os.path.basename(path) or path,
        "path": path,
        "type": kind,
        "size": st.st_size,
        "mode": stat.S_IMODE(st.st_mode),
        "mtime": st.st_mtime,
        "owner": owner_name(st.st_uid),
    }


def _target(fields: Fields, accounts: Accounts, key: str = "path") -> tuple[Account, str]:
    account = accounts.get(fields)
    return account, account.resolve(fields.string(key, max_chars=4096))


async def op_read(stream: Stream, fields: Fields, accounts: Accounts) -> dict[str, object]:
    _, path = _target(fields, accounts)
    # O_NONBLOCK so a FIFO cannot hang the open; we refuse anything but a regular file.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _OPEN_FLAGS)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise OpError(ErrorCode.IS_A_DIRECTORY, f"{path} is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise OpError(ErrorCode.INVALID_ARGUMENT, f"{path} is not a regular file")
        os.set_blocking(fd, True)
        await stream.send_event({"event": "stat", "stat": stat_dict(path, st)})
        # The file as it was at the stat: a log still growing is read up to that size,
        # so the bytes match the size the host was told (its Content-Length).
        size, left = 0, st.st_size
        while left > 0 and (count := _read_frame(fd, frame := bytearray(_READ_FRAME_BYTES))):
            count = min(count, left)
            del frame[DATA_HEADER_BYTES + count :]
            await stream.send_data_frame(Channel.OUTPUT, frame)
            size += count
            left -= count
        await stream.send_eof(Channel.OUTPUT)
        return {"ok": True, "size": size}
    finally:
        os.close(fd)


#: A whole DATA frame of file content: the file is read straight into the frame.
_READ_FRAME_BYTES = DATA_HEADER_BYTES + DATA_CHUNK_BYTES - 1


def _read_frame(fd: int, frame: bytearray) -> int:
    """Fill ``frame`` after its header from ``fd``.

    Synchronously: a regular file does not block for long, and a thread hand-off per
    chunk costs more than it saves on the guest's single vCPU.
    """
    with memoryview(frame) as view:
        return os.readv(fd, [view[DATA_HEADER_BYTES:]])


def make_dirs(path: str, account: Account) -> None:
    """mkdir -p, giving every directory it creates to ``account``."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent != path:
        make_dirs(parent, account)
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        if not os.path.isdir(path):
            raise OpError(
                ErrorCode.NOT_A_DIRECTORY, f"{path} exists and is not a directory"
            ) from None
        return
    account.chown(path)


async def op_write(stream: Stream, fields: Fields, accounts: Accounts) -> dict[str, object]:
    account, path = _target(fields, accounts)
    mode = fields.integer("mode", 0o644, low=0, high=0o7777)
    parent, name = os.path.split(path)
    if not name or path == "/":
        raise OpError(ErrorCode.INVALID_ARGUMENT, f"{path} names no file")
    if fields.boolean("make_parents", True):
        make_dirs(parent, account)
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            raise OpError(ErrorCode.IS_A_DIRECTORY, f"{path} is a directory")
    temp = os.path.join(parent, f".space-write-{secrets.token_hex(8)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600)
    done = False
    try:
        account.chown(fd)
        await _receive_into(stream, fd)
        os.fchmod(fd, mode)
        await asyncio.to_thread(os.fsync, fd)
        os.close(fd)
        fd = -1
        os.replace(temp, path)
        done = True
    finally:
        if fd >= 0:
            os.close(fd)
        if not done:
            with contextlib.suppress(OSError):
                os.unlink(temp)
    return {"ok": True, "stat": stat_dict(path, os.lstat(path))}


async def _receive_into(stream: Stream, fd: int) -> None:
    # Written synchronously: to the page cache that is quick, and a thread hand-off per
    # chunk costs more than it saves on the guest's single vCPU.
    while (data := await stream.read_input()) is not None:
        _write_all(fd, data)
        await stream.consumed(len(data) + 1)


def _write_all(fd: int, data: Chunk) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


async def op_list(stream: Stream, fields: Fields, accounts: Accounts) -> dict[str, object]:
    _, path = _target(fields, accounts)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _OPEN_FLAGS)
    try:
        entries, truncated = _scan(fd, path)
    finally:
        os.close(fd)
    last = await send_batches(stream, "entries", entries)
    return {"ok": True, "entries": last, "truncated": truncated}


def _scan(fd: int, path: str) -> tuple[list[dict[str, object]], bool]:
    entries: list[dict[str, object]] = []
    with os.scandir(fd) as scan:
        for entry in scan:
            if len(entries) >= MAX_LIST_ENTRIES:
                return sorted(entries, key=lambda e: str(e["name"])), True
            with contextlib.suppress(FileNotFoundError):  # removed while we listed
                st = entry.stat(follow_symlinks=False)
                entries.append(stat_dict(os.path.join(path, entry.name), st))
    return sorted(entries, key=lambda e: str(e["name"])), False


async def op_stat(fields: Fields, accounts: Accounts) -> dict[str, object]:
    _, path = _target(fields, accounts)
    return {"ok": True, "stat": stat_dict(path, os.lstat(path))}


async def op_mkdir(fields: Fields, accounts: Accounts) -> dict[str, object]:
    account, path = _target(fields, accounts)
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise OpError(ErrorCode.ALREADY_EXISTS, f"{path} exists and is not a directory")
    make_dirs(path, account)
    return {"ok": True, "stat": stat_dict(path, os.lstat(path))}


async def op_remove(fields: Fields, accounts: Accounts) -> dict[str, object]:
    _, path = _target(fields, accounts)
    if path == "/":
        raise OpError(ErrorCode.INVALID_ARGUMENT, "refusing to remove /")
    recursive = fields.boolean("recursive", False)
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        os.unlink(path)
    elif recursive:
        await asyncio.to_thread(shutil.rmtree, path)
    else:
        os.rmdir(path)
    return {"ok": True}


async def op_rename(fields: Fields, accounts: Accounts) -> dict[str, object]:
    account, src = _target(fields, accounts, "src")
    dst = account.resolve(fields.string("dst", max_chars=4096))
    os.rename(src, dst)
    return {"ok": True, "stat": stat_dict(dst, os.lstat(dst))}
