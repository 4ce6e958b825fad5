"""The moves half of the fake node (issue 19): exports held in memory, a fixed stream."""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator

from space.node.api import (
    Conflict,
    ExportTicket,
    ImportResult,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)

#: What the fake's export streams (framing is the real node's business).
FAKE_STREAM = [b"first chunk ", b"second chunk"]


class FakeMoves:
    """export_sandbox, stream_export and finish_export over ``exports`` (sandbox id to
    ticket); import_sandbox is the real node's only (Unavailable here)."""

    def __init__(self) -> None:
        self.exports: dict[str, str] = {}
        self.finished: list[tuple[str, bool]] = []

    def _known(self, sandbox_id: str) -> bool:
        raise NotImplementedError

    async def export_sandbox(self, sandbox_id: str) -> ExportTicket:
        if not self._known(sandbox_id):
            raise NotFound(f"no sandbox {sandbox_id!r}", sandbox_id=sandbox_id)
        if sandbox_id in self.exports:
            raise Conflict("it is being moved", sandbox_id=sandbox_id)
        self.exports[sandbox_id] = ticket = f"ticket-{sandbox_id}"
        return ExportTicket(
            sandbox_id=sandbox_id,
            ticket=ticket,
            expires_at=time.time() + 600,
            record={"spec": {"sandbox_id": sandbox_id}},
            parents=["parent-uuid"],
            key_id="key",
            max_stream_bytes=1 << 20,
        )

    async def stream_export(
        self, sandbox_id: str, ticket: str, parent: str | None
    ) -> AsyncIterator[bytes]:
        known = self.exports.get(sandbox_id)
        if known is None or not hmac.compare_digest(known, ticket):
            raise PermissionDenied("no such export ticket", sandbox_id=sandbox_id)
        if parent not in (None, "parent-uuid"):
            raise InvalidArgument(f"{parent!r} is not a parent of this export")
        for chunk in FAKE_STREAM:
            yield chunk

    async def import_sandbox(self, ticket: ExportTicket, source_url: str) -> ImportResult:
        raise Unavailable("the fake node imports nothing", sandbox_id=ticket.sandbox_id)

    async def finish_export(self, sandbox_id: str, ticket: str, *, moved: bool) -> None:
        if not hmac.compare_digest(self.exports.get(sandbox_id, ""), ticket):
            raise PermissionDenied("no such export ticket", sandbox_id=sandbox_id)
        del self.exports[sandbox_id]
        self.finished.append((sandbox_id, moved))
