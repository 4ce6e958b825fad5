"""The real, unmodified ``e2b_code_interpreter`` SDK against a real platform: its
``Sandbox`` created from our code interpreter template (templates/code-interpreter),
``run_code`` with text, values, errors and a matplotlib chart (its PNG and its data), and
contexts (issue 20).

The platform runs with ``--sandbox-domain`` as in test_e2b_envd.py; the tenant builds
the template through our own SDK, its packages coming from the closure scripts/setup.sh
cached (tests.code_interpreter_debs) as the node's only apt source (apt's ``copy:``
method: nothing is fetched from the internet). The node keeps its build cache in
BUILD_CACHE (space/node/agent/_build_cache.py) with a node key of its own there, so the
first run builds (about 5 minutes under TCG) and later runs receive the built layer, as
long as nothing that goes into the build changed. Every SDK call goes through its own HTTP
client to port 49999 of the sandbox (E2b-Sandbox-Id / E2b-Sandbox-Port headers to
E2B_SANDBOX_URL), configured by environment variables only. One sandbox serves every
cell.
"""

from __future__ import annotations

import base64
import os
import pwd
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from space.node.agent.node_user import DEFAULT_USER
from space.sdk import Template
from tests.code_interpreter_debs import SPEC_DIR, cached_repository
from tests.e2b_sdk import run_e2b

from .platform import Platform, running_platform

# A first build installs about 140 packages in a TCG build VM: about 5 minutes alone.
pytestmark = [pytest.mark.vm, pytest.mark.timeout(2400)]

DOMAIN = "e2b.test"
TENANT = "acme"
TEMPLATE = "code-interpreter-v1"  # e2b-code-interpreter's DEFAULT_TEMPLATE
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
#: The node's build cache, kept across runs; its node key is the cache's own.
BUILD_CACHE = Path("/var/cache/space/builds")

# Prepended to every script: the SDK's Sandbox, connected to the shared sandbox.
_CONNECT = """
import base64
from e2b_code_interpreter import Sandbox as CodeSandbox
# A new context starts a kernel: past the SDK's default 60 s request timeout under TCG.
sandbox = CodeSandbox.connect({sandbox_id!r}, timeout=3600, request_timeout=600)
"""


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    repository = cached_repository()
    assert (repository / "complete").is_file(), (
        f"{repository} is missing: scripts/setup.sh caches the template's packages"
    )
    repository.chmod(0o755)  # apt reads it as the node's user
    data_dir = tmp_path_factory.mktemp("e2b-code-interpreter") / "data"
    options = [
        "--sandbox-domain", DOMAIN,
        "--apt-source", f"deb [trusted=yes] copy:{repository} ./",
        "--build-cache", str(BUILD_CACHE),
        "--node-key-file", str(_cache_key()),
    ]  # fmt: skip
    with running_platform(data_dir, options) as plat:
        yield plat


def _cache_key() -> Path:
    """The build cache's node key (a layer's disk is sealed with it), made once; the
    cache and key are the node's user's alone, as its data dir is."""
    user = pwd.getpwnam(DEFAULT_USER)
    BUILD_CACHE.mkdir(mode=0o700, exist_ok=True)
    os.chown(BUILD_CACHE, user.pw_uid, user.pw_gid)
    key_file = BUILD_CACHE / "node.key"
    if not key_file.exists():
        partial = BUILD_CACHE / ".node.key.partial"
        partial.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
        partial.chmod(0o600)
        os.chown(partial, user.pw_uid, user.pw_gid)
        partial.rename(key_file)
    return key_file


@pytest.fixture(scope="module")
def sandbox(platform: Platform) -> Iterator[dict[str, Any]]:
    key = platform.create_key(TENANT)
    started = time.monotonic()
    log: list[str] = []

    def on_log(line: str) -> None:
        log.append(line)
        print(f"[{time.monotonic() - started:7.1f} s] {line}")

    info = Template.build(
        SPEC_DIR, api_url=platform.url, api_key=key, request_timeout_s=1800, on_log=on_log
    )
    build_s = time.monotonic() - started
    cached = any("from the build cache" in line for line in log)
    assert (info.name, info.ready, info.memory_mib) == (TEMPLATE, True, 1024)
    # Created by the SDK's own default template name; the first run_code is timed from
    # the moment the create returned.
    created = run_e2b(
        """
        import time
        from e2b_code_interpreter import Sandbox as CodeSandbox
        started = time.monotonic()
        sandbox = CodeSandbox.create(timeout=3600, request_timeout=600)
        created = time.monotonic()
        execution = sandbox.run_code("1 + 1", timeout=600)
        first = time.monotonic()
        execution2 = sandbox.run_code("2 + 2")
        report({
            "id": sandbox.sandbox_id, "create_s": created - started,
            "first_s": first - created, "second_s": time.monotonic() - first,
            "text": execution.text, "text2": execution2.text,
        })
        """,
        url=platform.url,
        api_key=key,
        timeout_s=900,
    )
    how = "received from the build cache" if cached else "built"
    print(
        f"template build {build_s:.1f} s ({how}), create {created['create_s']:.1f} s,"
        f" first run_code {created['first_s']:.2f} s, second {created['second_s']:.2f} s"
    )
    try:
        yield {"key": key, **created}
    finally:
        killed = run_e2b(
            f"""
            from e2b_code_interpreter import Sandbox as CodeSandbox
            report(CodeSandbox.kill({created["id"]!r}))
            """,
            url=platform.url,
            api_key=key,
        )
        assert killed is True


