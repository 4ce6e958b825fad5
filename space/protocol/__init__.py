"""The wire protocol between the host and `spaced`, shared by both sides (stdlib only).

See docs/protocol.md for the session and stream rules; this package holds the framing
(`_frames`) and the payload codecs (`_messages`).
"""

from ._frames import (
    DATA_HEADER_BYTES,
    HEADER_BYTES,
    MAX_FRAME_BYTES,
    MAX_PAYLOAD_BYTES,
    Channel,
    Frame,
    FrameDecoder,
    FrameKind,
    ProtocolError,
    check_length,
    encode_data_frame,
    encode_frame,
    length_prefix_bytes,
    pack_data_header,
    parse_body,
    unpack_length,
)
from ._messages import (
    DATA_CHUNK_BYTES,
    INITIAL_WINDOW_BYTES,
    MAX_JSON_BYTES,
    MAX_PING_BYTES,
    MAX_STREAMS,
    PROTOCOL_VERSION,
    ErrorCode,
    Op,
    decode_credit,
    decode_data,
    decode_data_view,
    decode_eof,
    decode_json,
    encode_credit,
    encode_data,
    encode_eof,
    encode_json,
)

#: Name of the virtio-serial port the guest daemon talks on.
PORT_NAME = "space.agent"

__all__ = [
    "DATA_CHUNK_BYTES",
    "DATA_HEADER_BYTES",
    "HEADER_BYTES",
    "INITIAL_WINDOW_BYTES",
    "MAX_FRAME_BYTES",
    "MAX_JSON_BYTES",
    "MAX_PAYLOAD_BYTES",
    "MAX_PING_BYTES",
    "MAX_STREAMS",
    "PORT_NAME",
    "PROTOCOL_VERSION",
    "Channel",
    "ErrorCode",
    "Frame",
    "FrameDecoder",
    "FrameKind",
    "Op",
    "ProtocolError",
    "check_length",
    "decode_credit",
    "decode_data",
    "decode_data_view",
    "decode_eof",
    "decode_json",
    "encode_credit",
    "encode_data",
    "encode_data_frame",
    "encode_eof",
    "encode_frame",
    "encode_json",
    "length_prefix_bytes",
    "pack_data_header",
    "parse_body",
    "unpack_length",
]
