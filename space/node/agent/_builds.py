"""Template builds as the node runs them: one at a time, in the background, logged.

Private to space.node.agent (``Templates`` runs them). ``Builds.start`` unpacks the
build context, reads and plans the spec (raising before anything runs), then runs the
build in a task whose log a BuildStream follows. The task builds the layers
(space.node.agent._builder), publishes the template's subvolume, has the node make its
ready state, and only then moves the tag. A listener that goes away does not stop the
build. The work directory goes in the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from space.node.agent._builder import BuildStepFailed, Planned, build_layers, plan_build
from space.node.agent._catalog import Catalog
from space.node.api import BuildEvent, BuildFailed, BuildLog, BuildSucceeded, NodeError
from space.node.core.template import Template
from space.node.templates import load_spec
from space.node.templates.context import unpack_context

if TYPE_CHECKING:
    from space.node.agent._registry import Registry

__all__ = ["Builds"]

log = logging.getLogger(__name__)

#: Log lines a slow listener may fall behind by before lines are dropped (and counted).
_BACKLOG = 10_000


class _Log:
    """A build's events for one listener: bounded, never blocking the build."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[BuildEvent] = asyncio.Queue(_BACKLOG)
        self._dropped = 0
        self.closed = False

    def say(self, line: str) -> None:
        log.debug("build: %s", line)
        self._put(BuildLog(line))

    def end(self, event: BuildSucceeded | BuildFailed) -> None:
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
        registry: Registry,
        catalog: Catalog,
        work_root: Path,
        make_ready: Callable[[Template], Awaitable[Template]],
        drop_build: Callable[[Template], Awaitable[None]],
    ) -> None:
        self._registry = registry
        self._catalog = catalog
        self._work_root = work_root
        self._make_ready = make_ready
        self._drop_build = drop_build
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        shutil.rmtree(work_root, ignore_errors=True)  # what builds cut short left

    async def start(self, context: AsyncIterable[bytes]) -> _Stream:
        """Unpack and plan a build, then run it in the background; see NodeService.

        Raises InvalidArgument (TemplateSpecError) for a bad archive or spec.
        """
        build_id = f"b{secrets.token_hex(6)}"
        work = self._work_root / build_id
        work.mkdir(parents=True)
        try:
            spec_path = await unpack_context(context, work)
            spec = await asyncio.to_thread(load_spec, spec_path)
            planned = await plan_build(spec, spec_path.parent, self._catalog)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        events = _Log()
        task = asyncio.get_running_loop().create_task(self._run(planned, events, work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return _Stream(build_id, events)

    async def close(self) -> None:
        """Cancel running builds (their build VMs are removed; tags do not move)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self, planned: Planned, events: _Log, work: Path) -> None:
        name, tag = planned.spec.name, planned.spec.tag
        try:
            if self._lock.locked():
                events.say("waiting for another build on this node to finish")
            async with self._lock:
                events.say(f"building {name}:{tag} ({planned.digest[:12]}) on {planned.base.name}")
                template = await self._build(planned, events)
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
            shutil.rmtree(work, ignore_errors=True)

    async def _build(self, planned: Planned, events: _Log) -> Template:
        registry = self._registry
        volume = await build_layers(registry, planned, events.say)
        spec = planned.spec
        await registry.life.pool.publish_template(spec.name, planned.digest, volume)
        build = planned.build_record(time.time())
        events.say(
            f"making the ready state ({planned.shape.cpus} cpu, {planned.shape.memory_mib} MiB)"
        )
        await self._make_ready(self._catalog.template(spec.name, spec.tag, build))
        template, orphans = self._catalog.add(spec.name, spec.tag, build)
        for orphan in orphans:  # the tag's previous build, named by no other tag
            await self._drop_build(orphan)
        return template
