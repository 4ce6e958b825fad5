"""Template builds as the node runs them: in the background, logged, a few at a time.

Private to space.node.agent (``Templates`` runs them). ``Builds.start`` unpacks the
build context, reads the spec, takes the build's place for a build slot
(space.node.agent._build_slots: shared fairly between tenants, a bounded queue each)
and plans the build, raising before anything runs; then it runs the build in a task
whose log a BuildStream follows. The task waits for its slot (saying so in the log) and
runs the build body it was given (``Templates``: layers, subvolume, ready state, tag).
A listener that goes away does not stop the build. The work directory goes in the end,
or at once when the build is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from pathlib import Path

from space.node.agent._build_slots import BuildSlots, Ticket
from space.node.agent._builder import BuildStepFailed, Planned, plan_build
from space.node.agent._catalog import Catalog
from space.node.api import BuildEvent, BuildFailed, BuildLog, BuildSucceeded, NodeError
from space.node.core.template import Template
from space.node.templates import load_spec
from space.node.templates.context import unpack_context

__all__ = ["BuildBody", "Builds"]

#: What a build does once it holds its slot: build ``Planned`` (logging through the
#: callable), publish it and move its tag; returns the template the tag now names.
BuildBody = Callable[[Planned, Callable[[str], None]], Awaitable[Template]]

log = logging.getLogger(__name__)

#: Log lines a slow listener may fall behind by before lines are dropped (and counted).
_BACKLOG = 10_000


class _Log:
    """A build's events for one listener: bounded, never blocking the build."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[BuildEvent] = asyncio.Queue(_BACKLOG)
        self._dropped = 0
        self.closed = False
        self.ended = False

    def say(self, line: str) -> None:
        log.debug("build: %s", line)
        self._put(BuildLog(line))

    def end(self, event: BuildSucceeded | BuildFailed) -> None:
        self.ended = True
        with contextlib.suppress(asyncio.QueueEmpty):
            while self._queue.full():  # the outcome is never the event dropped
                self._queue.get_nowait()
                self._dropped += 1
        self._put(event, final=True)

    def _put(self, event: BuildEvent, *, final: bool = False) -> None:
        if self.closed:
            return
        if self._dropped and self._queue.qsize() < _BACKLOG - 1:
            self._queue.put_nowait(BuildLog(f"[{self._dropped} log lines dropped]"))
            self._dropped = 0
        if self._queue.full() and not final:
            self._dropped += 1
            return
        self._queue.put_nowait(event)

    async def events(self) -> AsyncIterator[BuildEvent]:
        while True:
            event = await self._queue.get()
            yield event
            if not isinstance(event, BuildLog):
                return


class _Stream:
    def __init__(self, build_id: str, log: _Log) -> None:
        self.build_id = build_id
        self._log = log

    def __aiter__(self) -> AsyncIterator[BuildEvent]:
        return self._log.events()

    async def aclose(self) -> None:
        self._log.closed = True


class Builds:
    """The node's template builds (see the module docstring)."""

    def __init__(
        self,
        catalog: Catalog,
        work_root: Path,
        body: BuildBody,
        *,
        slots: int,
        queued_per_owner: int,
    ) -> None:
        self._catalog = catalog
        self._work_root = work_root
        self._body = body
        self.slots = BuildSlots(slots, queued_per_owner)
        self._tasks: set[asyncio.Task[None]] = set()
        shutil.rmtree(work_root, ignore_errors=True)  # what builds cut short left

    async def start(self, context: AsyncIterable[bytes]) -> _Stream:
        """Unpack and plan a build, then run it in the background; see NodeService.

        Raises InvalidArgument (TemplateSpecError) for a bad archive or spec, and
        ResourceExhausted when the template's tenant has as many builds waiting for a
        slot as may wait; either way the unpacked context is removed before raising.
        """
        build_id = f"b{secrets.token_hex(6)}"
        work = self._work_root / build_id
        work.mkdir(parents=True)
        ticket: Ticket | None = None
        try:
            spec_path = await unpack_context(context, work)
            spec = await asyncio.to_thread(load_spec, spec_path)
            # Placed before planning (which hashes every copied file), so a refusal
            # costs no more than the unpacking.
            ticket = self.slots.enqueue(spec.name)
            planned = await plan_build(spec, spec_path.parent, self._catalog)
        except BaseException as exc:
            if ticket is not None:
                self.slots.leave(ticket)
            shutil.rmtree(work, ignore_errors=True)
            if isinstance(exc, NodeError):  # the node's paths are not the tenant's business
                exc.message = exc.message.replace(f"{work}/", "")
                exc.args = (exc.message, *exc.args[1:])
            raise
        events = _Log()
        task = asyncio.get_running_loop().create_task(self._run(planned, ticket, events, work))
        self._tasks.add(task)
        # Also for a task cancelled before it ran, which never reaches _run's finally.
        task.add_done_callback(lambda _: self._forget(ticket, work, events))
        task.add_done_callback(self._tasks.discard)
        return _Stream(build_id, events)

    async def close(self) -> None:
        """Cancel queued and running builds (their build VMs are removed, their work
        directories deleted, their listeners told; tags do not move)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self, planned: Planned, ticket: Ticket, events: _Log, work: Path) -> None:
        name, tag = planned.spec.name, planned.spec.tag
        try:
            self._say_waiting(ticket, events)
            await self.slots.wait(ticket)
            events.say(f"building {name}:{tag} ({planned.digest[:12]}) on {planned.base.name}")
            template = await self._body(planned, events.say)
            events.say(f"{name}:{tag} is {template.digest}")
            events.end(BuildSucceeded(template.info()))
        except BuildStepFailed as exc:
            events.end(BuildFailed(exc.code, str(exc), exc.step))
        except NodeError as exc:
            events.end(BuildFailed(exc.code, str(exc)))
        except Exception as exc:  # a bug: the listener still gets an outcome
            log.exception("template build of %s:%s failed", name, tag)
            events.end(BuildFailed("internal", f"{type(exc).__name__}: {exc}"))
        finally:
            self._forget(ticket, work, events)

    def _say_waiting(self, ticket: Ticket, events: _Log) -> None:
        if ticket.granted.is_set():
            return
        if self.slots.building(ticket.name):
            events.say(f"waiting for the running build of {ticket.name} to finish")
        events.say(
            f"waiting for a build slot: {self.slots.ahead(ticket)} builds ahead, "
            f"{self.slots.running} running"
        )

    def _forget(self, ticket: Ticket, work: Path, events: _Log) -> None:
        """Free the build's slot (or place), delete its work directory, and tell a
        listener of a build cancelled (by ``close``) so; idempotent."""
        self.slots.leave(ticket)
        shutil.rmtree(work, ignore_errors=True)
        if not events.ended:
            events.end(BuildFailed("unavailable", "the build was cancelled: the node is closing"))
