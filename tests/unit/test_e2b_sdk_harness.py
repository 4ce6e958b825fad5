"""tests/e2b_sdk.py: the pinned E2B SDK runs in .venv-e2b, with the environment a user
sets, and a failing or hanging script fails the test with its output."""

from __future__ import annotations

import pytest

from tests.e2b_sdk import ROOT, e2b_environment, run_e2b

_URL = "http://127.0.0.1:9"  # nothing is sent: these scripts make no request


def test_the_venv_holds_exactly_the_pinned_sdk_versions() -> None:
    pins = dict(
        line.split("==")
        for line in (ROOT / "scripts" / "e2b-sdk-requirements.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    versions = run_e2b(
        """
        from importlib.metadata import version
        report({name: version(name) for name in ("e2b", "e2b-code-interpreter")})
        """,
        url=_URL,
        api_key="k",
    )
    assert versions == pins


def test_a_script_sees_the_users_environment_and_no_other_e2b_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("E2B_DEBUG", "true")  # a stray setting of the test's environment
    seen = run_e2b(
        """
        import os
        report({k: v for k, v in os.environ.items() if k.startswith("E2B_") or k == "PYTHONPATH"})
        """,
        url=_URL,
        api_key="sk_space_x",
    )
    assert seen == {"E2B_API_URL": _URL, "E2B_SANDBOX_URL": _URL, "E2B_API_KEY": "sk_space_x"}
    assert e2b_environment(_URL, "sk_space_x")["E2B_API_KEY"] == "sk_space_x"


def test_negative_a_failing_script_fails_the_test_with_its_output() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"(?s)exited 3.*the reason"):
        run_e2b(
            "import sys; print('the reason', file=sys.stderr); sys.exit(3)", url=_URL, api_key="k"
        )


def test_negative_a_script_past_its_timeout_is_killed_and_fails_the_test() -> None:
    with pytest.raises(pytest.fail.Exception, match="ran past 1"):
        run_e2b("import time; time.sleep(30)", url=_URL, api_key="k", timeout_s=1)


def test_negative_a_script_that_reports_nothing_fails_the_test() -> None:
    with pytest.raises(pytest.fail.Exception, match="0 results"):
        run_e2b("pass", url=_URL, api_key="k")
