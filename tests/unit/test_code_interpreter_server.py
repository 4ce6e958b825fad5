"""The code interpreter's server (templates/code-interpreter/server) on the host, without a
VM: Debian's python3 with python3-ipykernel (scripts/setup.sh installs them on the host
too) and real Jupyter kernels, on 127.0.0.1.

The VM test (tests/integration/test_code_interpreter.py) checks what a sandbox returns;
this one checks what is awkward there: the stream's framing, a client that goes away
mid-execution, and the limits at their boundary.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from tests.e2b_sdk import run_e2b
from tests.ports import free_port

SERVER_DIR = Path(__file__).resolve().parents[2] / "templates" / "code-interpreter" / "server"
#: The guest's interpreter is Debian's python3, as here (not the project's venv).
GUEST_PYTHON = "/usr/bin/python3"
MAX_CONTEXTS = 2


def server_module(name: str) -> ModuleType:
    """A module of the server (``server``, ``charts``) loaded from its file, for its
    limits; the sibling modules it imports (it imports only the stdlib and those) are
    dropped from sys.modules again."""
    sys.path.insert(0, str(SERVER_DIR))
    try:
        spec = importlib.util.spec_from_file_location(
            f"code_interpreter_{name}", SERVER_DIR / f"{name}.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SERVER_DIR))
        for sibling in ("kernels", "charts"):
            sys.modules.pop(sibling, None)


LIMITS = server_module("server")


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found.update(int(child) for child in (task / "children").read_text().split())
    return found


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("code-interpreter")
    port = free_port()
    env = {
        **os.environ,
        "PYTHONDONTWRITEBYTECODE": "1",  # nothing lands in the template's directory
        "MPLCONFIGDIR": str(work / "matplotlib"),
        "IPYTHONDIR": str(work / "ipython"),
    }
    argv = [GUEST_PYTHON, str(SERVER_DIR / "server.py"), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--cwd", str(work), "--max-contexts", str(MAX_CONTEXTS)]
    log = (work / "server.log").open("wb")
    process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _default_ready(url):
            assert process.poll() is None, (work / "server.log").read_text()
            assert time.monotonic() < deadline, "the default kernel did not start in 120 s"
            time.sleep(0.2)
        yield url
    finally:
        kernels = _children(process.pid)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        log.close()
        deadline = time.monotonic() + 30
        while any(_running(pid) for pid in kernels):
            assert time.monotonic() < deadline, f"kernels {kernels} outlived the server by 30 s"
            time.sleep(0.2)


def _running(pid: int) -> bool:
    """Alive: neither gone nor a zombie (one an earlier test's subreaper left unreaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _default_ready(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return bool(httpx.get(f"{url}/health", timeout=2).json()["default_context"] == "ready")
    return False


def _execute(url: str, body: dict[str, object]) -> list[dict[str, object]]:
    response = httpx.post(f"{url}/execute", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.headers["transfer-encoding"] == "chunked"
    return [json.loads(line) for line in response.text.splitlines()]


def test_an_execution_streams_its_events_one_json_object_a_line(server: str) -> None:
    events = _execute(server, {"code": "print('a')\nprint('b')\n6 * 7"})
    kinds = [event["type"] for event in events]
    assert kinds[0] == "number_of_executions" and kinds[-1] == "end_of_execution"
    assert [e["text"] for e in events if e["type"] == "stdout"] in (["a\n", "b\n"], ["a\nb\n"])
    (result,) = [e for e in events if e["type"] == "result"]
    assert result == {"type": "result", "is_main_result": True, "text": "42"}


def test_an_html_repr_comes_back_beside_the_text(server: str) -> None:
    code = (
        "class T:\n"
        "    def _repr_html_(self): return '<b>t</b>'\n"
        "    def __repr__(self): return 'T'\n"
        "T()"
    )
    (result,) = [e for e in _execute(server, {"code": code}) if e["type"] == "result"]
    assert (result["text"], result["html"]) == ("T", "<b>t</b>")


def test_a_client_that_goes_away_interrupts_its_execution(server: str) -> None:
    with httpx.stream(
        "POST", f"{server}/execute", json={"code": "import time\nwhile True: time.sleep(0.05)"}
    ) as response:
        first = json.loads(next(response.iter_lines()))
        assert first["type"] == "number_of_executions"
    # Not interrupted, the loop would hold the context for BUSY_WAIT_S (600 s), past
    # this call's timeout.
    events = _execute(server, {"code": "'free again'"})
    assert [e["text"] for e in events if e["type"] == "result"] == ["'free again'"]


def test_negative_a_body_past_the_limit_is_refused_unread(server: str) -> None:
    limit = LIMITS.MAX_BODY_BYTES
    at_limit = json.dumps({"code": "x" * (limit - len('{"code": ""}'))})
    assert len(at_limit) == limit
    response = httpx.post(f"{server}/execute", content=at_limit, timeout=60)
    assert response.status_code == 400 and "at most" in response.json()["error"]  # code limit
    response = httpx.post(f"{server}/execute", content=at_limit + " ", timeout=60)
    assert response.status_code == 413, response.text


def test_negative_a_context_past_the_limit_is_refused_and_nothing_is_kept(server: str) -> None:
    before = httpx.get(f"{server}/contexts").json()
    assert len(before) == 1  # the default one
    made = httpx.post(f"{server}/contexts", json={}, timeout=120).json()
    assert len(httpx.get(f"{server}/contexts").json()) == MAX_CONTEXTS
    refused = httpx.post(f"{server}/contexts", json={}, timeout=120)
    assert refused.status_code == 429 and f"at most {MAX_CONTEXTS}" in refused.json()["error"]
    assert len(httpx.get(f"{server}/contexts").json()) == MAX_CONTEXTS
    assert httpx.delete(f"{server}/contexts/{made['id']}").status_code == 204
    assert httpx.get(f"{server}/contexts").json() == before


def test_negative_a_cwd_that_is_no_directory_is_refused(server: str) -> None:
    response = httpx.post(f"{server}/contexts", json={"cwd": "/nonexistent/dir"})
    assert response.status_code == 400 and "not a directory" in response.json()["error"]


def test_a_figure_comes_back_with_its_png_and_its_chart_as_the_sdk_reads_them(
    server: str, tmp_path: Path
) -> None:
    code = (
        "import matplotlib.pyplot as plt\n"
        "plt.bar(['a', 'b'], [1, 2]); plt.title('Sales'); plt.ylabel('Total (USD)')\n"
        "plt.show()\n"
    )
    response = httpx.post(f"{server}/execute", json={"code": code}, timeout=120)
    assert response.status_code == 200, response.text
    stream = tmp_path / "stream.ndjson"
    stream.write_text(response.text)
    decoded = run_e2b(
        f"""
        from e2b_code_interpreter.models import Execution, parse_output
        execution = Execution()
        for line in open({str(stream)!r}).read().splitlines():
            parse_output(execution, line)
        (result,) = execution.results
        chart = result.chart
        report({{
            "formats": sorted(result.formats()),
            "class": type(chart).__name__,
            "title": chart.title,
            "y_unit": chart.y_unit,
            "bars": [(bar.label, bar.value) for bar in chart.elements],
            "error": execution.error is not None,
        }})
        """,
        url="http://127.0.0.1:9",  # no server: the SDK only decodes here
        api_key="unused",
    )
    assert decoded == {
        "formats": ["chart", "png", "text"],
        "class": "BarChart",
        "title": "Sales",
        "y_unit": "USD",
        "bars": [["a", 1.0], ["b", 2.0]],
        "error": False,
    }


def test_negative_a_figure_the_extraction_cannot_read_keeps_its_png_and_raises_nothing(
    server: str,
) -> None:
    code = (
        "import matplotlib.pyplot as plt\n"
        "fig, ax = plt.subplots(); ax.plot([1, 2]); ax.get_title = None\n"
        "plt.show()\n"
    )
    events = _execute(server, {"code": code})
    assert [e for e in events if e["type"] in ("error", "stderr")] == []
    (result,) = [e for e in events if e["type"] == "result"]
    assert "png" in result and "chart" not in result
