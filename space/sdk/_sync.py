"""The sync facade: ``Sandbox`` and friends, wrapped from the async core.

Every sync method runs the matching async method on one private event loop in a
daemon thread (``asyncio.run_coroutine_threadsafe``) and blocks for its result, so the
logic lives once, in the async classes. Consequences worth knowing:

* output callbacks (``on_stdout``...) run on that loop thread, not the caller's;
* calling the sync SDK from inside such a callback would deadlock, so it raises
  InvalidArgument instead (use AsyncSandbox for that);
* Ctrl-C in the caller cancels the running operation (a foreground command is then
  killed by the server, as with the async API).
"""

from __future__ import annotations

import asyncio
import builtins
import functools
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import Any, Concatenate, Generic, Literal, ParamSpec, TypeVar, overload

import httpx

from space.sdk._client import AsyncSpace
from space.sdk._commands import DEFAULT_COMMAND_TIMEOUT_S, AsyncCommandHandle, AsyncCommands
from space.sdk._events import OutputCallback
from space.sdk._files import AsyncFiles, ByteStream
from space.sdk._http import ConnectionConfig
from space.sdk._models import CommandResult, PtySize
from space.sdk._network import AsyncNetwork
from space.sdk._sandbox import AsyncSandbox, AsyncSandboxes
from space.sdk._secrets import AsyncSecrets, AsyncSecretStore
from space.sdk._templates import AsyncTemplate, AsyncTemplates
from space.sdk._watch import AsyncDirWatcher, FilesystemEvent
from space.sdk.errors import InvalidArgument

__all__ = [
    "CommandHandle",
    "Commands",
    "Files",
    "Network",
    "Sandbox",
    "Secrets",
    "Space",
    "Template",
]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
A = TypeVar("A")


class _LoopThread:
    """One event loop in a daemon thread, started on first use, shared by the facade."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=loop.run_forever, name="space-sdk-loop", daemon=True
                )
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def run(self, coro: Coroutine[Any, Any, R]) -> R:
        """Run ``coro`` on the loop and block for its result (or exception)."""
        if self.on_loop_thread():
            coro.close()
            raise InvalidArgument(
                "the sync SDK cannot be called from an output callback; use AsyncSandbox"
            )
        future: Future[R] = asyncio.run_coroutine_threadsafe(coro, self.loop())
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            raise

    def close_soon(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a cleanup ``coro`` without waiting if we are on the loop thread."""
        if self.on_loop_thread():
            self.loop().create_task(coro)
        else:
            self.run(coro)


_LOOP = _LoopThread()


class _Facade(Generic[A]):
    """A sync object wrapping one async object ``_inner``."""

    _inner: A

    def __init__(self, inner: A) -> None:
        self._inner = inner


