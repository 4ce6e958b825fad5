"""Guest activity: what postpones a sandbox's idle timeout (issue 3).

Every exec, process and file call marks its sandbox active. ``last_active_at`` is
written at most once a second per sandbox, to spare the database on busy sandboxes;
an exec or process stream marks it again as its events pass, and while a stream is
open the reaper of this replica does not hibernate the sandbox (a command may print
nothing for longer than the idle timeout), and each background round of this replica
marks it again, for the reaper of another replica (issue 19).
"""

from __future__ import annotations

import collections
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from space.control.store import Database, repo

__all__ = ["WRITE_INTERVAL_S", "Activity"]

#: At most one ``last_active_at`` write per sandbox per this many seconds.
WRITE_INTERVAL_S = 1.0
# Forget throttle entries beyond this many sandboxes (only stale ones are dropped).
_MAX_TRACKED = 10_000


class Activity:
    """Throttled activity writes and the sandboxes with an open stream, for one replica."""

    def __init__(self, db: Database, clock: Callable[[], float]) -> None:
        self._db = db
        self._clock = clock
        self._written: dict[str, float] = {}
        self._streams: collections.Counter[str] = collections.Counter()

    def _due(self, sandbox_id: str, now: float, stored: float | None) -> bool:
        known = [t for t in (self._written.get(sandbox_id), stored) if t is not None]
        if known and now - max(known) < WRITE_INTERVAL_S:
            return False
        if len(self._written) >= _MAX_TRACKED:
            self._written = {k: t for k, t in self._written.items() if now - t < WRITE_INTERVAL_S}
        self._written[sandbox_id] = now
        return True

    async def mark(self, sandbox_id: str, stored: float | None = None) -> float | None:
        """Record activity now unless recorded less than a second ago (``stored``: the
        row's ``last_active_at``). Returns the time written, or None if skipped."""
        now = self._clock()
        if not self._due(sandbox_id, now, stored):
            return None
        await self._db.run(lambda s: repo.touch(s, sandbox_id, now))
        return now

    async def mark_streamed(self) -> None:
        """Mark active every sandbox with a stream open here, throttled as ``mark``: the
        reaper of another replica sees no stream of this one, only ``last_active_at``."""
        for sandbox_id in self.streaming():
            await self.mark(sandbox_id)

    def streaming(self) -> frozenset[str]:
        """Sandboxes with an exec or process stream open in this replica."""
        return frozenset(self._streams)

    async def watch(self, sandbox_id: str, lines: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """``lines`` unchanged, marking the sandbox active as they pass and while open.

        Closing the result closes ``lines`` (which closes the node's stream).
        """
        self._streams[sandbox_id] += 1
        try:
            async for line in lines:
                await self.mark(sandbox_id)
                yield line
            await self.mark(sandbox_id)
        finally:
            self._streams[sandbox_id] -= 1
            if self._streams[sandbox_id] <= 0:
                del self._streams[sandbox_id]
            if isinstance(lines, AsyncGenerator):
                await lines.aclose()
