"""The framing of a btrfs send stream as both the node agent and the root broker follow
it (space.node.core.send_stream): what passes, and where a stream that lost its
framing is refused. Synthetic streams: the real ones are in test_subvolume_streams."""

from __future__ import annotations

import struct

import pytest

from space.node.api import InvalidArgument
from space.node.core.send_stream import SendStreamFraming

_HEADER = b"btrfs-stream\0" + struct.pack("<I", 1)
_SUBVOL, _SNAPSHOT, _WRITE, _END = 1, 2, 15, 21


def _command(number: int, payload: bytes) -> bytes:
    return struct.pack("<IHI", len(payload), number, 0) + payload


def _stream(*commands: tuple[int, bytes]) -> bytes:
    return _HEADER + b"".join(_command(n, p) for n, p in commands)


_GOOD = _stream((_SUBVOL, b"s" * 40), (_WRITE, b"w" * 70_000), (_WRITE, b""), (_END, b""))


def _fed(data: bytes, size: int) -> SendStreamFraming:
    framing = SendStreamFraming()
    for start in range(0, len(data), size):
        framing.feed(data[start : start + size])
    return framing


@pytest.mark.parametrize("size", [1, 7, 10, 4096, 1 << 20])
def test_a_whole_stream_passes_in_chunks_of_any_size(size: int) -> None:
    framing = _fed(_GOOD, size)
    framing.finish()
    assert (framing.parsed, framing.ended) == (len(_GOOD), True)


def test_an_incremental_stream_opens_with_a_snapshot() -> None:
    _fed(_stream((_SNAPSHOT, b"p" * 60), (_END, b"")), 3).finish()


def test_negative_bytes_slipped_in_are_refused_where_the_framing_is_lost() -> None:
    at = len(_HEADER) + 10 + 40  # after the subvolume command
    bad = _GOOD[:at] + b"\x6c\xf9\x3b\x9e\xd4\x30\x3f\xbc\x84\xad" + _GOOD[at:]
    with pytest.raises(InvalidArgument) as refused:
        _fed(bad, 1000)
    assert refused.value.message == (
        f"a stream command {0x30D4} of {0x9E3BF96C} bytes (header 6cf93b9ed4303fbc84ad"
        f" at byte {at}, command 2; the one before: 1, of 40 bytes)"
    )


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        pytest.param(b"not a stream" * 3, "not a btrfs send stream", id="no-magic"),
        pytest.param(
            b"btrfs-stream\0" + struct.pack("<I", 9) + _GOOD[17:],
            "not a btrfs send stream",
            id="unknown-version",
        ),
        pytest.param(_stream((_WRITE, b"w")), "exactly one subvolume", id="no-subvolume-first"),
        pytest.param(_stream((_SUBVOL, b""), (_SNAPSHOT, b"")), "exactly one subvolume", id="two"),
        pytest.param(_stream((_SUBVOL, b""), (0, b"")), "command 0 of 0 bytes", id="command-0"),
        pytest.param(_stream((_SUBVOL, b""), (27, b"")), "command 27 of 0", id="command-27"),
        pytest.param(_GOOD + b"x", "after the stream's end command", id="after-the-end"),
    ],
)
def test_negative_what_no_send_stream_holds_is_refused(bad: bytes, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        _fed(bad, 5)


@pytest.mark.parametrize("keep", [0, 5, 17, 20, len(_GOOD) - 10, len(_GOOD) - 1])
def test_negative_a_cut_stream_does_not_finish(keep: int) -> None:
    framing = _fed(_GOOD[:keep], 3)
    with pytest.raises(InvalidArgument, match=f"stops after {keep} bytes, before its end"):
        framing.finish()
