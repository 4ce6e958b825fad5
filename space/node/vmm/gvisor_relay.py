"""A gVisor sandbox's channel relay: the process that holds the host's end of spaced's
stdio and lets node agents reach it, one at a time, through a unix socket, as QEMU's
chardev socket does for a VM's virtio-serial port. It outlives the node agent, so a
restarted node talks to a running gVisor sandbox again (issue 21).

On stdio spaced cannot see a host hang up, as it can on a virtio-serial port, so the
relay keeps each direction whole at frame boundaries:

- to the guest it passes whole frames only: a node that goes mid-frame leaves no torn
  frame behind, and the next node's HELLO starts a new session in spaced;
- from the guest it passes to a node only frames from the guest's first HELLO after
  that node connected: what spaced still sent for an earlier session (or while no node
  was connected, all of it) is read and dropped, as the port drops it on a hang-up.

A newer connection replaces the current one (a node agent restarted before the old
one's socket was closed). Each side is read only while what it sent the other is
below ``MAX_BUFFERED`` bytes, so a stalled side backs up into its peer, never into
memory. A length either side's frame gives that the protocol refuses drops that node,
or, from the guest, ends the relay; so does the guest's end closing (the sandbox
stopped), which is how the relay ends.

Run as ``python3 -m space.node.vmm.gvisor_relay GUEST_FD LISTEN_FD SOCKET_PATH`` with
the guest's end and the listening socket handed over (by GvisorGuest.launch); the
path only names the relay, for a restarted node to find it.
"""

from __future__ import annotations

import os
import selectors
import socket
import sys
from collections.abc import Iterator

from space.protocol import (
    FrameKind,
    ProtocolError,
    check_length,
    length_prefix_bytes,
    unpack_length,
)

__all__ = ["MAX_BUFFERED", "FrameCursor", "Relay", "main"]

#: Bytes either side may have waiting for the other before it is no longer read.
MAX_BUFFERED = 1 << 20
_READ_BYTES = 256 * 1024
#: A frame's first bytes: its length and its kind (one byte).
_LENGTH_BYTES = length_prefix_bytes()
_HEAD_BYTES = _LENGTH_BYTES + 1


class FrameCursor:
    """Where one direction's byte stream is among its frames; lengths are checked."""

    def __init__(self) -> None:
        self._head = bytearray()
        self._left = 0  # bytes of the current frame after its head

    @property
    def at_boundary(self) -> bool:
        return self._left == 0 and not self._head

    def feed(self, data: memoryview) -> Iterator[tuple[int | None, memoryview]]:
        """``data`` cut into pieces, each within one frame: a frame's head comes as
        one piece tagged with its kind, the rest untagged (None). Raises
        ProtocolError for a length the protocol refuses."""
        at = 0
        while at < len(data):
            if self._left == 0:
                take = data[at : at + _HEAD_BYTES - len(self._head)]
                self._head += take
                at += len(take)
                if len(self._head) < _HEAD_BYTES:
                    return
                length = unpack_length(bytes(self._head[:_LENGTH_BYTES]))
                kind = self._head[_LENGTH_BYTES]
                check_length(length)
                head, self._head = memoryview(bytes(self._head)), bytearray()
                self._left = length - 1  # a valid length covers the kind and stream id
                yield kind, head
            else:
                take = data[at : at + self._left]
                self._left -= len(take)
                at += len(take)
                yield None, take


