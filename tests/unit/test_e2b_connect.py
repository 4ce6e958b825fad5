"""The Connect codec (envelopes, limits, messages) and the streaming multipart reader
that envd's translation reads requests with."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest
from starlette.types import Message

from space.control.e2b.connect import (
    FLAG_END_STREAM,
    MAX_MESSAGE_BYTES,
    Code,
    ConnectError,
    Fields,
    b64,
    end_stream,
    envelope,
    read_body,
    read_envelopes,
    timeout_of,
)
from space.control.e2b.envd import with_keepalives
from space.control.e2b.multipart import MAX_PARTS, MultipartError, MultipartReader, boundary_of

pytestmark = pytest.mark.anyio


def _receiver(chunks: Iterable[bytes]) -> Any:
    messages = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    messages.append({"type": "http.request", "body": b"", "more_body": False})

    async def receive() -> Message:
        return messages.pop(0)

    return receive


def _bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


async def _messages(chunks: Iterable[bytes], limit: int = MAX_MESSAGE_BYTES) -> list[Any]:
    return [m async for m in read_envelopes(_receiver(chunks), limit)]


async def test_envelopes_split_anywhere_are_read_whole_in_order() -> None:
    data = envelope({"a": 1}) + envelope({"b": "x" * 300}) + envelope({})
    assert await _messages(_bytewise(data)) == [{"a": 1}, {"b": "x" * 300}, {}]
    assert await _messages([data]) == [{"a": 1}, {"b": "x" * 300}, {}]


def test_an_envelope_is_a_flags_byte_a_big_endian_length_and_the_json() -> None:
    data = envelope({"pid": 7})
    assert data[0] == 0 and struct.unpack(">I", data[1:5])[0] == len(data) - 5
    assert data[5:] == b'{"pid":7}'
    end = end_stream(ConnectError(Code.NOT_FOUND, "gone"))
    assert end[0] == FLAG_END_STREAM
    assert end[5:] == b'{"error":{"code":"not_found","message":"gone"}}'
    assert end_stream(None)[5:] == b"{}"


async def test_negative_an_envelope_past_the_limit_is_refused_from_its_header() -> None:
    header = struct.pack(">BI", 0, 101)
    with pytest.raises(ConnectError) as caught:
        await _messages([header], limit=100)  # the 101 bytes never come: not waited for
    assert caught.value.code == Code.RESOURCE_EXHAUSTED
    exact = envelope({"k": "v" * 92})
    assert len(exact) - 5 == 100
    assert await _messages([exact], limit=100) == [{"k": "v" * 92}]


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (envelope({"a": 1})[:-1], Code.INVALID_ARGUMENT),  # truncated
        (b"\x00\x00", Code.INVALID_ARGUMENT),  # a header cut short
        (struct.pack(">BI", 1, 2) + b"{}", Code.UNIMPLEMENTED),  # compressed
        (struct.pack(">BI", 0, 3) + b"{x}", Code.INVALID_ARGUMENT),  # not JSON
        (struct.pack(">BI", 0, 2) + b"[]", Code.INVALID_ARGUMENT),  # not an object
        (struct.pack(">BI", 0, 2) + b"\xff\xfe", Code.INVALID_ARGUMENT),  # not UTF-8
    ],
)
async def test_negative_malformed_envelopes_are_refused(data: bytes, code: Code) -> None:
    with pytest.raises(ConnectError) as caught:
        await _messages([data])
    assert caught.value.code == code


async def test_negative_a_unary_body_past_the_limit_is_refused() -> None:
    assert await read_body(_receiver([b"x" * 50, b"y" * 50]), limit=100) == b"x" * 50 + b"y" * 50
    with pytest.raises(ConnectError) as caught:
        await read_body(_receiver([b"x" * 50, b"y" * 51]), limit=100)
    assert caught.value.code == Code.RESOURCE_EXHAUSTED


def test_fields_read_protobuf_json_by_either_name() -> None:
    fields = Fields(
        {
            "watcherId": "w1",
            "exit_code": "-3",
            "data": b64(b"\x00\xffhi"),
            "url": "AP9oaQ",  # url-safe, unpadded
            "signal": "SIGNAL_SIGKILL",
            "args": ["a", "b"],
            "envs": {"K": "V"},
        }
    )
    assert fields.string("watcher_id") == "w1"
    assert fields.integer("exit_code", low=-10, high=10) == -3
    assert fields.data("data", max_bytes=4) == b"\x00\xffhi"
    assert fields.data("url", max_bytes=4) == b"\x00\xffhi"
    assert fields.enum("signal", {"SIGNAL_SIGKILL": 9}) == 9
    assert fields.strings("args", max_items=2) == ["a", "b"]
    assert fields.string_map("envs", max_items=1) == {"K": "V"}
    assert fields.string("missing") == "" and fields.sub("missing") is None


@pytest.mark.parametrize(
    ("message", "read"),
    [
        ({"n": True}, lambda f: f.integer("n")),
        ({"n": 2**32}, lambda f: f.integer("n")),
        ({"s": 5}, lambda f: f.string("s")),
        ({"s": "a\0b"}, lambda f: f.string("s")),
        ({"d": "not base64!"}, lambda f: f.data("d", max_bytes=100)),
        ({"d": b64(b"x" * 5)}, lambda f: f.data("d", max_bytes=3)),
        ({"e": "SIGNAL_SIGSTOP"}, lambda f: f.enum("e", {"SIGNAL_SIGKILL": 9})),
        ({"a": ["x", 1]}, lambda f: f.strings("a", max_items=5)),
        ({"a": ["x"] * 3}, lambda f: f.strings("a", max_items=2)),
        ({"m": {"k": 1}}, lambda f: f.string_map("m", max_items=5)),
        ({"o": [1]}, lambda f: f.sub("o")),
        ({"pid": 1, "tag": "t"}, lambda f: f.oneof("pid", "tag")),
    ],
)
def test_negative_fields_of_the_wrong_shape_are_invalid_arguments(message: Any, read: Any) -> None:
    with pytest.raises(ConnectError) as caught:
        read(Fields(message))
    assert caught.value.code == Code.INVALID_ARGUMENT


def test_connect_timeout_ms_is_read_in_seconds() -> None:
    assert timeout_of({"connect-timeout-ms": "1500"}) == 1.5
    assert timeout_of({}) is None
    for bad in ("-1", "1.5", "12345678901"):
        with pytest.raises(ConnectError):
            timeout_of({"connect-timeout-ms": bad})


def _form(boundary: str, parts: list[tuple[str, bytes]]) -> bytes:
    body = b"preamble\r\n"
    for filename, data in parts:
        body += f"--{boundary}\r\n".encode()
        body += f'Content-Disposition: form-data; name="file"; filename="{filename}"\r\n'.encode()
        body += b"Content-Type: application/octet-stream\r\n\r\n" + data + b"\r\n"
    return body + f"--{boundary}--\r\n".encode()


async def _read_form(chunks: list[bytes], boundary: str) -> list[tuple[str | None, bytes]]:
    reader = MultipartReader(_receiver(chunks), boundary.encode())
    out = []
    async for part in reader:
        out.append((part.filename, b"".join([c async for c in reader.data()])))
    return out


async def test_multipart_parts_split_anywhere_stream_whole() -> None:
    tricky = b"--b\r\n\r\n--bo" + bytes(range(256))  # looks like a delimiter, is not
    parts = [("/tmp/a.txt", b"hello"), ("b/c.bin", tricky), ("empty", b"")]
    body = _form("bound", parts)
    assert await _read_form(_bytewise(body), "bound") == parts
    assert await _read_form([body], "bound") == parts


def test_a_boundary_is_read_quoted_or_not() -> None:
    assert boundary_of("multipart/form-data; boundary=abc") == b"abc"
    assert boundary_of('multipart/form-data; boundary="a b"') == b"a b"
    with pytest.raises(MultipartError):
        boundary_of("multipart/form-data")
    with pytest.raises(MultipartError):
        boundary_of("multipart/form-data; boundary=" + "x" * 71 + ";")


async def test_negative_a_form_past_the_part_limit_or_cut_short_is_refused() -> None:
    many = _form("b", [(f"f{i}", b"x") for i in range(MAX_PARTS + 1)])
    with pytest.raises(MultipartError):
        await _read_form([many], "b")
    assert len(await _read_form([_form("b", [("f", b"x")] * MAX_PARTS)], "b")) == MAX_PARTS
    cut = _form("b", [("f", b"data")])[:-12]
    with pytest.raises(MultipartError):
        await _read_form([cut], "b")


async def test_an_idle_stream_gets_keepalives_and_closing_it_closes_its_source() -> None:
    closed = []

    async def slow() -> AsyncIterator[dict[str, Any]]:
        try:
            yield {"n": 1}
            await asyncio.sleep(0.25)
            yield {"n": 2}
            await asyncio.sleep(3600)
            yield {"n": 3}
        finally:
            closed.append(True)

    source = slow()
    stream = with_keepalives(source, {"keepalive": {}}, 0.1)
    seen = [await anext(stream) for _ in range(4)]
    assert seen[0] == {"n": 1} and seen[-1] == {"n": 2}
    assert {"keepalive": {}} in seen[1:3]
    assert await anext(stream) == {"keepalive": {}}  # idle: the source is waiting
    await stream.aclose()  # type: ignore[attr-defined]
    for _ in range(200):  # the task driving the source closes it, soon
        if closed:
            break
        await asyncio.sleep(0.01)
    assert closed == [True]


async def test_without_keepalives_closing_the_stream_closes_its_source() -> None:
    closed = []

    async def endless() -> AsyncIterator[dict[str, Any]]:
        try:
            while True:
                yield {}
        finally:
            closed.append(True)

    stream = with_keepalives(endless(), {"keepalive": {}}, None)
    assert await anext(stream) == {}
    await stream.aclose()  # type: ignore[attr-defined]
    assert closed == [True]
