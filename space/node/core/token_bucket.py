"""A token bucket: ``rate_per_s`` tokens a second up to ``burst``, on an injected clock.

One shape for every per-second budget of the node: a guest channel's frames and bytes
(space.node.channel) and a sandbox's egress audit events (space.node.egress.audit).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Clock", "TokenBucket"]

#: Monotonic seconds; tests pass their own to move time.
Clock = Callable[[], float]


class TokenBucket:
    """``rate_per_s`` tokens per second up to ``burst``; charges may overdraw it.

    Overdrawing instead of refusing lets a reader charge what it has already read; the
    debt is paid by waiting ``wait_s()`` before reading more.
    """

    def __init__(self, rate_per_s: float, burst: float, clock: Clock) -> None:
        if rate_per_s <= 0 or burst <= 0:
            raise ValueError("a token bucket needs a positive rate and burst")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._at = clock()

    @property
    def tokens(self) -> float:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate_per_s)
        self._at = now
        return self._tokens

    def charge(self, amount: float) -> None:
        self._tokens = self.tokens - amount

    def wait_s(self) -> float:
        """Seconds until the bucket is out of debt (0 if it is)."""
        tokens = self.tokens
        return 0.0 if tokens >= 0 else -tokens / self.rate_per_s
