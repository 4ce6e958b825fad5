"""The budget of one guest channel: what a guest may make the node agent read and
parse, so that one guest never takes more than its share of the node's CPU (issue 17,
probe 3: a root guest flooding CREDIT frames held the node at 100% CPU).

Two token buckets, frames and bytes per second with a burst, are charged for every
chunk read from the guest. Past either, the channel stops reading until the tokens
have refilled: the guest's virtio-serial writes then block in the guest, which costs
the host nothing. A guest that stays over budget for ``ABUSE_AFTER_S`` without a break,
or sends more than ``MAX_SENSELESS_FRAMES`` frames in ``SENSELESS_WINDOW_S`` that make
no sense for the channel's state (CREDIT for a stream the host does not have open, a
PONG that answers nothing), is abusing it: ``ChannelAbuse`` is raised, and the channel
is closed and reported (space.node.channel.GuestChannel ``on_abuse``).

The rates sit far above what a legitimate guest sends (docs/protocol.md, "Budget"):
spaced sends DATA in chunks of up to 256 KiB, and only as much as the host granted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from space.node.core.token_bucket import Clock, TokenBucket
from space.protocol import ProtocolError

__all__ = [
    "ABUSE_AFTER_S",
    "BYTES_PER_S",
    "BYTE_BURST",
    "FRAMES_PER_S",
    "FRAME_BURST",
    "MAX_SENSELESS_FRAMES",
    "SENSELESS_WINDOW_S",
    "BudgetLimits",
    "ChannelAbuse",
    "ChannelBudget",
]

#: Frames per second a guest may send, sustained. Parsing costs the node about 3.5 us
#: a frame (228,000 CREDIT frames/s held a core), so this caps a channel near 8% of a
#: core. The busiest legitimate traffic, a process writing tiny chunks with a flush each,
#: reached 27,000 DATA frames/s for 0.4 s from spaced as a host process; in a VM under
#: TCG, 100,000 flushed lines took 16.9 s (under 5,900 frames/s even one frame a line).
#: The burst absorbs such spurts, the rate anything sustained.
FRAMES_PER_S = 20_000
#: Frames a guest may send at once above the rate.
FRAME_BURST = 50_000
#: Bytes per second a guest may send, sustained: a 200 MiB file read moved 540 MiB/s
#: and `yes | head -c 200M` 206 MiB/s through spaced as a host process; in a VM under
#: TCG a 100 MiB file read moved 8.7 MiB/s. Bytes cost the host little next to frames.
BYTES_PER_S = 1024 * 1024 * 1024
#: Bytes a guest may send at once above the rate.
BYTE_BURST = 256 * 1024 * 1024
#: A guest over budget this long without a break is abusing its channel.
ABUSE_AFTER_S = 5.0
#: Frames that make no sense for the channel's state tolerated per window: a few
#: CREDITs may cross a stream's end (a race, legitimate), a flood may not. At most
#: MAX_STREAMS streams end at once, each with at most one such CREDIT in flight.
MAX_SENSELESS_FRAMES = 1024
SENSELESS_WINDOW_S = 10.0


class ChannelAbuse(ProtocolError):
    """The guest abused its channel (over budget, or senseless frames); see the module
    docstring. Its message is the reason given to the sandbox's error."""


@dataclass(frozen=True, slots=True)
class BudgetLimits:
    """The numbers of one channel's budget (the module constants unless a test says)."""

    frames_per_s: float = FRAMES_PER_S
    frame_burst: float = FRAME_BURST
    bytes_per_s: float = BYTES_PER_S
    byte_burst: float = BYTE_BURST
    abuse_after_s: float = ABUSE_AFTER_S
    max_senseless_frames: int = MAX_SENSELESS_FRAMES
    senseless_window_s: float = SENSELESS_WINDOW_S


class ChannelBudget:
    """The budget of one channel; the reader calls ``charge`` per chunk, ``senseless``
    per senseless frame, and waits ``throttle_s()`` before reading on."""

    def __init__(self, limits: BudgetLimits | None = None, clock: Clock = time.monotonic) -> None:
        self.limits = limits = limits or BudgetLimits()
        self._clock = clock
        self._frames = TokenBucket(limits.frames_per_s, limits.frame_burst, clock)
        self._bytes = TokenBucket(limits.bytes_per_s, limits.byte_burst, clock)
        self._over_since: float | None = None
        self._over_frames = 0
        self._over_bytes = 0
        self._senseless_since = clock()
        self._senseless = 0
        #: Frames and bytes read in all; times the reader paused for tokens, and for
        #: how long in all (for tests and figures).
        self.frames_read = 0
        self.bytes_read = 0
        self.throttled = 0
        self.throttled_s = 0.0

    def charge(self, frames: int, size: int) -> None:
        self.frames_read += frames
        self.bytes_read += size
        self._frames.charge(frames)
        self._bytes.charge(size)
        if self._over_since is not None:
            self._over_frames += frames
            self._over_bytes += size

    def throttle_s(self) -> float:
        """Seconds to stop reading (0: read on). Raises ChannelAbuse once the guest has
        been over budget for ``abuse_after_s`` without a break: an over-budget period
        ends only once half of each burst has built up again."""
        wait_s = max(self._frames.wait_s(), self._bytes.wait_s())
        now = self._clock()
        if wait_s <= 0:
            # The period ends once the guest has let half a burst build up again: a
            # flood read at the rate keeps the buckets near empty (a short read after
            # a long sleep only lifts them above zero for a moment).
            if self._frames.tokens >= self._frames.burst / 2 and (
                self._bytes.tokens >= self._bytes.burst / 2
            ):
                self._over_since = None
            return 0.0
        if self._over_since is None:
            self._over_since, self._over_frames, self._over_bytes = now, 0, 0
        elif now - self._over_since >= self.limits.abuse_after_s:
            raise ChannelAbuse(self._over_budget(now - self._over_since))
        self.throttled += 1
        self.throttled_s += wait_s
        return wait_s

    def _over_budget(self, elapsed_s: float) -> str:
        limits = self.limits
        return (
            f"guest channel abuse: over budget for {elapsed_s:.1f} s "
            f"(limits {limits.frames_per_s:,.0f} frames/s and "
            f"{limits.bytes_per_s / 2**20:,.0f} MiB/s; read {self._over_frames / elapsed_s:,.0f} "
            f"frames/s and {self._over_bytes / elapsed_s / 2**20:,.1f} MiB/s while throttled)"
        )

    def senseless(self, what: str) -> None:
        """Count a frame that makes no sense for the channel's state; raises
        ChannelAbuse past ``max_senseless_frames`` in ``senseless_window_s``."""
        now = self._clock()
        limits = self.limits
        if now - self._senseless_since >= limits.senseless_window_s:
            self._senseless_since, self._senseless = now, 0
        self._senseless += 1
        if self._senseless > limits.max_senseless_frames:
            raise ChannelAbuse(
                f"guest channel abuse: {self._senseless:,} senseless frames in "
                f"{now - self._senseless_since:.1f} s (limit {limits.max_senseless_frames:,} "
                f"per {limits.senseless_window_s:g} s; the last: {what})"
            )
