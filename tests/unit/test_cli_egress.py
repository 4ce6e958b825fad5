"""``space create --allow`` and ``space egress show/set/log`` (issue 5)."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from space.cli import CliContext, main
from tests.unit._fake_egress import CANNED_EVENTS
from tests.unit._live_api import API_URL, LiveApi
from tests.unit.test_cli_templates import Served

#: The node's canned events, the allowed one at a time the assertions can spell.
EVENTS = [
    replace(CANNED_EVENTS[0], time=datetime(2026, 11, 30, 12, 0, 1, 250000, UTC).timestamp()),
    CANNED_EVENTS[1],
]


@pytest.fixture
def fake(sync_api: LiveApi) -> LiveApi:
    """The real API over a FakeNode, serving the CLI's sync SDK."""
    return sync_api


def _space(fake: LiveApi, *args: str) -> Result:
    return CliRunner().invoke(
        main,
        [*args],
        obj=CliContext(transport=fake.transport()),
        env={"SPACE_API_KEY": fake.key, "SPACE_API_URL": API_URL},
    )


def _new_sandbox(fake: LiveApi, *allow: str) -> str:
    result = _space(fake, "create", *[arg for rule in allow for arg in ("--allow", rule)])
    assert result.exit_code == 0, result.output
    return result.stdout.strip()


def test_create_with_allow_sends_the_policy_of_its_rules(fake: LiveApi) -> None:
    _new_sandbox(fake, "pypi.org", "[2001:db8::/32]:443")
    (body,) = [body for _, path, body in fake.bodies if path == "/v1/sandboxes"]
    assert body["egress"] == {
        "allow": [{"domain": "pypi.org"}, {"cidr": "2001:db8::/32", "ports": [443]}]
    }


def test_create_without_allow_sends_no_policy(fake: LiveApi) -> None:
    _new_sandbox(fake)
    (body,) = [body for _, path, body in fake.bodies if path == "/v1/sandboxes"]
    assert "egress" not in body


def test_negative_a_malformed_allow_rule_exits_2_before_any_request(fake: LiveApi) -> None:
    result = _space(fake, "create", "--allow", "pypi.org:https")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --allow: egress rule 'pypi.org:https'")
    assert fake.requests == []


def test_egress_set_prints_the_canonical_policy_and_show_reads_it_back(fake: LiveApi) -> None:
    sid = _new_sandbox(fake)
    result = _space(fake, "egress", "set", sid, "--allow", "*.github.com:443", "--allow", "a.org")
    assert result.exit_code == 0, result.output
    expected = {
        "allow": [
            {"domain": "*.github.com", "ports": [443]},
            {"domain": "a.org", "ports": [80, 443]},
        ]
    }
    assert json.loads(result.stdout) == expected
    shown = _space(fake, "egress", "show", sid)
    assert shown.exit_code == 0 and json.loads(shown.stdout) == expected


def test_egress_set_without_allow_closes_all_network_without_asking(fake: LiveApi) -> None:
    sid = _new_sandbox(fake, "pypi.org")
    result = _space(fake, "egress", "set", sid)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"allow": []}
    assert fake.node.egress[sid] == {"allow": []}


def test_negative_egress_set_reports_the_servers_refusal(fake: LiveApi) -> None:
    sid = _new_sandbox(fake, "pypi.org")
    result = _space(fake, "egress", "set", sid, "--allow", "under_score.org")
    assert result.exit_code == 1
    assert "invalid_argument: allow[0].domain: 'under_score.org' is not" in result.stderr
    assert fake.node.egress[sid] == {"allow": [{"domain": "pypi.org", "ports": [80, 443]}]}


def test_negative_egress_show_of_an_unknown_sandbox_exits_1(fake: LiveApi) -> None:
    result = _space(fake, "egress", "show", "sbx-nope")
    assert result.exit_code == 1 and result.stderr.startswith("error: not_found")


def test_egress_log_prints_a_table_of_the_decisions(fake: LiveApi) -> None:
    sid = _new_sandbox(fake)
    fake.node.egress_events[sid] = EVENTS
    result = _space(fake, "egress", "log", sid)
    assert result.exit_code == 0, result.output
    header, allowed, denied = result.stdout.splitlines()
    assert header.split() == [
        "TIME", "DECISION", "PROTO", "HOST", "ADDRESS:PORT", "BYTES", "OUT/IN", "SECRETS",
        "REASON",
    ]  # fmt: skip
    assert allowed.split() == [
        "2026-11-30", "12:00:01.250", "allow", "tls", "pypi.org", "151.101.0.223:443",
        "517/4096", "PYPI_TOKEN", "policy",
    ]  # fmt: skip
    assert denied.split()[2:6] == ["deny", "dns", "evil.example", "-"]
    assert denied.endswith("no rule for host")


def test_egress_log_json_prints_the_events_and_shows_ipv6_bracketed(fake: LiveApi) -> None:
    sid = _new_sandbox(fake)
    fake.node.egress_events[sid] = [replace(EVENTS[0], address="2001:db8::1")] * 3
    as_json = _space(fake, "egress", "log", sid, "--json", "--limit", "2")
    assert as_json.exit_code == 0, as_json.output
    events = json.loads(as_json.stdout)
    assert len(events) == 2 and events[0]["address"] == "2001:db8::1"
    assert events[0]["time"] == "2026-11-30T12:00:01.250000+00:00"
    table = _space(fake, "egress", "log", sid)
    assert "[2001:db8::1]:443" in table.stdout


def test_egress_log_says_how_many_events_the_audit_dropped(fake: LiveApi) -> None:
    sid = _new_sandbox(fake)
    fake.node.egress_events[sid] = EVENTS
    assert "dropped" not in _space(fake, "egress", "log", sid).output
    fake.node.egress_dropped[sid] = 7
    for args in ((), ("--json",)):
        result = _space(fake, "egress", "log", sid, *args)
        assert result.exit_code == 0, result.output
        assert "7 events dropped" in result.stderr and "dropped" not in result.stdout


@pytest.mark.parametrize("limit", ["0", "1001", "x"])
def test_negative_egress_log_limit_out_of_range_exits_2(fake: LiveApi, limit: str) -> None:
    sid = _new_sandbox(fake)
    result = _space(fake, "egress", "log", sid, "--limit", limit)
    assert result.exit_code == 2
    assert not [p for _, p, _ in fake.requests if p.endswith("/egress/log")]


def test_egress_through_the_control_plane_reaches_the_node(tmp_path: Path) -> None:
    with Served(tmp_path / "data") as served:
        created = served.space("create", "--allow", "pypi.org:443")
        assert created.exit_code == 0, created.output
        sid = created.stdout.strip()
        assert served.node.egress[sid] == {"allow": [{"domain": "pypi.org", "ports": [443]}]}
        closed = served.space("egress", "set", sid)
        assert closed.exit_code == 0 and served.node.egress[sid] == {"allow": []}
        log = served.space("egress", "log", sid, "--limit", "1")
        assert log.exit_code == 0 and "no rule for host" in log.stdout
