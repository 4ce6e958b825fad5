"""The real control app over a FakeNode, as the SDK and CLI unit tests reach it (issue 13).

The SDK and CLI tests used to run against a hand-kept fake of docs/api.md; a fact kept
twice drifts, so they now talk to ``space.control.create_app`` through an ASGI transport,
over the in-memory FakeNode (tests/unit/fakes.py), with one tenant's API key. The
transport records what the SDK sent (``requests``, ``bodies``, ``upload_chunks``) so
tests can check the wire without a fake server.

The app's lifespan must run on the loop that serves its requests: ``running()`` enters
it on the caller's loop (async tests); ``serving_sync()`` enters it on the sync SDK's
loop thread, where ``Sandbox``, ``Space`` and the CLI send their requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import httpx

from space.control import ControlSettings, NodeRegistry, create_app, create_key
from space.control.reconcile import reconcile_node
from space.node.api import (
    ExecEvent,
    ExecExited,
    ExecOutput,
    NodeError,
    SandboxState,
    Unavailable,
)
from space.sdk._sync import _LOOP
from tests.schema import at_newest_schema
from tests.unit import fakes
from tests.unit.fakes import FakeNode

__all__ = ["API_URL", "TENANT", "LiveApi"]

R = TypeVar("R")

API_URL = "http://space"
TENANT = "acme"

#: A scripted exec event, as the tests write them: ("stdout" | "stderr", bytes),
#: ("exit", exit_code, signal, timed_out), or ("error", "unavailable", message).
Event = tuple[Any, ...]


class LiveApi:
    """``space.control.create_app`` over ``node`` with one key of tenant ``acme``."""

    def __init__(self, data_dir: Path, node: FakeNode | None = None) -> None:
        self.node = node or FakeNode()
        self.settings = ControlSettings(
            data_dir=data_dir, reaper_interval_s=3600.0, database_url=fakes.DATABASE_URL
        )
        at_newest_schema(self.settings.database_url)
        registry = NodeRegistry()
        registry.register(self.node.node_id, self.node)
        self.app = create_app(self.settings, registry)
        self.key = create_key(self.settings, TENANT)
        #: (method, path, headers) of every request sent, in order.
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        #: (method, path, JSON body) of every request with a JSON body, in order.
        self.bodies: list[tuple[str, str, Any]] = []
        #: The size of every chunk of every streamed (non-JSON) request body.
        self.upload_chunks: list[int] = []
        #: ``scripts[command] = [event, ...]``: what the node answers an exec of
        #: ``command`` (cmd, or argv joined with spaces) with.
        self.scripts = _Scripts(self.node)

    def transport(self) -> httpx.AsyncBaseTransport:
        return _Recording(self)

    def connection(self) -> dict[str, Any]:
        """The connection arguments of an SDK classmethod call that reaches the app."""
        return {"api_url": API_URL, "api_key": self.key, "_transport": self.transport()}

    @property
    def exec_bodies(self) -> list[Any]:
        return [body for _, path, body in self.bodies if path.endswith("/exec")]

    async def set_node_state(self, sandbox_id: str, state: SandboxState) -> None:
        """The node reports ``state`` for the sandbox and the control plane reconciles
        with it, as after a VM crash (``error``) or a restart mid-create (``creating``)."""
        box = self.node.boxes[sandbox_id]
        box.status = replace(box.status, state=state)
        await reconcile_node(self.app.state.ctx, self.node.node_id)

    def run_sync(self, coro: Coroutine[Any, Any, R]) -> R:
        """Run ``coro`` on the sync SDK's loop (with ``serving_sync``, the app's loop)."""
        return _LOOP.run(coro)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[LiveApi]:
        """The app's lifespan on the running loop."""
        async with self.app.router.lifespan_context(self.app):
            yield self

    @contextlib.contextmanager
    def serving_sync(self) -> Iterator[LiveApi]:
        """The app's lifespan on the sync SDK's loop thread (space/sdk/_sync.py), which
        serves the requests of ``Sandbox``, ``Space`` and the CLI; held by one task
        there so it is entered and left in the same task."""
        loop = _LOOP.loop()
        started = threading.Event()
        stop = asyncio.Event()

        async def hold() -> None:
            async with self.running():
                started.set()
                await stop.wait()

        held: Future[None] = asyncio.run_coroutine_threadsafe(hold(), loop)
        held.add_done_callback(lambda _: started.set())
        started.wait(timeout=30)
        if held.done():
            held.result()  # the lifespan failed: raise why
        try:
            yield self
        finally:
            loop.call_soon_threadsafe(stop.set)
            held.result(timeout=30)


class _Scripts(dict[str, list[Event]]):
    def __init__(self, node: FakeNode) -> None:
        super().__init__()
        self._node = node

    def __setitem__(self, command: str, events: list[Event]) -> None:
        super().__setitem__(command, events)
        self._node.scripts[command] = [_node_event(event) for event in events]


class _Recording(httpx.AsyncBaseTransport):
    """An ASGI transport to the app that records each request on its way."""

    def __init__(self, api: LiveApi) -> None:
        self._api = api
        self._inner = httpx.ASGITransport(app=api.app)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        method, path = request.method, request.url.path
        self._api.requests.append((method, path, dict(request.headers)))
        if request.headers.get("content-type") == "application/json":
            self._api.bodies.append((method, path, json.loads(await request.aread())))
        elif isinstance(request.stream, httpx.AsyncByteStream):
            request.stream = _Counted(request.stream, self._api.upload_chunks)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


class _Counted(httpx.AsyncByteStream):
    def __init__(self, stream: httpx.AsyncByteStream, sizes: list[int]) -> None:
        self._stream = stream
        self._sizes = sizes

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            if chunk:
                self._sizes.append(len(chunk))
            yield chunk

    async def aclose(self) -> None:
        await self._stream.aclose()


def _node_event(event: Event) -> ExecEvent | NodeError:
    if event[0] in ("stdout", "stderr"):
        return ExecOutput(event[0], event[1])
    if event[0] == "exit":
        _, code, signal, timed_out = event
        return ExecExited(code, signal, timed_out)
    _, code, message = event
    assert code == "unavailable", code  # the only error event the tests script
    return Unavailable(message)
