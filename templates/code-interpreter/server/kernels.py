"""Code contexts: one Jupyter kernel each, owned by one worker thread.

jupyter_client's blocking client runs its ZMQ sockets on an asyncio loop of the thread
that made them, so a context's kernel manager and client live in one worker thread for
their whole life; HTTP handler threads hand it jobs through a queue and read what the
execution produced from another queue. An execution's output is a sequence of plain
dicts, already in the shape the E2B SDK's ``parse_output`` reads (e2b-code-interpreter
2.11.5, models.py): ``stdout``/``stderr`` (text, timestamp in ns), ``result`` (MIME
bundle fields, ``is_main_result``), ``error`` (name, value, traceback),
``number_of_executions`` (execution_count); the server adds ``end_of_execution``.

Runs in the guest on Debian's python3 with python3-jupyter-client (not in space/).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import charts

if TYPE_CHECKING:
    import jupyter_client

#: How long a kernel may take to answer its first kernel_info. TCG is slow: ipykernel
#: imports IPython, zmq, tornado and debugpy, measured past 180 s on a busy 2-core host.
KERNEL_START_TIMEOUT_S = 600.0
#: How often a running execution looks at its cancel flag.
_POLL_S = 0.5
#: Output queued for a slow HTTP client before the worker waits for it to read.
_MAX_QUEUED_EVENTS = 256
#: What every kernel runs first, and again after a restart: the chart formatter
#: (charts.py), loaded by path so the user's namespace and sys.path stay untouched.
_KERNEL_SETUP = (
    f"__import__('runpy').run_path({os.path.abspath(charts.__file__)!r},"
    " run_name='space_charts')['register'](get_ipython())"
)

Event = dict[str, Any]

# Jupyter MIME types and the SDK's Result fields they fill; anything else goes to extra.
_MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    charts.MIME: "chart",  # a matplotlib figure's data (charts.py)
}

_BASE64_FIELDS = ("png", "jpeg")


class ContextError(Exception):
    """A context could not do what was asked (its kernel died or never started)."""


def result_event(data: dict[str, Any], *, main: bool) -> Event:
    """A ``result`` event from a Jupyter MIME bundle."""
    event: Event = {"type": "result", "is_main_result": main}
    extra = {}
    for mime, value in data.items():
        name = _MIME_FIELDS.get(mime)
        if name is None:
            extra[mime] = value
        elif name in _BASE64_FIELDS and isinstance(value, str):
            # IPython's base64 ends in a newline; a strict decoder refuses it.
            event[name] = value.replace("\n", "")
        else:
            event[name] = value
    if extra:
        event["extra"] = extra
    return event


def _env_code(env: dict[str, str]) -> tuple[str, str]:
    """Kernel code that sets ``env`` for one execution, and the code that undoes it.

    repr() of a dict of str is a Python literal, so no value can escape it.
    """
    apply = (
        "import os as __space_os\n"
        f"__space_env = {env!r}\n"
        "__space_saved = {k: __space_os.environ.get(k) for k in __space_env}\n"
        "__space_os.environ.update(__space_env)\n"
        "del __space_env\n"
    )
    undo = (
        "for __space_k, __space_v in __space_saved.items():\n"
        "    if __space_v is None:\n"
        "        __space_os.environ.pop(__space_k, None)\n"
        "    else:\n"
        "        __space_os.environ[__space_k] = __space_v\n"
        "del __space_saved, __space_os\n"
    )
    return apply, undo


@dataclass
class _Job:
    kind: str  # "execute", "restart", "shutdown"
    code: str = ""
    env: dict[str, str] = field(default_factory=dict)
    events: queue.Queue[Event | None] = field(
        default_factory=lambda: queue.Queue(maxsize=_MAX_QUEUED_EVENTS)
    )
    cancelled: threading.Event = field(default_factory=threading.Event)


class Context:
    """One kernel and the worker thread that owns it."""

    def __init__(self, language: str, cwd: str, kernel_env: dict[str, str]) -> None:
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self._kernel_env = kernel_env
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self._ready = threading.Event()
        self._start_error: str | None = None
        # One execution at a time: the SDK's callers wait for theirs in turn.
        self.busy = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"context-{self.id}", daemon=True)
        self._thread.start()

    def describe(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._start_error is None

    def wait_ready(self, timeout_s: float = KERNEL_START_TIMEOUT_S) -> None:
        """Block until the kernel answered; ContextError if it failed or took too long."""
        if not self._ready.wait(timeout_s):
            raise ContextError(f"the kernel did not start within {timeout_s:g} s")
        if self._start_error is not None:
            raise ContextError(self._start_error)

    def execute(
        self, code: str, env: dict[str, str]
    ) -> tuple[queue.Queue[Event | None], threading.Event]:
        """Queue ``code``; return the queue of its events (None ends it) and its cancel
        flag. The caller holds ``busy`` and reads the queue to its end; setting the flag
        interrupts the kernel (the queue still ends)."""
        job = _Job("execute", code=code, env=env)
        self._jobs.put(job)
        return job.events, job.cancelled

    def restart(self) -> None:
        job = _Job("restart")
        self._jobs.put(job)
        for event in drain(job.events):
            if event.get("type") == "error":
                raise ContextError(event["value"])

    def shutdown(self) -> None:
        """Stop the kernel and the worker (returns at once; the worker finishes alone)."""
        self._jobs.put(_Job("shutdown"))

    # The worker thread.

    def _run(self) -> None:
        manager: jupyter_client.KernelManager | None = None
        client: Any = None
        try:
            manager, client = self._start()
        except Exception as exc:  # the reason goes to every caller, not to a log only
            self._start_error = f"the kernel failed to start: {exc}"
        self._ready.set()
        while True:
            job = self._jobs.get()
            if job.kind == "shutdown":
                break
            try:
                if manager is None or client is None:
                    job.events.put(
                        {
                            "type": "error",
                            "name": "KernelError",
                            "value": str(self._start_error),
                            "traceback": "",
                        }
                    )
                elif job.kind == "restart":
                    client.stop_channels()
                    manager.restart_kernel(now=True)
                    client = self._connect(manager)
                else:
                    self._execute(manager, client, job)
            except Exception as exc:
                _put(
                    job,
                    {
                        "type": "error",
                        "name": type(exc).__name__,
                        "value": str(exc),
                        "traceback": "",
                    },
                )
            finally:
                _put(job, None)
        if client is not None:
            client.stop_channels()
        if manager is not None:
            manager.shutdown_kernel(now=True)

    def _start(self) -> tuple[jupyter_client.KernelManager, Any]:
        # Imported here, in the worker: the server listens before this slow import ends.
        import jupyter_client

        manager = jupyter_client.KernelManager(kernel_name="python3")
        setup = [f"--IPKernelApp.exec_lines={_KERNEL_SETUP}"]
        manager.start_kernel(cwd=self.cwd, env=self._kernel_env, extra_arguments=setup)
        try:
            return manager, self._connect(manager)
        except Exception:
            manager.shutdown_kernel(now=True)
            raise

    @staticmethod
    def _connect(manager: jupyter_client.KernelManager) -> Any:
        client = manager.client()
        # No heartbeat channel: a sandbox paused or restored from a ready state would
        # see a "dead" kernel after the gap; the manager knows if the process lives.
        client.start_channels(hb=False)
        client.wait_for_ready(timeout=KERNEL_START_TIMEOUT_S)
        return client

    def _execute(self, manager: Any, client: Any, job: _Job) -> None:
        undo = None
        if job.env:
            apply, undo = _env_code(job.env)
            self._quiet(client, apply)
        try:
            self._stream(manager, client, job)
        finally:
            if undo is not None:
                self._quiet(client, undo)

    @staticmethod
    def _quiet(client: Any, code: str) -> None:
        client.execute(
            code, silent=True, store_history=False, reply=True, timeout=KERNEL_START_TIMEOUT_S
        )

    def _stream(self, manager: Any, client: Any, job: _Job) -> None:
        msg_id = client.execute(job.code, allow_stdin=False)
        main_data: dict[str, Any] | None = None
        interrupted = False
        while True:
            if job.cancelled.is_set() and not interrupted:
                manager.interrupt_kernel()
                interrupted = True
            try:
                msg = client.get_iopub_msg(timeout=_POLL_S)
            except queue.Empty:
                if not manager.is_alive():
                    _put(
                        job,
                        {
                            "type": "error",
                            "name": "KernelDied",
                            "value": "the kernel exited during the execution",
                            "traceback": "",
                        },
                    )
                    return
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content.get("execution_state") == "idle":
                return
            if kind == "execute_result":
                main_data = content.get("data", {})
            elif kind == "display_data" and content.get("data") == main_data:
                # matplotlib's inline backend shows a figure that was the cell's value
                # once more when the cell ends: the same bundle, already sent.
                continue
            event = _event(kind, content)
            if event is not None:
                _put(job, event)


def _event(kind: str, content: dict[str, Any]) -> Event | None:
    if kind == "stream":
        name = "stderr" if content.get("name") == "stderr" else "stdout"
        return {"type": name, "text": content.get("text", ""), "timestamp": time.time_ns()}
    if kind == "execute_result":
        return result_event(content.get("data", {}), main=True)
    if kind == "display_data":
        return result_event(content.get("data", {}), main=False)
    if kind == "error":
        return {
            "type": "error",
            "name": content.get("ename", ""),
            "value": content.get("evalue", ""),
            "traceback": "\n".join(content.get("traceback", [])),
        }
    if kind == "execute_input":
        return {"type": "number_of_executions", "execution_count": content.get("execution_count")}
    return None


def _put(job: _Job, event: Event | None) -> None:
    """Queue ``event`` for the HTTP side; drop output once it stopped reading (cancelled)."""
    while True:
        try:
            job.events.put(event, timeout=_POLL_S)
            return
        except queue.Full:
            if job.cancelled.is_set():
                with contextlib.suppress(queue.Empty):
                    job.events.get_nowait()


def drain(events: queue.Queue[Event | None]) -> Iterator[Event]:
    """The events of a queue up to the None that ends it."""
    while (event := events.get()) is not None:
        yield event


def kernel_environment() -> dict[str, str]:
    """The kernels' environment: the server's, with ipykernel's debugger quiet."""
    return {**os.environ, "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
