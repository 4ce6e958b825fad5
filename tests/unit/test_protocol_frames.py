"""Properties of the frame decoder and payload codecs (space.protocol)."""

from __future__ import annotations

import itertools
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from space.protocol import (
    DATA_HEADER_BYTES,
    MAX_FRAME_BYTES,
    MAX_JSON_BYTES,
    MAX_PAYLOAD_BYTES,
    Channel,
    Frame,
    FrameDecoder,
    FrameKind,
    ProtocolError,
    check_length,
    decode_credit,
    decode_data,
    decode_data_view,
    decode_eof,
    decode_json,
    encode_credit,
    encode_data,
    encode_data_frame,
    encode_frame,
    encode_json,
    pack_data_header,
)

frames = st.builds(
    Frame,
    kind=st.sampled_from(FrameKind),
    stream=st.integers(0, 2**32 - 1),
    payload=st.binary(max_size=2048),
)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


@given(st.lists(frames, max_size=8), st.lists(st.integers(0, 10**6), max_size=16))
def test_frames_round_trip_however_the_bytes_are_split(sent: list[Frame], cuts: list[int]) -> None:
    wire = b"".join(encode_frame(f.kind, f.stream, f.payload) for f in sent)
    decoder = FrameDecoder()
    received: list[Frame] = []
    for piece in split(wire, cuts):
        received.extend(decoder.feed(piece))
    assert received == sent
    assert decoder.buffered_bytes == 0


@given(frames, st.data())
def test_a_truncated_frame_yields_nothing_and_no_error(frame: Frame, data: st.DataObject) -> None:
    wire = encode_frame(frame.kind, frame.stream, frame.payload)
    cut = data.draw(st.integers(0, len(wire) - 1))
    decoder = FrameDecoder()
    assert decoder.feed(wire[:cut]) == []
    assert not decoder.broken
    assert decoder.feed(wire[cut:]) == [frame]


@given(st.integers(MAX_FRAME_BYTES + 1, 2**32 - 1))
def test_negative_an_oversized_length_is_rejected_before_buffering(length: int) -> None:
    decoder = FrameDecoder()
    with pytest.raises(ProtocolError):
        decoder.feed(struct.pack(">I", length) + b"\0" * 100)
    assert decoder.buffered_bytes == 0 and decoder.broken
    with pytest.raises(ProtocolError):
        decoder.feed(b"more")


@settings(max_examples=300)
@given(st.binary(max_size=4096))
def test_garbage_raises_nothing_but_protocol_error(garbage: bytes) -> None:
    decoder = FrameDecoder()
    try:
        for frame in decoder.feed(garbage):
            assert isinstance(frame.kind, FrameKind)
    except ProtocolError:
        assert decoder.broken
    assert decoder.buffered_bytes <= len(garbage)


def test_exactly_max_payload_bytes_is_accepted_and_one_more_is_rejected() -> None:
    payload = b"x" * MAX_PAYLOAD_BYTES
    (frame,) = FrameDecoder().feed(encode_frame(FrameKind.DATA, 1, payload))
    assert frame.payload == payload
    check_length(MAX_FRAME_BYTES)
    with pytest.raises(ProtocolError):
        check_length(MAX_FRAME_BYTES + 1)
    with pytest.raises(ProtocolError):
        encode_frame(FrameKind.DATA, 1, payload + b"x")
    decoder = FrameDecoder()
    with pytest.raises(ProtocolError):
        decoder.feed(struct.pack(">IBI", MAX_FRAME_BYTES + 1, FrameKind.DATA, 1))
    assert decoder.buffered_bytes == 0


def test_negative_a_length_shorter_than_the_header_is_rejected() -> None:
    with pytest.raises(ProtocolError):
        FrameDecoder().feed(struct.pack(">I", 4) + b"\x01\0\0\0")


def test_negative_an_unknown_kind_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="unknown frame kind"):
        FrameDecoder().feed(struct.pack(">IBI", 5, 200, 0))


