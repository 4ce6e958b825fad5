"""The S3 backend: objects in one bucket of an S3-compatible service, through boto3.

boto3 is synchronous, so every call runs in a thread (asyncio.to_thread). An object up
to ``part_bytes`` is one PutObject; a larger one is a multipart upload of ``part_bytes``
parts, completed only once every part is in (S3 shows the object only then, so a reader
never sees half of it) and aborted if the stream fails or is cancelled, so no parts are
left to bill. Memory held: one part.

Errors map in one table (``_ERRORS``): a missing object or bucket is NotFound, refused
credentials PermissionDenied, anything else (unreachable endpoint, 5xx) StoreUnavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from space.node.api import InvalidArgument, NodeError, NotFound, PermissionDenied
from space.node.artifacts._store import (
    DEFAULT_MAX_OBJECT_BYTES,
    MAX_LIST_OBJECTS,
    READ_BYTES,
    ObjectInfo,
    ObjectTooLarge,
    StoreUnavailable,
    check_name,
    check_prefix,
)

__all__ = ["MIN_PART_BYTES", "S3Settings", "S3Store"]

#: S3's least part size (but for the last part); its most is 5 GiB.
MIN_PART_BYTES = 5 << 20
MAX_PART_BYTES = 5 << 30
#: 8 MiB: boto3's own default multipart chunk size.
DEFAULT_PART_BYTES = 8 << 20
_MAX_PARTS = 10_000  # S3's limit per upload

_T = TypeVar("_T")

#: S3 error codes → our errors (others: StoreUnavailable).
_ERRORS: dict[str, type[NodeError]] = {
    "NoSuchKey": NotFound,
    "NoSuchBucket": NotFound,
    "NotFound": NotFound,
    "404": NotFound,
    "AccessDenied": PermissionDenied,
    "InvalidAccessKeyId": PermissionDenied,
    "SignatureDoesNotMatch": PermissionDenied,
    "403": PermissionDenied,
}


@dataclass(frozen=True)
class S3Settings:
    """Where the bucket is and how to reach it. ``endpoint_url`` None means AWS itself;
    no credentials means boto3's own chain (environment, instance profile)."""

    bucket: str
    endpoint_url: str | None = None
    region: str = "us-east-1"
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    part_bytes: int = DEFAULT_PART_BYTES
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0


class S3Store:
    """An ArtifactStore in an S3 bucket (which must exist)."""

    def __init__(
        self, settings: S3Settings, *, max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES
    ) -> None:
        import boto3  # here, not at import: a node without an S3 store never loads it
        from botocore.config import Config

        if not MIN_PART_BYTES <= settings.part_bytes <= MAX_PART_BYTES:
            raise InvalidArgument(f"part_bytes must be in {MIN_PART_BYTES}..{MAX_PART_BYTES}")
        # Path-style URLs for a custom endpoint (a bucket name needs no DNS name there).
        addressing = "auto" if settings.endpoint_url is None else "path"
        self.settings = settings
        self.bucket = settings.bucket
        self.max_object_bytes = max_object_bytes
        self._client: Any = boto3.session.Session().client(
            "s3",
            endpoint_url=settings.endpoint_url,
            region_name=settings.region,
            aws_access_key_id=settings.access_key_id,
            aws_secret_access_key=settings.secret_access_key,
            config=Config(
                connect_timeout=settings.connect_timeout_s,
                read_timeout=settings.read_timeout_s,
                retries={"max_attempts": 3, "mode": "standard"},
                s3={"addressing_style": addressing},
            ),
        )

    def __repr__(self) -> str:
        return f"S3Store(bucket={self.bucket!r}, endpoint={self.settings.endpoint_url!r})"

    async def _call(self, what: str, call: Callable[..., _T], **kwargs: Any) -> _T:
        """``call(**kwargs)`` in a thread, its errors mapped through ``_ERRORS``."""
        return await asyncio.to_thread(_mapped, what, call, kwargs)

    async def put(self, name: str, pieces: AsyncIterable[bytes]) -> ObjectInfo:
        check_name(name)
        part_bytes = self.settings.part_bytes
        buffer = bytearray()
        written = 0
        upload: _Upload | None = None
        try:
            async for piece in pieces:
                written += len(piece)
                if written > self.max_object_bytes:
                    raise ObjectTooLarge(
                        f"artifact {name} is over {self.max_object_bytes} bytes; not stored"
                    )
                buffer += piece
                while len(buffer) > part_bytes:  # more follows: never the last part
                    upload = upload or await self._start_upload(name)
                    await upload.add(bytes(buffer[:part_bytes]))
                    del buffer[:part_bytes]
            if upload is None:
                await self._call(
                    f"put {name}", self._client.put_object, Bucket=self.bucket, Key=name,
                    Body=bytes(buffer),
                )  # fmt: skip
            else:
                await upload.add(bytes(buffer))
                await upload.complete()
        except BaseException:
            if upload is not None:
                await asyncio.shield(upload.abort())
            raise
        return ObjectInfo(name, written)

    async def _start_upload(self, name: str) -> _Upload:
        answer = await self._call(
            f"put {name}", self._client.create_multipart_upload, Bucket=self.bucket, Key=name
        )
        return _Upload(self, name, answer["UploadId"])

    async def get(self, name: str) -> AsyncGenerator[bytes, None]:
        check_name(name)
        answer = await self._call(
            f"get {name}", self._client.get_object, Bucket=self.bucket, Key=name
        )
        body = answer["Body"]
        try:
            while piece := await self._call(f"read {name}", body.read, amt=READ_BYTES):
                yield piece
        finally:
            body.close()

    async def head(self, name: str) -> ObjectInfo | None:
        check_name(name)
        try:
            answer = await self._call(
                f"head {name}", self._client.head_object, Bucket=self.bucket, Key=name
            )
        except NotFound:
            return None
        return ObjectInfo(name, int(answer["ContentLength"]))

    async def exists(self, name: str) -> bool:
        return await self.head(name) is not None

    async def delete(self, name: str) -> None:
        check_name(name)
        await self._call(f"delete {name}", self._client.delete_object, Bucket=self.bucket, Key=name)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        check_prefix(prefix)
        return await self._call(
            f"list {prefix!r}", _list, client=self._client, bucket=self.bucket, prefix=prefix
        )


