"""``space ports`` (issue 20): show and set who may reach a sandbox's ports."""

from __future__ import annotations

import pytest
from click.testing import CliRunner, Result

from space.cli import CliContext, main
from tests.unit._live_api import API_URL, LiveApi


@pytest.fixture
def fake(sync_api: LiveApi) -> LiveApi:
    return sync_api


def _space(fake: LiveApi, *args: str) -> Result:
    return CliRunner().invoke(
        main,
        [*args],
        obj=CliContext(transport=fake.transport()),
        env={"SPACE_API_KEY": fake.key, "SPACE_API_URL": API_URL},
    )


def test_ports_are_shown_off_then_enabled_with_the_token_header_then_public(
    fake: LiveApi,
) -> None:
    created = _space(fake, "create")
    sandbox_id = created.stdout.strip()
    shown = _space(fake, "ports", sandbox_id)
    assert shown.exit_code == 0 and shown.stdout == "ports: off\n"
    enabled = _space(fake, "ports", sandbox_id, "8080", "--enable")
    assert enabled.exit_code == 0, enabled.output
    lines = enabled.stdout.splitlines()
    assert lines[0] == "ports: token"
    assert f"E2b-Sandbox-Id: {sandbox_id}" in lines[1]  # no sandbox domain here
    assert lines[2].startswith("header: X-Space-Traffic-Token: ")
    public = _space(fake, "ports", sandbox_id, "--public")
    assert public.stdout == "ports: public\n"
    body = [b for _, path, b in fake.bodies if path.endswith("/ports")][-1]
    assert body == {"enabled": True, "public": True}
    assert _space(fake, "ports", sandbox_id, "--disable").stdout == "ports: off\n"


def test_negative_a_port_out_of_range_exits_2(fake: LiveApi) -> None:
    assert _space(fake, "ports", "sb-x", "70000").exit_code == 2