@given(st.dictionaries(st.text(max_size=20), st.integers() | st.text(max_size=50), max_size=20))
def test_json_objects_round_trip(message: dict[str, object]) -> None:
    assert decode_json(encode_json(message)) == message


@pytest.mark.parametrize(
    "payload",
    [b"[1, 2]", b"3", b'"s"', b"null", b"\xff\xfe{}", b"{", b"", b'{"a": 1} x'],
    ids=["array", "number", "string", "null", "bad utf-8", "truncated", "empty", "trailing"],
)
def test_negative_decode_json_rejects_anything_but_an_object(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_json(payload)


def test_negative_decode_json_rejects_oversized_messages_at_the_boundary() -> None:
    filler = "x" * (MAX_JSON_BYTES - len('{"a":""}'))
    assert decode_json(f'{{"a":"{filler}"}}'.encode()) == {"a": filler}
    with pytest.raises(ProtocolError):
        decode_json(f'{{"a":"{filler}x"}}'.encode())
    with pytest.raises(ProtocolError):
        encode_json({"a": filler + "x"})


def test_negative_decode_json_rejects_deep_nesting() -> None:
    with pytest.raises(ProtocolError):
        decode_json(b"[" * 50_000 + b"]" * 50_000)


@given(st.sampled_from(Channel), st.binary(max_size=1000))
def test_data_round_trips_with_its_channel(channel: Channel, chunk: bytes) -> None:
    assert decode_data(encode_data(channel, chunk)) == (channel, chunk)


def test_negative_data_eof_and_credit_payloads_are_validated() -> None:
    for bad in (b"", b"\x07x"):
        with pytest.raises(ProtocolError):
            decode_data(bad)
    for bad in (b"", b"\x01\x01", b"\x09"):
        with pytest.raises(ProtocolError):
            decode_eof(bad)
    assert decode_credit(encode_credit(65536)) == 65536
    for bad in (b"", b"\0\0\0", encode_credit(0), b"\0\0\0\0\0"):
        with pytest.raises(ProtocolError):
            decode_credit(bad)


def test_frames_survive_the_caller_reusing_its_read_buffer() -> None:
    # The guest transport reads into one buffer and feeds views of it: the decoder must
    # copy what it keeps, including a partial frame carried over between feeds.
    sent = [Frame(FrameKind.DATA, n, bytes([n]) * (1000 + 37 * n)) for n in range(1, 60)]
    wire = b"".join(encode_frame(f.kind, f.stream, f.payload) for f in sent)
    decoder = FrameDecoder()
    shared = bytearray(4096)
    got: list[Frame] = []
    for start in range(0, len(wire), 4096):
        piece = wire[start : start + 4096]
        shared[: len(piece)] = piece
        got += decoder.feed(memoryview(shared)[: len(piece)])
        shared[:] = bytes(len(shared))  # the next read overwrites the buffer
    assert got == sent
    assert decoder.buffered_bytes == 0


def test_data_frames_built_in_place_match_encode_frame() -> None:
    chunk = bytes(range(256)) * 4
    expected = encode_frame(FrameKind.DATA, 9, encode_data(Channel.ERROR, chunk))
    assert encode_data_frame(9, Channel.ERROR, memoryview(chunk)) == expected
    frame = bytearray(DATA_HEADER_BYTES) + chunk
    pack_data_header(frame, 9, Channel.ERROR, len(chunk))
    assert bytes(frame) == expected
    channel, view = decode_data_view(expected[4 + 5 :])
    assert channel is Channel.ERROR and bytes(view) == chunk


def test_negative_an_in_place_data_frame_larger_than_the_maximum_is_refused() -> None:
    with pytest.raises(ProtocolError):
        pack_data_header(bytearray(DATA_HEADER_BYTES), 1, Channel.OUTPUT, MAX_PAYLOAD_BYTES)
    with pytest.raises(ProtocolError):
        encode_data_frame(2**32, Channel.OUTPUT, b"x")