class _Upload:
    """One multipart upload in progress."""

    def __init__(self, store: S3Store, name: str, upload_id: str) -> None:
        self._store = store
        self._name = name
        self._id = upload_id
        self._parts: list[dict[str, Any]] = []

    async def add(self, data: bytes) -> None:
        number = len(self._parts) + 1
        if number > _MAX_PARTS:
            raise ObjectTooLarge(f"artifact {self._name} needs over {_MAX_PARTS} parts")
        store = self._store
        answer = await store._call(
            f"put {self._name} part {number}", store._client.upload_part,
            Bucket=store.bucket, Key=self._name, UploadId=self._id, PartNumber=number, Body=data,
        )  # fmt: skip
        self._parts.append({"PartNumber": number, "ETag": answer["ETag"]})

    async def complete(self) -> None:
        store = self._store
        await store._call(
            f"put {self._name}", store._client.complete_multipart_upload,
            Bucket=store.bucket, Key=self._name, UploadId=self._id,
            MultipartUpload={"Parts": self._parts},
        )  # fmt: skip

    async def abort(self) -> None:
        """Drop the parts sent so far; best effort (S3's lifecycle rules sweep the rest)."""
        store = self._store
        with contextlib.suppress(NodeError):
            await store._call(
                f"abort {self._name}", store._client.abort_multipart_upload,
                Bucket=store.bucket, Key=self._name, UploadId=self._id,
            )  # fmt: skip


def _list(client: Any, bucket: str, prefix: str) -> list[ObjectInfo]:
    found: list[ObjectInfo] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        found.extend(ObjectInfo(o["Key"], int(o["Size"])) for o in page.get("Contents", []))
        if len(found) > MAX_LIST_OBJECTS:
            raise ObjectTooLarge(f"over {MAX_LIST_OBJECTS} artifacts under {prefix!r}")
    return sorted(found, key=lambda info: info.name)


def _mapped(what: str, call: Callable[..., _T], kwargs: dict[str, Any]) -> _T:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return call(**kwargs)
    except ClientError as exc:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        leaf = _ERRORS.get(code, StoreUnavailable)
        raise leaf(f"S3 {what}: {code} {error.get('Message', '')}".rstrip()) from None
    except BotoCoreError as exc:
        raise StoreUnavailable(f"S3 {what}: {exc}") from None
