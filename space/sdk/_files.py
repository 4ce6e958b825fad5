"""A sandbox's filesystem: ``sandbox.files`` (async core).

Uploads and downloads stream in chunks: a file of any size crosses with bounded memory.
Paths are paths inside the sandbox; the guest resolves them without following links
out of the sandbox.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import os
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Literal, overload

from space.sdk._http import ApiClient, read_capped, translate_errors
from space.sdk._models import FileInfo
from space.sdk._watch import AsyncDirWatcher, open_watch
from space.sdk.errors import (
    InternalError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    SpaceError,
)

__all__ = ["AsyncFiles", "ByteStream", "WriteData"]

#: Bytes per upload chunk read from a local file or stream.
CHUNK_BYTES = 1 << 20
#: Largest file ``read(format="text"|"bytes")`` holds in memory; use "stream" beyond it.
MAX_IN_MEMORY_BYTES = 256 << 20

WriteData = str | bytes | bytearray | memoryview | BinaryIO | Iterable[bytes] | AsyncIterable[bytes]


class ByteStream:
    """The chunks of a file being downloaded. Iterate to the end, or ``aclose`` it."""

    def __init__(
        self, stack: AsyncExitStack, chunks: AsyncIterator[bytes], *, sandbox_id: str
    ) -> None:
        self._stack = stack
        self._chunks = chunks
        self._sandbox_id = sandbox_id

    def __aiter__(self) -> ByteStream:
        return self

    async def __anext__(self) -> bytes:
        try:
            with translate_errors(operation="files.read", sandbox_id=self._sandbox_id):
                return await anext(self._chunks)
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Close the download; idempotent."""
        await self._stack.aclose()


