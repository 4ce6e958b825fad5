"""How long the host waits for its guest: as long as the guest shows signs of life.

A guest under load (its emulated CPU shared with dozens of VMs, its daemon serving other
streams) answers late, but it answers. A wait measured by the clock alone cannot tell
that guest from a dead one, and failed execs whose guests were working (issue 15: "exec
took longer than 30.0 s" with 48 sandboxes on 2 cores). So no wait of the host on a
guest is bounded by how long it takes; each is bounded by the guest's *silence*:

- ``heard()`` is called for every frame the guest sends, on any stream.
- A wait under ``watch()`` raises TimeoutError once the guest has sent nothing for
  ``silence_timeout_s``, counted from the later of the wait's start and the last frame.
- While a wait hears nothing for ``ping_interval_s``, the host sends a PING (at most one
  per interval for the whole channel). spaced answers PING from its frame dispatcher,
  whatever its streams are doing, so a guest whose daemon runs at all is heard from
  about once per interval, and only a guest that is gone or stuck (kernel hung, vCPUs
  stopped, daemon blocked) stays silent for ``silence_timeout_s``.

The clock is the event loop's. Nothing here blocks or allocates per frame.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from types import TracebackType

__all__ = ["DEFAULT_PING_INTERVAL_S", "DEFAULT_SILENCE_TIMEOUT_S", "Liveness", "Watch"]

#: Longest silence of a guest a wait tolerates: what the fixed request deadline was, so
#: a dead guest is found no later than before (and a busy one is no longer failed).
DEFAULT_SILENCE_TIMEOUT_S = 30.0
#: How often a silent guest is pinged while the host waits on it: six chances to answer
#: before the silence timeout (a PONG costs the guest one small frame).
DEFAULT_PING_INTERVAL_S = 5.0


class Liveness:
    """When one channel's guest was last heard from, and the watches over waits on it.

    ``send_ping`` writes a PING without waiting (it runs in a timer callback); it must
    not raise.
    """

    def __init__(
        self,
        send_ping: Callable[[], None],
        *,
        silence_timeout_s: float = DEFAULT_SILENCE_TIMEOUT_S,
        ping_interval_s: float = DEFAULT_PING_INTERVAL_S,
    ) -> None:
        if not 0 < ping_interval_s <= silence_timeout_s:
            raise ValueError(
                f"need 0 < ping_interval_s ({ping_interval_s}) <= silence_timeout_s "
                f"({silence_timeout_s})"
            )
        self.silence_timeout_s = silence_timeout_s
        self.ping_interval_s = ping_interval_s
        self._send_ping = send_ping
        self._last_heard = -math.inf
        self._last_ping = -math.inf

    def heard(self) -> None:
        """The guest sent a frame (any kind, any stream)."""
        self._last_heard = asyncio.get_running_loop().time()

    def watch(self) -> Watch:
        """``async with liveness.watch():`` raises TimeoutError out of the block once the
        guest has been silent for ``silence_timeout_s``; see the module docstring."""
        return Watch(self)

    def quiet_since(self, started: float) -> float:
        return max(self._last_heard, started)

    def ping_if_due(self, quiet_since: float, now: float) -> None:
        if now >= max(quiet_since, self._last_ping) + self.ping_interval_s:
            self._last_ping = now
            self._send_ping()

    def next_check(self, quiet_since: float) -> float:
        next_ping = max(quiet_since, self._last_ping) + self.ping_interval_s
        return min(quiet_since + self.silence_timeout_s, next_ping)


class Watch:
    """One wait under a Liveness: an ``asyncio.timeout`` whose deadline moves with the
    guest's frames. Checked lazily, once per ping interval, not once per frame."""

    def __init__(self, liveness: Liveness) -> None:
        self._liveness = liveness
        self._timeout = asyncio.timeout(None)
        self._handle: asyncio.TimerHandle | None = None
        self._started = 0.0

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()
        self._started = asyncio.get_running_loop().time()
        self._schedule(self._started)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        await self._timeout.__aexit__(exc_type, exc, traceback)  # TimeoutError if expired

    def _schedule(self, quiet_since: float) -> None:
        when = self._liveness.next_check(quiet_since)
        self._handle = asyncio.get_running_loop().call_at(when, self._check)

    def _check(self) -> None:
        self._handle = None
        now = asyncio.get_running_loop().time()
        quiet_since = self._liveness.quiet_since(self._started)
        if now - quiet_since >= self._liveness.silence_timeout_s:
            self._timeout.reschedule(now)  # expires at once: TimeoutError out of the block
            return
        self._liveness.ping_if_due(quiet_since, now)
        self._schedule(quiet_since)
