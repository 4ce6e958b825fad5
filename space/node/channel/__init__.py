"""The guest channel: the host end of the protocol to a guest's ``spaced``
(docs/protocol.md). ``GuestChannel`` is its whole public surface; framing and flow
control (``_core``), how long a wait on the guest may last (``_liveness``), stream
objects (``_streams``) and answer parsing (``_parse``) are private."""

from space.node.channel.guest_channel import (
    DEFAULT_PING_INTERVAL_S,
    DEFAULT_SILENCE_TIMEOUT_S,
    GuestChannel,
)

__all__ = ["DEFAULT_PING_INTERVAL_S", "DEFAULT_SILENCE_TIMEOUT_S", "GuestChannel"]
