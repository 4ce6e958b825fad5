"""The code interpreter's HTTP server: what e2b-code-interpreter's Sandbox calls on port 49999.

    GET    /health                    200 {"status": "ok", "default_context": "ready"}, or
                                      503 {"status": "starting", ...} until it answers
    POST   /execute                   {code, context_id?, language?, env_vars?} -> NDJSON stream
    POST   /contexts                  {language?, cwd?} -> {id, language, cwd}
    GET    /contexts                  [{id, language, cwd}, ...]
    DELETE /contexts/{id}             204
    POST   /contexts/{id}/restart     204

/execute answers 200 with one JSON object a line (chunked), as the SDK's parse_output
reads them (see kernels.py), ending with {"type": "end_of_execution"}. Errors before the
stream are a status and a JSON {"error": ...}: 400 bad request, 404 unknown context,
411 no length, 413 too large, 429 too many contexts, 503 busy or no kernel. A client
that goes away mid-stream interrupts its execution.

Only Python contexts exist (one Jupyter kernel each, kernels.py). The default context's
kernel starts with the server, so a sandbox restored from the template's ready state
has it running or on its way. Runs in the guest as the sandbox's user:
``python3 server.py [--host 0.0.0.0] [--port 49999] [--cwd ~] [--max-contexts 16]``;
``--warm-up`` starts a kernel, imports matplotlib once (its font cache), checks that a
figure comes back as a PNG with its chart (charts.py) and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import os
import queue
import re
import select
import signal
import socket
import sys
import threading
from typing import Any

from kernels import Context, ContextError, drain, kernel_environment

# Bounds on what a client may ask for (the guest's memory is small).
MAX_BODY_BYTES = 4 << 20
MAX_CODE_BYTES = 2 << 20
MAX_CONTEXTS = 16
MAX_ENV_VARS = 256
MAX_ENV_VALUE_BYTES = 32 << 10
MAX_CONNECTIONS = 64
#: Longest an execution waits for another one in its context to finish.
BUSY_WAIT_S = 600.0
#: Idle time before a connection that sends nothing is closed.
IDLE_TIMEOUT_S = 300.0
#: How often a quiet execution checks that its client is still there.
_POLL_S = 0.5
LANGUAGES = ("python",)
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")
_CONTEXT_PATH_RE = re.compile(r"/contexts/([0-9a-f-]{36})(/restart)?")


class RequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Registry:
    """The contexts, by id; the default one per language is made on first need."""

    def __init__(self, default_cwd: str, max_contexts: int = MAX_CONTEXTS) -> None:
        self.default_cwd = default_cwd
        self.max_contexts = max_contexts
        self._lock = threading.Lock()
        self._contexts: dict[str, Context] = {}
        self._defaults: dict[str, str] = {}
        self._env = kernel_environment()

    def create(self, language: str, cwd: str, *, default: bool = False) -> Context:
        with self._lock:
            if default and language in self._defaults:
                return self._contexts[self._defaults[language]]
            if len(self._contexts) >= self.max_contexts:
                raise RequestError(429, f"at most {self.max_contexts} contexts, delete one first")
            context = Context(language, cwd, self._env)
            self._contexts[context.id] = context
            if default:
                self._defaults[language] = context.id
            return context

    def default(self, language: str) -> Context:
        return self.create(language, self.default_cwd, default=True)

    def get(self, context_id: str) -> Context:
        with self._lock:
            context = self._contexts.get(context_id)
        if context is None:
            raise RequestError(404, f"no context {context_id!r}")
        return context

    def remove(self, context_id: str) -> None:
        with self._lock:
            context = self._contexts.pop(context_id, None)
            for language, known in list(self._defaults.items()):
                if known == context_id:
                    del self._defaults[language]
        if context is None:
            raise RequestError(404, f"no context {context_id!r}")
        context.shutdown()

    def listing(self) -> list[dict[str, str]]:
        with self._lock:
            return [context.describe() for context in self._contexts.values()]

    def default_state(self) -> str:
        with self._lock:
            known = self._defaults.get("python")
            context = self._contexts.get(known) if known else None
        return "ready" if context is not None and context.ready else "starting"


def _language(value: object) -> str:
    if value is None:
        return "python"
    if not isinstance(value, str) or value not in LANGUAGES:
        raise RequestError(400, f"language must be one of {', '.join(LANGUAGES)}, got {value!r}")
    return value


def _env_vars(value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_ENV_VARS:
        raise RequestError(400, f"env_vars must be an object of at most {MAX_ENV_VARS} strings")
    for name, item in value.items():
        if not _ENV_NAME_RE.fullmatch(name):
            raise RequestError(400, f"env_vars: invalid variable name {name[:64]!r}")
        if not isinstance(item, str) or "\0" in item:
            raise RequestError(400, f"env_vars.{name}: must be a string without NUL")
        if len(item.encode()) > MAX_ENV_VALUE_BYTES:
            raise RequestError(400, f"env_vars.{name}: at most {MAX_ENV_VALUE_BYTES} bytes")
    return dict(value)


def _cwd(value: object, default: str) -> str:
    if value is None:
        return default
    if not isinstance(value, str) or not value.startswith("/") or len(value) > 4096:
        raise RequestError(400, "cwd must be an absolute path")
    if not os.path.isdir(value):
        raise RequestError(400, f"cwd {value!r} is not a directory")
    return value


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "space-code-interpreter/1"
    timeout = IDLE_TIMEOUT_S
    registry: Registry  # set on the subclass main() makes

    def log_message(self, format: str, *args: Any) -> None:
        del format, args  # stdout is the start command's log: keep it for errors

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        try:
            body = self._body()
            self._route(method, self.path.split("?", 1)[0], body)
        except RequestError as exc:
            self._json(exc.status, {"error": exc.message})
        except ContextError as exc:
            self._json(503, {"error": str(exc)})

    def _route(self, method: str, path: str, body: dict[str, Any]) -> None:
        registry = self.registry
        if (method, path) == ("GET", "/health"):
            # 503 until the default kernel answers: the template's ready check waits for 200.
            state = registry.default_state()
            ready = state == "ready"
            self._json(
                200 if ready else 503,
                {"status": "ok" if ready else "starting", "default_context": state},
            )
        elif (method, path) == ("POST", "/execute"):
            self._execute(body)
        elif (method, path) == ("POST", "/contexts"):
            language = _language(body.get("language"))
            context = registry.create(language, _cwd(body.get("cwd"), registry.default_cwd))
            try:
                context.wait_ready()
            except ContextError:
                registry.remove(context.id)
                raise
            self._json(200, context.describe())
        elif (method, path) == ("GET", "/contexts"):
            self._json(200, registry.listing())
        elif (match := _CONTEXT_PATH_RE.fullmatch(path)) is None:
            raise RequestError(404, f"no route {method} {path[:200]}")
        elif method == "DELETE" and not match[2]:
            registry.remove(match[1])
            self._empty(204)
        elif method == "POST" and match[2]:
            context = registry.get(match[1])
            context.wait_ready()
            with context.busy:
                context.restart()
            self._empty(204)
        else:
            raise RequestError(405, f"{method} is not allowed on {path[:200]}")

    def _body(self) -> dict[str, Any]:
        if self.headers.get("Transfer-Encoding"):
            raise RequestError(411, "send the body with a Content-Length")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise RequestError(400, "bad Content-Length") from None
        if length < 0 or length > MAX_BODY_BYTES:
            self.close_connection = True  # the body stays unread
            raise RequestError(413, f"body is {length} bytes, at most {MAX_BODY_BYTES}")
        if length == 0:
            return {}
        try:
            body = json.loads(self.rfile.read(length))
        except ValueError:
            raise RequestError(400, "body is not JSON") from None
        if not isinstance(body, dict):
            raise RequestError(400, "body must be a JSON object")
        return body

    def _execute(self, body: dict[str, Any]) -> None:
        code = body.get("code")
        if not isinstance(code, str) or len(code.encode()) > MAX_CODE_BYTES:
            raise RequestError(400, f"code must be a string of at most {MAX_CODE_BYTES} bytes")
        env = _env_vars(body.get("env_vars"))
        context_id = body.get("context_id")
        if context_id is not None and body.get("language") is not None:
            raise RequestError(400, "give context_id or language, not both")
        if context_id is None:
            context = self.registry.default(_language(body.get("language")))
        elif isinstance(context_id, str):
            context = self.registry.get(context_id)
        else:
            raise RequestError(400, "context_id must be a string")
        context.wait_ready()
        if not context.busy.acquire(timeout=BUSY_WAIT_S):
            raise RequestError(503, f"the context stayed busy for {BUSY_WAIT_S:g} s")
        try:
            self._stream(context, code, env)
        finally:
            context.busy.release()

    def _stream(self, context: Context, code: str, env: dict[str, str]) -> None:
        events, cancelled = context.execute(code, env)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while True:
            try:
                event = events.get(timeout=_POLL_S)
            except queue.Empty:
                # A quiet execution writes nothing, so a client that left is seen here.
                if not cancelled.is_set() and self._client_gone():
                    cancelled.set()
                continue
            if event is None:
                break
            if not cancelled.is_set():
                try:
                    self._chunk(json.dumps(event).encode() + b"\n")
                except OSError:
                    cancelled.set()  # the client went away: interrupt, drain, free the context
        if cancelled.is_set():
            self.close_connection = True
            return
        try:
            self._chunk(b'{"type": "end_of_execution"}\n')
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def _client_gone(self) -> bool:
        """Whether the client closed its end (readable with nothing to read)."""
        readable, _, _ = select.select([self.connection], [], [], 0)
        if not readable:
            return False
        try:
            return bool(self.connection.recv(1, socket.MSG_PEEK) == b"")
        except OSError:
            return True

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _json(self, status: int, value: object) -> None:
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _empty(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()


class Server(http.server.ThreadingHTTPServer):
    """A thread per connection, at most MAX_CONNECTIONS at once (more are closed)."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], handler: type[Handler]) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def warm_up(cwd: str) -> int:
    """Start a kernel, draw a figure, stop: fills the caches a first start would."""
    context = Context("python", cwd, kernel_environment())
    try:
        context.wait_ready()
        events, _ = context.execute(
            "import matplotlib.pyplot as plt\nplt.plot([0, 1])\nplt.show()", {}
        )
        seen = list(drain(events))
    finally:
        context.shutdown()
    errors = [event for event in seen if event["type"] == "error"]
    images = [event for event in seen if event["type"] == "result" and "png" in event]
    charts = [event for event in images if event.get("chart", {}).get("type") == "line"]
    print(f"warm-up: {len(images)} image(s), {len(charts)} chart(s), errors: {errors}", flush=True)
    return 0 if images and charts and not errors else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=49999)
    parser.add_argument("--cwd", default=os.path.expanduser("~"))
    parser.add_argument("--max-contexts", type=int, default=MAX_CONTEXTS)
    parser.add_argument("--warm-up", action="store_true")
    args = parser.parse_args(argv)
    if args.warm_up:
        return warm_up(args.cwd)
    registry = Registry(args.cwd, args.max_contexts)
    handler = type("BoundHandler", (Handler,), {"registry": registry})
    server = Server((args.host, args.port), handler)
    registry.default("python")  # its kernel starts now, beside the listening socket
    print(f"listening on {args.host}:{args.port}", flush=True)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        server.serve_forever()
    finally:
        _kill_kernels()
    return 0


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _kill_kernels() -> None:
    """Kill the kernels this server started. Stopping them one by one could take long.
    Left orphaned, a kernel notices its parent's death only when it is re-parented
    to pid 1, which a subreaper (a container's init, a test runner) never does."""
    me = str(os.getpid())
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:  # the parent's pid, after the state
            with contextlib.suppress(OSError):
                os.kill(int(entry), signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