def _run(platform: Platform, sandbox: dict[str, Any], script: str) -> Any:
    prelude = _CONNECT.format(sandbox_id=sandbox["id"])
    return run_e2b(prelude + script, url=platform.url, api_key=sandbox["key"], timeout_s=600)


def test_the_first_run_code_is_answered_by_a_kernel_the_ready_state_holds(
    sandbox: dict[str, Any],
) -> None:
    assert (sandbox["text"], sandbox["text2"]) == ("2", "4")
    # The ready state was saved once /health answered 200 (the template's [ready]
    # check), so no kernel start is left for the first run_code: under TCG a start took
    # 22-33 s before that check existed.
    assert sandbox["first_s"] < 10, sandbox


def test_run_code_returns_stdout_the_value_and_an_error_with_its_traceback(
    platform: Platform, sandbox: dict[str, Any]
) -> None:
    result = _run(
        platform,
        sandbox,
        """
out = []
printed = sandbox.run_code("import sys\\nprint('hello')\\nprint('oops', file=sys.stderr)\\n6 * 7",
                           on_stdout=lambda m: out.append(m.line))
failed = sandbox.run_code("def f():\\n    return 1 / 0\\nf()")
code = "import os\\nos.environ.get('SPACE_GREETING')"
with_env = sandbox.run_code(code, envs={"SPACE_GREETING": "hi 'there'"}).text
without = sandbox.run_code(code).text
report({
    "envs": [with_env, without],
    "stdout": printed.logs.stdout, "stderr": printed.logs.stderr, "callback": out,
    "text": printed.text, "main": [r.is_main_result for r in printed.results],
    "error": printed.error is None,
    "name": failed.error.name, "value": failed.error.value,
    "traceback": failed.error.traceback, "results": len(failed.results),
})
""",
    )
    assert result["stdout"] == ["hello\n"] and result["stderr"] == ["oops\n"]
    assert result["callback"] == ["hello\n"]
    assert (result["text"], result["main"], result["error"]) == ("42", [True], True)
    assert (result["name"], result["value"]) == ("ZeroDivisionError", "division by zero")
    traceback = _ANSI_RE.sub("", result["traceback"])  # IPython colours it
    assert "return 1 / 0" in traceback and "----> 3 f()" in traceback, traceback
    assert result["results"] == 0
    assert result["envs"] == ["\"hi 'there'\"", None]  # envs apply to their run only


def test_a_matplotlib_chart_comes_back_as_a_png_and_its_data(
    platform: Platform, sandbox: dict[str, Any]
) -> None:
    result = _run(
        platform,
        sandbox,
        """
shown = sandbox.run_code(
    "import matplotlib.pyplot as plt\\nplt.plot([1, 3, 2], label='load')\\nplt.title('space')\\n"
    "plt.xlabel('Time (s)')\\nplt.show()")
(chart,) = shown.results
png = base64.b64decode(chart.png, validate=True)
data = chart.chart
report({"formats": sorted(chart.formats()), "main": chart.is_main_result,
        "head": list(png[:8]), "size": len(png), "class": type(data).__name__,
        "title": data.title, "x_unit": data.x_unit, "x_scale": data.x_scale.value,
        "lines": [(line.label, line.points) for line in data.elements]})
""",
    )
    assert result["formats"] == ["chart", "png", "text"] and result["main"] is False
    assert bytes(result["head"]) == PNG_MAGIC and result["size"] > 1000
    # E2B's chart: the SDK decoded it as a LineChart (templates/code-interpreter/server/charts.py).
    assert (result["class"], result["title"], result["x_unit"]) == ("LineChart", "space", "s")
    assert result["x_scale"] == "linear"
    assert result["lines"] == [["load", [[0.0, 1.0], [1.0, 3.0], [2.0, 2.0]]]]


def test_a_context_keeps_its_own_state_apart_from_the_default_one(
    platform: Platform, sandbox: dict[str, Any]
) -> None:
    result = _run(
        platform,
        sandbox,
        """
sandbox.run_code("shared = 'default'")
context = sandbox.create_code_context(cwd="/tmp", request_timeout=600)
listed = [c.id for c in sandbox.list_code_contexts()]
sandbox.run_code("mine = 41", context=context)
mine = sandbox.run_code("import os\\n(mine + 1, os.getcwd())", context=context).text
apart = sandbox.run_code("shared", context=context).error.name
default_apart = sandbox.run_code("mine").error.name
default_kept = sandbox.run_code("shared").text
sandbox.restart_code_context(context)
restarted = sandbox.run_code("mine", context=context).error.name
sandbox.remove_code_context(context)
after = [c.id for c in sandbox.list_code_contexts()]
gone = error_of(sandbox.run_code, "mine", context=context)
report({
    "language": context.language, "cwd": context.cwd, "listed": context.id in listed,
    "count": len(listed), "mine": mine, "apart": apart, "default_apart": default_apart,
    "default_kept": default_kept, "restarted": restarted, "after": context.id in after,
    "gone": gone,
})
""",
    )
    assert (result["language"], result["cwd"]) == ("python", "/tmp")
    assert result["listed"] and result["count"] == 2  # with the default context
    assert result["mine"] == "(42, '/tmp')"
    assert result["apart"] == result["default_apart"] == "NameError"
    assert result["default_kept"] == "'default'"
    assert result["restarted"] == "NameError"  # a restarted context forgets
    assert result["after"] is False and result["gone"] == "NotFoundException"