def _blocking(
    method: Callable[Concatenate[A, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[_Facade[A], P], R]:
    """The sync twin of an async method: same signature and docstring, blocks."""

    @functools.wraps(method)
    def call(self: _Facade[A], /, *args: P.args, **kwargs: P.kwargs) -> R:
        return _LOOP.run(method(self._inner, *args, **kwargs))

    return call


def _blocking_static(
    function: Callable[P, Coroutine[Any, Any, R]],
) -> Callable[P, R]:
    """The sync twin of an async classmethod, mapping nothing."""

    @functools.wraps(function)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        return _LOOP.run(function(*args, **kwargs))

    return call


def _sandbox_factory(
    function: Callable[P, Coroutine[Any, Any, AsyncSandbox]],
) -> Callable[P, Sandbox]:
    """The sync twin of an AsyncSandbox constructor, returning a Sandbox."""

    @functools.wraps(function)
    def call(*args: P.args, **kwargs: P.kwargs) -> Sandbox:
        return Sandbox(_LOOP.run(function(*args, **kwargs)))

    return call


def _blocking_into(
    convert: Callable[[R], T],
) -> Callable[
    [Callable[Concatenate[A, P], Coroutine[Any, Any, R]]],
    Callable[Concatenate[_Facade[A], P], T],
]:
    """The sync twin of an async method whose result ``convert`` wraps (an AsyncSandbox
    becomes a Sandbox)."""

    def wrap(
        method: Callable[Concatenate[A, P], Coroutine[Any, Any, R]],
    ) -> Callable[Concatenate[_Facade[A], P], T]:
        @functools.wraps(method)
        def call(self: _Facade[A], /, *args: P.args, **kwargs: P.kwargs) -> T:
            return convert(_LOOP.run(method(self._inner, *args, **kwargs)))

        return call

    return wrap


class CommandHandle(_Facade[AsyncCommandHandle]):
    """A background process (sync). See AsyncCommandHandle."""

    @property
    def pid(self) -> int:
        return self._inner.pid

    @property
    def process_id(self) -> str:
        return self._inner.process_id

    @property
    def sandbox_id(self) -> str:
        return self._inner.sandbox_id

    def __repr__(self) -> str:
        return f"<CommandHandle {self.sandbox_id}/{self.process_id} pid={self.pid}>"

    wait = _blocking(AsyncCommandHandle.wait)
    kill = _blocking(AsyncCommandHandle.kill)
    send_stdin = _blocking(AsyncCommandHandle.send_stdin)
    close_stdin = _blocking(AsyncCommandHandle.close_stdin)
    resize = _blocking(AsyncCommandHandle.resize)


class Commands(_Facade[AsyncCommands]):
    """``sandbox.commands`` (sync). See AsyncCommands."""

    @overload
    def run(
        self,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        timeout_s: float | None = DEFAULT_COMMAND_TIMEOUT_S,
        background: Literal[False] = False,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        check: bool = False,
        open_stdin: bool = False,
        pty: PtySize | None = None,
        tag: str | None = None,
        on_start: Callable[[CommandHandle], object] | None = None,
    ) -> CommandResult: ...

    @overload
    def run(
        self,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        timeout_s: float | None = DEFAULT_COMMAND_TIMEOUT_S,
        background: Literal[True],
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        check: bool = False,
        open_stdin: bool = False,
        pty: PtySize | None = None,
        tag: str | None = None,
        on_start: Callable[[CommandHandle], object] | None = None,
    ) -> CommandHandle: ...

    def run(self, cmd: str | Sequence[str], **options: Any) -> CommandResult | CommandHandle:
        on_start = options.pop("on_start", None)
        if on_start is not None:  # runs on the loop thread: it must not call back in
            options["on_start"] = lambda handle: on_start(CommandHandle(handle))
        result: CommandResult | AsyncCommandHandle = _LOOP.run(self._inner.run(cmd, **options))
        if isinstance(result, AsyncCommandHandle):
            return CommandHandle(result)
        return result

    run.__doc__ = AsyncCommands.run.__doc__

    def connect(self, process_id: str | None = None, *, tag: str | None = None) -> CommandHandle:
        """A handle on an existing process, by id or tag; NotFound if none."""
        return CommandHandle(_LOOP.run(self._inner.connect(process_id, tag=tag)))

    list = _blocking(AsyncCommands.list)
    kill = _blocking(AsyncCommands.kill)
    send_stdin = _blocking(AsyncCommands.send_stdin)
    close_stdin = _blocking(AsyncCommands.close_stdin)
    resize_pty = _blocking(AsyncCommands.resize_pty)


class Files(_Facade[AsyncFiles]):
    """``sandbox.files`` (sync). See AsyncFiles."""

    @overload
    def read(self, path: str, *, format: Literal["text"] = "text") -> str: ...
    @overload
    def read(self, path: str, *, format: Literal["bytes"]) -> bytes: ...
    @overload
    def read(self, path: str, *, format: Literal["stream"]) -> Iterator[bytes]: ...

    def read(
        self, path: str, *, format: Literal["text", "bytes", "stream"] = "text"
    ) -> str | bytes | Iterator[bytes]:
        if format == "stream":
            return _iterate(_LOOP.run(self._inner.read(path, format="stream")))
        if format == "bytes":
            return _LOOP.run(self._inner.read(path, format="bytes"))
        return _LOOP.run(self._inner.read(path, format="text"))

    read.__doc__ = AsyncFiles.read.__doc__

    def watch_dir(self, path: str, *, recursive: bool = False) -> Iterator[FilesystemEvent]:
        """Changes of a directory as they happen (see AsyncFiles.watch_dir); closing the
        iterator (or leaving it unfinished) stops the watch."""
        return _watch_events(_LOOP.run(self._inner.watch_dir(path, recursive=recursive)))

    write = _blocking(AsyncFiles.write)
    list = _blocking(AsyncFiles.list)
    stat = _blocking(AsyncFiles.stat)
    exists = _blocking(AsyncFiles.exists)
    remove = _blocking(AsyncFiles.remove)
    make_dir = _blocking(AsyncFiles.make_dir)
    rename = _blocking(AsyncFiles.rename)
    download_to = _blocking(AsyncFiles.download_to)
    upload_from = _blocking(AsyncFiles.upload_from)


class Network(_Facade[AsyncNetwork]):
    """``sandbox.network`` (sync). See AsyncNetwork."""

    get_policy = _blocking(AsyncNetwork.get_policy)
    set_policy = _blocking(AsyncNetwork.set_policy)
    log = _blocking(AsyncNetwork.log)


def _sandboxes(inners: builtins.list[AsyncSandbox]) -> builtins.list[Sandbox]:
    return [Sandbox(inner) for inner in inners]


class Sandbox(_Facade[AsyncSandbox]):
    """A sandbox (sync). See AsyncSandbox; ``with Sandbox.create() as sbx`` kills on exit."""

    def __init__(self, inner: AsyncSandbox) -> None:
        super().__init__(inner)
        self.commands = Commands(inner.commands)
        self.files = Files(inner.files)
        self.network = Network(inner.network)

    def __repr__(self) -> str:
        return f"<Sandbox {self.sandbox_id}>"

    @property
    def sandbox_id(self) -> str:
        return self._inner.sandbox_id

    @property
    def traffic_token(self) -> str | None:
        return self._inner.traffic_token

    def get_host(self, port: int) -> str:
        return self._inner.get_host(port)

    create = staticmethod(_sandbox_factory(AsyncSandbox.create))
    connect = staticmethod(_sandbox_factory(AsyncSandbox.connect))
    list = staticmethod(_blocking_static(AsyncSandbox.list))
    list_snapshots = staticmethod(_blocking_static(AsyncSandbox.list_snapshots))
    delete_snapshot = staticmethod(_blocking_static(AsyncSandbox.delete_snapshot))
    list_pools = staticmethod(_blocking_static(AsyncSandbox.list_pools))

    get_info = _blocking(AsyncSandbox.get_info)
    get_metrics = _blocking(AsyncSandbox.get_metrics)
    pause = _blocking(AsyncSandbox.pause)
    resume = _blocking(AsyncSandbox.resume)
    hibernate = _blocking(AsyncSandbox.hibernate)
    set_timeouts = _blocking(AsyncSandbox.set_timeouts)
    set_ports = _blocking(AsyncSandbox.set_ports)
    snapshot = _blocking(AsyncSandbox.snapshot)
    snapshots = _blocking(AsyncSandbox.snapshots)
    restore = _blocking(AsyncSandbox.restore)
    fork = _blocking_into(_sandboxes)(AsyncSandbox.fork)
    kill = _blocking(AsyncSandbox.kill)
    close = _blocking(AsyncSandbox.close)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self,
        exc_type: builtins.type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()


class Template:
    """Templates (sync). See AsyncTemplate; ``on_log`` runs on the SDK's loop thread."""

    build = staticmethod(_blocking_static(AsyncTemplate.build))
    list = staticmethod(_blocking_static(AsyncTemplate.list))
    delete = staticmethod(_blocking_static(AsyncTemplate.delete))


class Secrets:
    """The tenant's secrets (sync). See AsyncSecrets."""

    set = staticmethod(_blocking_static(AsyncSecrets.set))
    list = staticmethod(_blocking_static(AsyncSecrets.list))
    get = staticmethod(_blocking_static(AsyncSecrets.get))
    delete = staticmethod(_blocking_static(AsyncSecrets.delete))


class Sandboxes(_Facade[AsyncSandboxes]):
    """``space.sandboxes`` of a ``Space`` (sync). See AsyncSandboxes."""

    create = _blocking_into(Sandbox)(AsyncSandboxes.create)
    connect = _blocking_into(Sandbox)(AsyncSandboxes.connect)
    list = _blocking(AsyncSandboxes.list)
    list_snapshots = _blocking(AsyncSandboxes.list_snapshots)
    list_pools = _blocking(AsyncSandboxes.list_pools)
    delete_snapshot = _blocking(AsyncSandboxes.delete_snapshot)


class Templates(_Facade[AsyncTemplates]):
    """``space.templates`` of a ``Space`` (sync). See AsyncTemplates."""

    build = _blocking(AsyncTemplates.build)
    list = _blocking(AsyncTemplates.list)
    delete = _blocking(AsyncTemplates.delete)


class SecretStore(_Facade[AsyncSecretStore]):
    """``space.secrets`` of a ``Space`` (sync). See AsyncSecretStore."""

    set = _blocking(AsyncSecretStore.set)
    list = _blocking(AsyncSecretStore.list)
    get = _blocking(AsyncSecretStore.get)
    delete = _blocking(AsyncSecretStore.delete)


class Space(_Facade[AsyncSpace]):
    """A client of the SPACE API (sync): one connection that many calls share.

        with Space(api_key=key) as space:
            sbx = space.sandboxes.create(template="base")
            print(sbx.commands.run("echo hi").stdout)

    The arguments, defaults and contract are AsyncSpace's; ``close()`` (or leaving the
    ``with`` block) closes the connection, idempotently, and kills no sandbox.
    """

    def __init__(
        self,
        api_url: str | None = None,
        api_key: str | None = None,
        *,
        request_timeout_s: float | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        ca_bundle: str | None = None,
    ) -> None:
        # Made on the loop thread, where every later call on it runs.
        made = _LOOP.run(
            _made(AsyncSpace, api_url, api_key, request_timeout_s=request_timeout_s,
                  transport=transport, ca_bundle=ca_bundle)
        )  # fmt: skip
        super().__init__(made)
        self.sandboxes = Sandboxes(made.sandboxes)
        self.templates = Templates(made.templates)
        self.secrets = SecretStore(made.secrets)

    def __repr__(self) -> str:
        return f"<Space {self.config.api_url}>"

    @property
    def config(self) -> ConnectionConfig:
        """The resolved URL, key and timeouts (frozen)."""
        return self._inner.config

    close = _blocking(AsyncSpace.aclose)

    def __enter__(self) -> Space:
        return self

    def __exit__(
        self,
        exc_type: builtins.type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


async def _made(factory: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    return factory(*args, **kwargs)


def _watch_events(watcher: AsyncDirWatcher) -> Iterator[FilesystemEvent]:
    """A sync iterator over a watch; closing or abandoning it stops the watch."""
    try:
        while (event := _LOOP.run(_next_event(watcher))) is not None:
            yield event
    finally:
        _LOOP.close_soon(watcher.aclose())


async def _next_event(watcher: AsyncDirWatcher) -> FilesystemEvent | None:
    try:
        return await anext(watcher)
    except StopAsyncIteration:
        return None


def _iterate(stream: ByteStream) -> Iterator[bytes]:
    """A sync iterator over a download; closing or abandoning it closes the download."""
    try:
        while (chunk := _LOOP.run(_next_chunk(stream))) is not None:
            yield chunk
    finally:
        _LOOP.close_soon(stream.aclose())


async def _next_chunk(stream: ByteStream) -> bytes | None:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return None
