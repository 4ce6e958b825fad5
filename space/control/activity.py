"""Guest activity: what postpones a sandbox's idle timeout (issue 3).

Every exec, process and file call marks its sandbox active. A mark is recorded in this
replica's memory, at most once a second per sandbox, and written to ``last_active_at``
off the request's path (issue 21: a write per request cost a database round trip and
a commit): the marks of every sandbox are written together, in one transaction, at most
``WRITE_INTERVAL_S`` after the first of them. What this replica shows of a sandbox
includes its marks not yet written (``latest``); its reaper writes them before it looks
for idle sandboxes; another replica's reaper sees them within ``WRITE_INTERVAL_S`` (idle
timeouts are whole seconds and more). A replica that stops writes what it holds first;
one that crashes loses at most the last ``WRITE_INTERVAL_S`` of marks, so a sandbox may
then hibernate up to that much early.

An exec or process stream marks its sandbox again as its events pass; while a stream is
open the reaper of this replica does not hibernate the sandbox (a command may print
nothing for longer than the idle timeout), and each background round of this replica
marks it again and writes the marks at once, for the reaper of another replica
(issue 19).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import replace

from space.control.errors import ApiError
from space.control.store import Database, repo
from space.control.store.repo import SandboxRecord

__all__ = ["WRITE_INTERVAL_S", "Activity"]

log = logging.getLogger(__name__)

#: At most one mark per sandbox per this many seconds, and marks written this long
#: after the first one held.
WRITE_INTERVAL_S = 1.0
# Forget throttle entries beyond this many sandboxes (only stale ones are dropped).
_MAX_TRACKED = 10_000


class Activity:
    """Throttled activity marks, written in batches, and the sandboxes with an open
    stream, for one replica. Call ``aclose`` before the database is disposed of."""

    def __init__(self, db: Database, clock: Callable[[], float]) -> None:
        self._db = db
        self._clock = clock
        #: The last mark of each sandbox (written or not), for the throttle and ``latest``.
        self._marked: dict[str, float] = {}
        #: Marks not written yet.
        self._pending: dict[str, float] = {}
        self._writer: asyncio.Task[None] | None = None
        self._streams: collections.Counter[str] = collections.Counter()

    def _due(self, sandbox_id: str, now: float, stored: float | None) -> bool:
        known = [t for t in (self._marked.get(sandbox_id), stored) if t is not None]
        if known and now - max(known) < WRITE_INTERVAL_S:
            return False
        if len(self._marked) >= _MAX_TRACKED:
            self._marked = {
                k: t
                for k, t in self._marked.items()
                if now - t < WRITE_INTERVAL_S or k in self._pending
            }
        self._marked[sandbox_id] = now
        return True

    def mark(self, sandbox_id: str, stored: float | None = None) -> float | None:
        """Record activity now unless recorded less than a second ago (``stored``: the
        row's ``last_active_at``); it is written within WRITE_INTERVAL_S. Returns the
        time recorded, or None if skipped."""
        now = self._clock()
        if not self._due(sandbox_id, now, stored):
            return None
        self._pending[sandbox_id] = now
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_later())
        return now

    def latest(self, record: SandboxRecord) -> SandboxRecord:
        """``record`` with this replica's last mark of it, if that is newer than the
        row's (written or not yet): what this replica shows of a sandbox."""
        marked = self._marked.get(record.id)
        if marked is None or (record.last_active_at or 0.0) >= marked:
            return record
        return replace(record, last_active_at=marked)

    async def write(self) -> None:
        """Write every mark held, in one transaction (nothing if none). Raises
        ApiError(unavailable) if the database cannot be reached: the marks are kept for
        the next write."""
        if not self._pending:
            return
        batch, self._pending = self._pending, {}
        try:
            await self._db.run(lambda s: repo.touch_many(s, batch))
        except BaseException:
            for sandbox_id, at in batch.items():  # a mark made meanwhile is newer
                self._pending[sandbox_id] = max(at, self._pending.get(sandbox_id, at))
            raise

    async def _write_later(self) -> None:
        while True:
            await asyncio.sleep(WRITE_INTERVAL_S)
            try:
                await self.write()
            except ApiError as exc:
                log.warning("could not record guest activity (kept for later): %s", exc)
            if not self._pending:
                # No await between the check and this: a mark after it starts a writer.
                self._writer = None
                return

    async def aclose(self) -> None:
        """Stop the background writer and write what it held (at the app's shutdown)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
        await self.write()

    async def mark_streamed(self) -> None:
        """Mark active every sandbox with a stream open here, throttled as ``mark``, and
        write the marks now: the reaper of another replica sees no stream of this one,
        only ``last_active_at``."""
        for sandbox_id in self.streaming():
            self.mark(sandbox_id)
        await self.write()

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
                self.mark(sandbox_id)
                yield line
            self.mark(sandbox_id)
        finally:
            self._streams[sandbox_id] -= 1
            if self._streams[sandbox_id] <= 0:
                del self._streams[sandbox_id]
            if isinstance(lines, AsyncGenerator):
                await lines.aclose()
