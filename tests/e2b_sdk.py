"""Run a script under the real E2B SDK against a SPACE server, as a user would (issue 20).

The SDK lives in ``.venv-e2b`` (scripts/e2b_sdk_venv.sh installs the versions pinned in
scripts/e2b-sdk-requirements.txt), never in the project's venv: it is driven unmodified,
in a process of its own, configured only through the environment a user sets
(docs/e2b.md). A script reports its result with ``report(value)`` (one JSON value) and
may use ``error_of(call, *args)``: the name of the SDK exception a call raised, or None.

    result = run_e2b(
        '''
        sandbox = Sandbox.create("base", metadata={"k": "v"})
        report({"id": sandbox.sandbox_id, "info": sandbox.get_info().metadata})
        ''',
        url=platform.url,
        api_key=key,
    )
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest

__all__ = ["E2B_VENV", "ROOT", "e2b_environment", "run_e2b"]

ROOT = Path(__file__).resolve().parents[1]
E2B_VENV = ROOT / ".venv-e2b"
_PYTHON = E2B_VENV / "bin" / "python"
_RESULT_MARK = "E2B-SDK-RESULT "

# Prepended to every script: the imports a test script uses most, and the two helpers.
_PRELUDE = f"""\
import json as _json
import sys as _sys

import e2b
from e2b import AsyncSandbox, Sandbox, SandboxQuery


def report(value):
    print({_RESULT_MARK!r} + _json.dumps(value), flush=True)


def error_of(call, *args, **kwargs):
    try:
        call(*args, **kwargs)
    except Exception as error:  # the SDK's own exception type is the answer
        print(f"error_of: {{type(error).__name__}}: {{error}}", file=_sys.stderr)
        return type(error).__name__
    return None

"""


def e2b_environment(url: str, api_key: str) -> dict[str, str]:
    """This process's environment without any E2B_ variable or PYTHONPATH, plus what a
    user sets to point the SDK at SPACE: the API and the sandbox traffic both go to
    ``url`` (the SDK then sends E2b-Sandbox-Id / E2b-Sandbox-Port headers to it).

    No E2B_HTTP_VERSION: over plain http the SDK's transport speaks HTTP/1.1 by itself
    (it leaves the version to ALPN, which only TLS has). No E2B_DEBUG: it would send
    sandbox traffic to localhost:<port> instead."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("E2B_") and name != "PYTHONPATH"
    }
    env.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=api_key)
    return env


def run_e2b(
    script: str,
    *,
    url: str,
    api_key: str,
    timeout_s: float = 180.0,
    env: dict[str, str] | None = None,
) -> Any:
    """Run ``script`` (Python source, dedented) in ``.venv-e2b`` with
    ``e2b_environment(url, api_key)`` plus ``env``; return the value it reported.

    Fails the test, with the script's whole output, when the venv is missing, the
    script exits non-zero, runs past ``timeout_s`` (it is killed), or reports nothing.
    """
    if not _PYTHON.exists():
        pytest.fail(f"{E2B_VENV} is missing: run scripts/e2b_sdk_venv.sh (setup.sh runs it)")
    source = _PRELUDE + textwrap.dedent(script)
    try:
        done = subprocess.run(
            [str(_PYTHON), "-c", source],
            env={**e2b_environment(url, api_key), **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(
            f"the E2B SDK script ran past {timeout_s} s\n"
            f"--- stdout\n{_text(timeout.stdout)}\n--- stderr\n{_text(timeout.stderr)}"
        )
    results = [
        line[len(_RESULT_MARK) :]
        for line in done.stdout.splitlines()
        if line.startswith(_RESULT_MARK)
    ]
    if done.returncode != 0 or len(results) != 1:
        pytest.fail(
            f"the E2B SDK script exited {done.returncode} with {len(results)} results "
            f"(one expected)\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
        )
    return json.loads(results[0])


def _text(output: str | bytes | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""