class AsyncFiles:
    """``sandbox.files``: read, write and manage files inside the sandbox."""

    def __init__(self, api: ApiClient, sandbox_id: str) -> None:
        self._api = api
        self._sandbox_id = sandbox_id
        self._base = f"/v1/sandboxes/{sandbox_id}/files"

    @overload
    async def read(self, path: str, *, format: Literal["text"] = "text") -> str: ...
    @overload
    async def read(self, path: str, *, format: Literal["bytes"]) -> bytes: ...
    @overload
    async def read(self, path: str, *, format: Literal["stream"]) -> ByteStream: ...

    async def read(
        self, path: str, *, format: Literal["text", "bytes", "stream"] = "text"
    ) -> str | bytes | ByteStream:
        """Read a file: as UTF-8 ``text``, as ``bytes``, or as a ``stream`` of chunks.

        text/bytes hold the whole file in memory and raise ResourceExhausted past
        MAX_IN_MEMORY_BYTES (256 MiB); text raises InvalidArgument if it is not UTF-8.
        Raises NotFound, PermissionDenied, InvalidArgument (a directory).
        """
        if format == "stream":
            return await self._open_stream(path)
        async with self._api.stream(
            "GET", self._base, **self._ctx("files.read"), params={"path": path}
        ) as response:
            data = await read_capped(response, MAX_IN_MEMORY_BYTES, operation="files.read")
        if format == "bytes":
            return data
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument(
                f"{path} is not UTF-8 text; read it with format='bytes'", **self._ctx("files.read")
            ) from None

    async def write(
        self, path: str, data: WriteData, *, mode: int | None = None, user: str | None = None
    ) -> FileInfo:
        """Create or replace ``path`` with ``data``, streamed in chunks.

        ``data`` may be text (written as UTF-8), bytes, a binary file object, or a (sync
        or async) iterable of bytes; file objects and iterables are read chunk by chunk,
        never whole. ``mode`` is the permission bits (0o644), ``user`` the owner.
        Cancelling mid-way leaves the file absent or partly written.
        """
        params = {"path": path}
        if mode is not None:
            params["mode"] = format(mode, "o")
        if user is not None:
            params["user"] = user
        async with self._api.stream(
            "PUT", self._base, **self._ctx("files.write"), params=params, content=_chunks(data)
        ) as response:
            body = await read_capped(response, 1 << 20, operation="files.write")
        return FileInfo.from_wire(_json(body))

    async def list(self, path: str) -> builtins.list[FileInfo]:
        """The entries of a directory (not recursive). NotFound, InvalidArgument (a file)."""
        body = await self._get_json("/list", path, "files.list")
        entries = body.get("entries") if isinstance(body, dict) else None
        if not isinstance(entries, builtins.list):
            raise InternalError("malformed directory listing", **self._ctx("files.list"))
        return [FileInfo.from_wire(e) for e in entries]

    async def stat(self, path: str) -> FileInfo:
        """Metadata of ``path`` (links are not followed). NotFound if absent."""
        return FileInfo.from_wire(await self._get_json("/stat", path, "files.stat"))

    async def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""
        try:
            await self.stat(path)
        except NotFound:
            return False
        return True

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Delete a file, or a directory (non-empty ones need ``recursive``)."""
        params = {"path": path, "recursive": "true" if recursive else "false"}
        await self._api.request_json(
            "DELETE", self._base, **self._ctx("files.remove"), params=params
        )

    async def make_dir(self, path: str) -> FileInfo:
        """Create a directory (and its parents). Conflict if a file is in the way."""
        body = await self._api.request_json(
            "POST", f"{self._base}/mkdir", **self._ctx("files.make_dir"), json_body={"path": path}
        )
        return FileInfo.from_wire(body)

    async def rename(self, src: str, dst: str) -> FileInfo:
        """Move ``src`` to ``dst``; returns the stat of ``dst``."""
        body = await self._api.request_json(
            "POST",
            f"{self._base}/rename",
            **self._ctx("files.rename"),
            json_body={"src": src, "dst": dst},
        )
        return FileInfo.from_wire(body)

    async def download_to(self, path: str, local_path: str | os.PathLike[str]) -> int:
        """Stream ``path`` into the local file ``local_path``; returns the byte count.

        On failure (or cancellation) the partial local file is removed.
        """
        target = Path(local_path)
        stream = await self._open_stream(path)
        try:
            with _local_errors(target, "files.download_to"):
                out = await asyncio.to_thread(target.open, "wb")
        except BaseException:
            await stream.aclose()
            raise
        written = 0
        try:
            with _local_errors(target, "files.download_to"):
                async for chunk in stream:
                    await asyncio.to_thread(out.write, chunk)
                    written += len(chunk)
                await asyncio.to_thread(out.close)
        except BaseException:
            await stream.aclose()
            await asyncio.to_thread(_discard, out, target)
            raise
        return written

    async def upload_from(self, local_path: str | os.PathLike[str], path: str) -> FileInfo:
        """Stream the local file ``local_path`` to ``path`` in the sandbox."""
        source = Path(local_path)
        with _local_errors(source, "files.upload_from"):
            handle = await asyncio.to_thread(source.open, "rb")
        try:
            return await self.write(path, handle)
        finally:
            await asyncio.to_thread(handle.close)

    async def watch_dir(self, path: str, *, recursive: bool = False) -> AsyncDirWatcher:
        """Watch a directory (and its subdirectories if ``recursive``) for changes.

        Returns once the watch is in place; iterate the watcher for FilesystemEvents,
        and ``aclose`` it (or use ``async with``) to release the watch. A watcher that
        falls behind gets a ``dropped`` event counting what it missed. Raises NotFound
        (no such path), InvalidArgument (not a directory), ResourceExhausted (the
        sandbox watches 64 directories trees, 8,192 directories, at most).
        """
        return await open_watch(self._api, self._sandbox_id, path, recursive=recursive)

    async def _open_stream(self, path: str) -> ByteStream:
        stack = AsyncExitStack()
        try:
            response = await stack.enter_async_context(
                self._api.stream(
                    "GET", self._base, **self._ctx("files.read"), params={"path": path}
                )
            )
        except BaseException:
            await stack.aclose()
            raise
        return ByteStream(stack, response.aiter_bytes(), sandbox_id=self._sandbox_id)

    async def _get_json(self, suffix: str, path: str, operation: str) -> Any:
        return await self._api.request_json(
            "GET", self._base + suffix, **self._ctx(operation), params={"path": path}
        )

    def _ctx(self, operation: str) -> dict[str, Any]:
        return {"operation": operation, "sandbox_id": self._sandbox_id}


async def _chunks(data: WriteData) -> AsyncIterator[bytes]:
    """Every form of WriteData as an async stream of bytes chunks."""
    if isinstance(data, str):
        yield data.encode("utf-8")
    elif isinstance(data, bytes | bytearray | memoryview):
        yield bytes(data)
    elif hasattr(data, "read"):
        reader: BinaryIO = data  # type: ignore[assignment]
        while chunk := await asyncio.to_thread(reader.read, CHUNK_BYTES):
            yield _as_bytes(chunk)
    elif isinstance(data, AsyncIterable):
        async for chunk in data:
            yield _as_bytes(chunk)
    else:
        # Pull a sync iterable from a worker thread: it may block (a generator over a pipe).
        iterator = iter(data)
        while (item := await asyncio.to_thread(_next_or_none, iterator)) is not None:
            yield _as_bytes(item)


def _next_or_none(iterator: Iterator[bytes]) -> bytes | None:
    return next(iterator, None)


def _discard(handle: BinaryIO, path: Path) -> None:
    handle.close()
    path.unlink(missing_ok=True)


def _as_bytes(chunk: object) -> bytes:
    if isinstance(chunk, bytes | bytearray | memoryview):
        return bytes(chunk)
    raise InvalidArgument(
        f"write data yielded {type(chunk).__name__}, expected bytes", operation="files.write"
    )


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        raise InternalError("the API answered with something that is not JSON") from None


@contextmanager
def _local_errors(path: Path, operation: str) -> Iterator[None]:
    """Local filesystem failures as SpaceError leaves (never a bare OSError)."""
    try:
        yield
    except FileNotFoundError:
        raise NotFound(f"local file {path} does not exist", operation=operation) from None
    except PermissionError:
        raise PermissionDenied(
            f"no permission for local file {path}", operation=operation
        ) from None
    except SpaceError:
        raise
    except OSError as exc:
        raise InvalidArgument(f"local file {path}: {exc.strerror}", operation=operation) from None
