"""The guest channel: the host end of the protocol to a guest's ``spaced``
(docs/protocol.md). ``GuestChannel`` is its whole public surface; framing and flow
control (``_core``), stream objects (``_streams``) and answer parsing (``_parse``) are
private."""

from space.node.channel.guest_channel import DEFAULT_REQUEST_TIMEOUT_S, GuestChannel

__all__ = ["DEFAULT_REQUEST_TIMEOUT_S", "GuestChannel"]
