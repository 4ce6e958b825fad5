"""The code interpreter template (templates/code-interpreter) built on a real node, and
its server on port 49999 called from inside a sandbox of it.

The build installs its Debian packages from the closure scripts/setup.sh cached
(tests.code_interpreter_debs), served on 127.0.0.1: nothing is fetched from the
internet. Calls go through the guest's own loopback (python3's urllib in the sandbox,
run through our exec API), as the E2B SDK's would once routed to the port; each event is
checked for the fields e2b-code-interpreter's ``parse_output`` reads.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import re
import tarfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest

from space.node.api import (
    BuildEvent,
    BuildLog,
    BuildSucceeded,
    ExecRequest,
    NotFound,
    SandboxSpec,
)
from space.node.core.config import NodeConfig
from tests.apt_repo import served_directory
from tests.code_interpreter_debs import SPEC_DIR, cached_repository

from .conftest import NodeHarness, started_node
from .test_pause_resume import _run

# A build installs about 140 packages in a TCG build VM: minutes, past the default limit.
pytestmark = [pytest.mark.vm, pytest.mark.timeout(1800)]

TEMPLATE = "code-interpreter-v1"  # e2b-code-interpreter's DEFAULT_TEMPLATE
SANDBOX = "code-interp"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")

# Runs in the guest: one request to the server, retried while it is not listening yet
# (a sandbox restored from the ready state may still be starting it). Prints the status
# on the first line, then the body.
_CLIENT = """
import json, sys, time, urllib.error, urllib.request
method, path, body = sys.argv[1:4]
request = urllib.request.Request(
    "http://127.0.0.1:49999" + path, data=body.encode() if body else None, method=method,
    headers={"Content-Type": "application/json"})
deadline = time.monotonic() + 300
while True:
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            print(response.status); sys.stdout.write(response.read().decode())
        break
    except urllib.error.HTTPError as error:
        print(error.code); sys.stdout.write(error.read().decode())
        break
    except (urllib.error.URLError, ConnectionError):
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)
"""


@dataclass
class Interpreter:
    """The built template's sandbox and how to call its server."""

    node: NodeHarness
    build_s: float
    create_s: float

    def call(self, method: str, path: str, body: object = None) -> tuple[int, str]:
        argv = ["python3", "-c", _CLIENT, method, path, "" if body is None else json.dumps(body)]
        request = ExecRequest(argv=argv, user="user", timeout_s=600)
        out, code = self.node.run(_run(self.node.node, SANDBOX, request))
        assert code == 0, out
        status, _, rest = out.partition("\n")
        return int(status), rest

    def execute(self, code: str, **fields: object) -> list[dict[str, Any]]:
        """The events of one /execute, each checked as the SDK's parse_output reads it."""
        status, body = self.call("POST", "/execute", {"code": code, **fields})
        assert status == 200, body
        events = [json.loads(line) for line in body.splitlines()]
        assert events[-1] == {"type": "end_of_execution"}, events
        for event in events:
            _check_event(event)
        return events


def _check_event(event: dict[str, Any]) -> None:
    kind = event["type"]
    if kind in ("stdout", "stderr"):
        assert isinstance(event["text"], str) and isinstance(event["timestamp"], int)
    elif kind == "error":
        assert all(isinstance(event[key], str) for key in ("name", "value", "traceback"))
    elif kind == "number_of_executions":
        assert isinstance(event["execution_count"], int)
    elif kind == "result":
        assert isinstance(event["is_main_result"], bool)
    else:
        assert kind == "end_of_execution", event


def _of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [event for event in events if event["type"] == kind]


def _context_tar() -> AsyncIterator[bytes]:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for path in sorted(SPEC_DIR.rglob("*")):
            if "__pycache__" not in path.parts:
                archive.add(path, arcname=str(path.relative_to(SPEC_DIR)), recursive=False)
    data = buffer.getvalue()

    async def chunks() -> AsyncIterator[bytes]:
        yield data

    return chunks()


@pytest.fixture(scope="module")
def interpreter(node_config: NodeConfig) -> Iterator[Interpreter]:
    repository = cached_repository()
    assert (repository / "complete").is_file(), (
        f"{repository} is missing: scripts/setup.sh caches the template's packages"
    )
    with (
        served_directory(repository) as source,
        started_node(replace(node_config, apt_sources=(source,))) as node,
    ):
        try:
            yield _built(node)
        finally:
            with contextlib.suppress(NotFound):
                node.run(node.node.delete_sandbox(SANDBOX))
            for info in node.run(node.node.list_templates()):
                if info.name == TEMPLATE:
                    node.run(node.node.delete_template(f"{info.name}@{info.digest}"))


def _built(node: NodeHarness) -> Interpreter:
    started = time.monotonic()

    async def build() -> list[BuildEvent]:
        stream = await node.node.build_template(_context_tar())
        events = []
        async for event in stream:
            events.append(event)
            if isinstance(event, BuildLog) and event.line.startswith("step "):
                print(f"[{time.monotonic() - started:6.1f} s] {event.line}")
        return events

    events = node.run(build())
    build_s = time.monotonic() - started
    logs = "\n".join(event.line for event in events if isinstance(event, BuildLog))
    assert isinstance(events[-1], BuildSucceeded), f"{logs}\n{events[-1]}"
    assert events[-1].template.ready
    started = time.monotonic()
    node.run(node.node.create_sandbox(SandboxSpec(SANDBOX, template=TEMPLATE)))
    create_s = time.monotonic() - started
    return Interpreter(node, build_s, create_s)