class Relay:
    """The relay of one sandbox: ``run`` serves until the guest's end closes."""

    def __init__(self, guest: socket.socket, listener: socket.socket) -> None:
        self._guest = guest
        self._listener = listener
        self._node: socket.socket | None = None
        self._selector = selectors.DefaultSelector()
        self._to_guest = bytearray()  # whole frames from the node
        self._partial = bytearray()  # the node's frame not yet whole
        self._to_node = bytearray()
        self._from_node = FrameCursor()
        self._from_guest = FrameCursor()
        self._passing = False  # the guest's current frame goes to the node
        self._hello_seen = False  # the guest answered this node's HELLO
        for sock in (guest, listener):
            sock.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ)
        self._selector.register(guest, selectors.EVENT_READ)

    def run(self) -> None:
        try:
            while self._step():
                pass
        finally:
            self._drop_node()
            self._selector.close()

    def _step(self) -> bool:
        for key, events in self._selector.select():
            sock = key.fileobj
            if sock is self._listener:
                self._accept()
            elif sock is self._guest:
                if events & selectors.EVENT_WRITE and not self._flush(self._guest, self._to_guest):
                    return False
                if events & selectors.EVENT_READ and not self._from_guest_readable():
                    return False
            elif sock is self._node and not self._serve_node(events):
                self._drop_node()
            self._update()
        return True

    def _serve_node(self, events: int) -> bool:
        """Write and read the node as due; False once it went (or broke the framing)."""
        assert self._node is not None
        if events & selectors.EVENT_WRITE and not self._flush(self._node, self._to_node):
            return False
        return not events & selectors.EVENT_READ or self._from_node_readable()

    def _accept(self) -> None:
        try:
            node, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        self._drop_node()
        node.setblocking(False)
        self._node = node
        self._selector.register(node, selectors.EVENT_READ)
        # The guest's frame under way belongs to no one now; HELLO opens the way.
        self._passing = False
        self._hello_seen = False

    def _drop_node(self) -> None:
        if self._node is not None:
            self._selector.unregister(self._node)
            self._node.close()
            self._node = None
        self._partial.clear()
        self._from_node = FrameCursor()
        self._to_node.clear()
        self._passing = False

    def _from_guest_readable(self) -> bool:
        """Read the guest; False once it ended (or broke the framing)."""
        data = _receive(self._guest)
        if data is None:
            return False
        try:
            for kind, piece in self._from_guest.feed(memoryview(data)):
                if kind is not None:
                    if self._node is not None and kind == FrameKind.HELLO:
                        self._hello_seen = True
                    self._passing = self._node is not None and self._hello_seen
                if self._passing:
                    self._to_node += piece
        except ProtocolError:
            return False
        return True

    def _from_node_readable(self) -> bool:
        """Read the node; False once it went (or broke the framing)."""
        assert self._node is not None
        data = _receive(self._node)
        if data is None:
            return False
        try:
            for _, piece in self._from_node.feed(memoryview(data)):
                self._partial += piece
                if self._from_node.at_boundary:
                    self._to_guest += self._partial
                    self._partial.clear()
        except ProtocolError:
            return False
        return True

    @staticmethod
    def _flush(sock: socket.socket, buffer: bytearray) -> bool:
        """Write what ``sock`` takes now; False once it cannot take any more."""
        try:
            sent = sock.send(buffer)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        del buffer[:sent]
        return True

    def _update(self) -> None:
        """Read a side only while the other's buffer has room; write what is due."""
        node = self._node
        guest_events = selectors.EVENT_WRITE if self._to_guest else 0
        if len(self._to_node) < MAX_BUFFERED:
            guest_events |= selectors.EVENT_READ
        self._modify(self._guest, guest_events)
        if node is not None:
            node_events = selectors.EVENT_WRITE if self._to_node else 0
            if len(self._to_guest) < MAX_BUFFERED:
                node_events |= selectors.EVENT_READ
            self._modify(node, node_events)

    def _modify(self, sock: socket.socket, events: int) -> None:
        registered = self._selector.get_map().get(sock)
        if registered is not None and registered.events == events:
            return
        if registered is not None:
            self._selector.unregister(sock)
        if events:
            self._selector.register(sock, events)


def _receive(sock: socket.socket) -> bytes | None:
    """What ``sock`` has now (b"" if nothing yet); None once it ended or failed."""
    try:
        return sock.recv(_READ_BYTES) or None
    except (BlockingIOError, InterruptedError):
        return b""
    except OSError:
        return None


def main(argv: list[str] | None = None) -> None:
    guest_fd, listen_fd = (int(arg) for arg in (argv or sys.argv[1:])[:2])
    for fd in (guest_fd, listen_fd):
        os.set_inheritable(fd, False)
    Relay(socket.socket(fileno=guest_fd), socket.socket(fileno=listen_fd)).run()


if __name__ == "__main__":
    main()
