"""The gVisor channel relay (space.node.vmm.gvisor_relay) as its own process, between a
socket standing for spaced's stdio and node connections to its listening socket: whole
frames only to the guest, the guest's frames to a node only from its HELLO answer on,
a newer node replacing an older one, bounded buffers, and its end with the guest's."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from space.node.vmm.gvisor_relay import MAX_BUFFERED, FrameCursor
from space.protocol import MAX_FRAME_BYTES, FrameDecoder, FrameKind, ProtocolError, encode_frame

_WAIT_S = 10.0


class _Relay:
    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "channel.sock"
        self.guest, theirs = socket.socketpair()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        listener.listen(2)
        fds = (theirs.fileno(), listener.fileno())
        self.process = subprocess.Popen(
            [sys.executable, "-m", "space.node.vmm.gvisor_relay", *map(str, fds), str(self.path)],
            pass_fds=fds,
        )
        theirs.close()
        listener.close()
        self.guest.settimeout(_WAIT_S)
        self.nodes: list[socket.socket] = []

    def node(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.nodes.append(sock)
        sock.connect(str(self.path))
        sock.settimeout(_WAIT_S)
        return sock

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        for sock in (self.guest, *self.nodes):
            sock.close()


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[_Relay]:
    r = _Relay(tmp_path)
    yield r
    r.close()


def _frames(sock: socket.socket, count: int) -> list[tuple[FrameKind, int, bytes]]:
    decoder, got = FrameDecoder(), list[tuple[FrameKind, int, bytes]]()
    while len(got) < count:
        data = sock.recv(65536)
        assert data, f"closed after {got}"
        got += [(f.kind, f.stream, f.payload) for f in decoder.feed(data)]
    return got


def _quiet(sock: socket.socket, for_s: float = 0.5) -> bool:
    """Whether nothing comes on ``sock`` for ``for_s``."""
    sock.settimeout(for_s)
    try:
        sock.recv(1)
    except TimeoutError:
        return True
    finally:
        sock.settimeout(_WAIT_S)
    return False


def _hello(session: str) -> bytes:
    return encode_frame(FrameKind.HELLO, 0, session.encode())


def test_frames_pass_both_ways_once_the_guest_answered_hello(relay: _Relay) -> None:
    relay.guest.sendall(encode_frame(FrameKind.EVENT, 3, b"before any node"))
    node = relay.node()
    node.sendall(_hello("one") + encode_frame(FrameKind.PING, 0, b"p"))
    assert _frames(relay.guest, 2) == [
        (FrameKind.HELLO, 0, b"one"),
        (FrameKind.PING, 0, b"p"),
    ]
    # An earlier session's frame sent after this node connected is not its: dropped.
    relay.guest.sendall(encode_frame(FrameKind.RESULT, 7, b"stale"))
    relay.guest.sendall(_hello("one") + encode_frame(FrameKind.PONG, 0, b"p"))
    assert _frames(node, 2) == [(FrameKind.HELLO, 0, b"one"), (FrameKind.PONG, 0, b"p")]
    big = b"x" * (MAX_FRAME_BYTES - 5)  # the largest payload, in many reads
    relay.guest.sendall(encode_frame(FrameKind.DATA, 9, big))
    assert _frames(node, 1) == [(FrameKind.DATA, 9, big)]


def test_a_node_gone_mid_frame_leaves_no_torn_frame_and_the_next_one_is_served(
    relay: _Relay,
) -> None:
    first = relay.node()
    whole = encode_frame(FrameKind.OPEN, 1, b'{"op": "exec"}')
    first.sendall(_hello("one") + whole[:7])
    assert _frames(relay.guest, 1) == [(FrameKind.HELLO, 0, b"one")]
    relay.guest.sendall(_hello("one"))
    assert _frames(first, 1) == [(FrameKind.HELLO, 0, b"one")]
    # The guest is mid-frame for the first node when it goes.
    relay.guest.sendall(encode_frame(FrameKind.DATA, 1, b"y" * 100)[:20])
    first.close()
    time.sleep(0.2)
    second = relay.node()
    second.sendall(_hello("two"))
    assert _frames(relay.guest, 1) == [(FrameKind.HELLO, 0, b"two")]  # no torn OPEN first
    relay.guest.sendall(encode_frame(FrameKind.DATA, 1, b"y" * 100)[20:])  # the rest
    relay.guest.sendall(_hello("two"))
    assert _frames(second, 1) == [(FrameKind.HELLO, 0, b"two")]


def test_a_newer_node_replaces_the_current_one(relay: _Relay) -> None:
    first = relay.node()
    first.sendall(_hello("one"))
    assert _frames(relay.guest, 1)[0][2] == b"one"
    second = relay.node()
    assert first.recv(1) == b""  # closed by the relay
    second.sendall(_hello("two"))
    assert _frames(relay.guest, 1)[0][2] == b"two"


def test_a_node_frame_of_a_refused_length_drops_that_node_only(relay: _Relay) -> None:
    bad = relay.node()
    bad.sendall((MAX_FRAME_BYTES + 1).to_bytes(4, "big") + b"\x02")
    assert bad.recv(1) == b""
    assert _quiet(relay.guest)
    good = relay.node()
    good.sendall(_hello("ok"))
    assert _frames(relay.guest, 1)[0][2] == b"ok"


def test_a_guest_frame_of_a_refused_length_ends_the_relay(relay: _Relay) -> None:
    node = relay.node()
    relay.guest.sendall((1).to_bytes(4, "big") + b"\x01")
    assert node.recv(1) == b""
    assert relay.process.wait(timeout=_WAIT_S) == 0


def test_the_relay_ends_with_the_guest(relay: _Relay) -> None:
    node = relay.node()
    relay.guest.close()
    assert node.recv(1) == b""
    assert relay.process.wait(timeout=_WAIT_S) == 0


def test_a_guest_that_reads_nothing_backs_up_into_the_node_not_into_memory(
    relay: _Relay,
) -> None:
    node = relay.node()
    node.sendall(_hello("one"))  # the relay runs: what follows is its doing
    assert _frames(relay.guest, 1)[0][2] == b"one"
    node.setblocking(False)
    stream = memoryview(encode_frame(FrameKind.DATA, 1, b"z" * 65536) * 512)  # 32 MiB
    sent, stalled_since = 0, None
    while stalled_since is None or time.monotonic() - stalled_since < 0.5:
        try:
            sent += node.send(stream[sent:])
            stalled_since = None
        except BlockingIOError:
            stalled_since = stalled_since or time.monotonic()
            time.sleep(0.05)
    # What the relay holds plus the three sockets' buffers, no more.
    assert MAX_BUFFERED <= sent < MAX_BUFFERED + 16 * 1024 * 1024
    rss_kib = int(
        Path(f"/proc/{relay.process.pid}/status").read_text().split("VmRSS:")[1].split()[0]
    )
    assert rss_kib < 64 * 1024


def test_the_cursor_cuts_at_frame_ends_and_refuses_a_bad_length() -> None:
    cursor = FrameCursor()
    data = encode_frame(FrameKind.PING, 0, b"ab") + encode_frame(FrameKind.PONG, 0, b"")
    pieces = []
    for byte in data:  # one byte at a time: heads are gathered across reads
        pieces += [(kind, bytes(piece)) for kind, piece in cursor.feed(memoryview(bytes([byte])))]
    kinds = [kind for kind, _ in pieces if kind is not None]
    assert kinds == [FrameKind.PING, FrameKind.PONG]
    assert b"".join(piece for _, piece in pieces) == data
    assert cursor.at_boundary
    with pytest.raises(ProtocolError):
        list(FrameCursor().feed(memoryview((4).to_bytes(4, "big") + b"\x01")))