def test_the_first_run_code_returns_the_value_of_the_last_expression(
    interpreter: Interpreter,
) -> None:
    started = time.monotonic()
    events = interpreter.execute("1 + 1")
    first_s = time.monotonic() - started
    (result,) = _of(events, "result")
    assert (result["text"], result["is_main_result"]) == ("2", True)
    assert _of(events, "number_of_executions")[0]["execution_count"] >= 1
    assert not _of(events, "error")
    print(
        f"template build {interpreter.build_s:.1f} s, sandbox create {interpreter.create_s:.1f} s,"
        f" first /execute {first_s:.1f} s"
    )
    started = time.monotonic()
    interpreter.execute("2 + 2")
    print(f"second /execute {time.monotonic() - started:.2f} s")


def test_print_comes_back_as_stdout_and_an_exception_as_an_error_with_its_traceback(
    interpreter: Interpreter,
) -> None:
    events = interpreter.execute("import sys\nprint('hello')\nprint('oops', file=sys.stderr)")
    assert [e["text"] for e in _of(events, "stdout")] == ["hello\n"]
    assert [e["text"] for e in _of(events, "stderr")] == ["oops\n"]
    assert not _of(events, "result")

    events = interpreter.execute("1 / 0")
    (error,) = _of(events, "error")
    assert (error["name"], error["value"]) == ("ZeroDivisionError", "division by zero")
    traceback = _ANSI_RE.sub("", error["traceback"])  # IPython colours it
    assert "----> 1 1 / 0" in traceback and "ZeroDivisionError" in traceback


def test_a_matplotlib_chart_comes_back_as_a_png(interpreter: Interpreter) -> None:
    shown = interpreter.execute("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()")
    as_value = interpreter.execute("fig, ax = plt.subplots()\nax.bar([1, 2], [3, 4])\nfig")
    for events, main in ((shown, False), (as_value, True)):
        (result,) = _of(events, "result")  # a figure that is the value comes once
        assert result["is_main_result"] is main
        assert base64.b64decode(result["png"], validate=True).startswith(PNG_MAGIC)
        assert result["text"].startswith("<Figure size")


def test_state_persists_between_executions_in_a_context(interpreter: Interpreter) -> None:
    interpreter.execute("shared = 41")
    (result,) = _of(interpreter.execute("shared + 1"), "result")
    assert result["text"] == "42"


def test_a_new_context_is_separate_and_can_be_restarted_and_deleted(
    interpreter: Interpreter,
) -> None:
    interpreter.execute("shared = 41")
    status, body = interpreter.call("POST", "/contexts", {"cwd": "/tmp"})
    assert status == 200, body
    context = json.loads(body)
    assert (context["language"], context["cwd"]) == ("python", "/tmp")
    status, body = interpreter.call("GET", "/contexts")
    assert context["id"] in {c["id"] for c in json.loads(body)}

    events = interpreter.execute("shared", context_id=context["id"])
    assert _of(events, "error")[0]["name"] == "NameError"
    interpreter.execute("import os\nmine = os.getcwd()", context_id=context["id"])
    (result,) = _of(interpreter.execute("mine", context_id=context["id"]), "result")
    assert result["text"] == "'/tmp'"
    assert _of(interpreter.execute("mine"), "error")[0]["name"] == "NameError"

    assert interpreter.call("POST", f"/contexts/{context['id']}/restart")[0] == 204
    events = interpreter.execute("mine", context_id=context["id"])
    assert _of(events, "error")[0]["name"] == "NameError"  # a restart forgets
    assert interpreter.call("DELETE", f"/contexts/{context['id']}")[0] == 204
    assert interpreter.call("DELETE", f"/contexts/{context['id']}")[0] == 404


def test_env_vars_apply_to_their_execution_only(interpreter: Interpreter) -> None:
    code = "import os\nprint(os.environ.get('SPACE_GREETING'))"
    events = interpreter.execute(code, env_vars={"SPACE_GREETING": "hi 'there'\n"})
    assert [e["text"] for e in _of(events, "stdout")] == ["hi 'there'\n\n"]
    assert [e["text"] for e in _of(interpreter.execute(code), "stdout")] == ["None\n"]


def test_negative_bad_requests_are_refused_before_anything_runs(interpreter: Interpreter) -> None:
    for body, problem in (
        ({"code": 1}, "code must be a string"),
        ({"code": "1", "language": "cobol"}, "language must be one of"),
        ({"code": "1", "env_vars": {"A B": "x"}}, "invalid variable name"),
        ({"code": "1", "context_id": "0" * 8 + "-0000-0000-0000-" + "0" * 12}, "no context"),
    ):
        status, text = interpreter.call("POST", "/execute", body)
        assert status in (400, 404) and problem in json.loads(text)["error"], (body, text)
    status, text = interpreter.call("GET", "/health")
    assert (status, json.loads(text)["status"]) == (200, "ok")
