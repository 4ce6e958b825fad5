"""``space secret set/ls/rm/rotate-master`` and ``space create --secret`` (issue 5)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from space.cli import CliContext, main
from space.control.secrets import MASTER_KEY_ENV, OLD_MASTER_KEYS_ENV
from tests.unit.test_cli_templates import Served

VALUE = "sk-cli-55aa-not-in-argv"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with Served(tmp_path / "data") as served:
        yield served


def _space(served: Served, *args: str, stdin: str | None = None) -> Result:
    obj = CliContext(transport=served.transport)
    return CliRunner().invoke(main, [*args], obj=obj, env=served.env, input=stdin)


def test_set_reads_the_value_from_stdin_and_a_sandbox_gets_it(served: Served) -> None:
    result = _space(served, "secret", "set", "OPENAI", "--host", "api.openai.com",
                    "--env", "OPENAI_API_KEY", stdin=VALUE + "\n")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout == "OPENAI  env OPENAI_API_KEY  hosts api.openai.com\n"
    created = _space(served, "create", "--secret", "OPENAI")
    assert created.exit_code == 0, created.output
    sid = created.stdout.strip()
    (grant,) = served.node.grants[sid]
    assert (grant.name, grant.value, grant.env) == ("OPENAI", VALUE, "OPENAI_API_KEY")
    assert VALUE not in result.output + created.output


def test_set_with_header_and_a_value_file_then_ls_and_rm(served: Served, tmp_path: Path) -> None:
    value_file = tmp_path / "value"
    value_file.write_text(VALUE + "\n")
    result = _space(served, "secret", "set", "API", "--host", "*.example.com", "--host", "b.org",
                    "--header", "Authorization", "--format", "Bearer {value}",
                    "--value-file", str(value_file))  # fmt: skip
    assert result.exit_code == 0, result.output
    listed = _space(served, "secret", "ls")
    assert listed.exit_code == 0, listed.output
    header, row = listed.stdout.splitlines()
    assert header.split() == ["NAME", "ENV", "HOSTS", "INJECTION", "UPDATED"]
    assert row.startswith("API   API  *.example.com,b.org  Authorization: Bearer {value}")
    removed = _space(served, "secret", "rm", "API", "API")
    assert removed.exit_code == 0 and removed.stdout == "API\nAPI\n"
    assert _space(served, "secret", "ls").stdout.splitlines()[1:] == []
    assert VALUE not in listed.output


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (("--format", "Bearer {value}"), VALUE, "--format goes with --header"),
        ((), "", "the value is empty"),
        ((), "x" * (16 * 1024 + 1), "longer than 16384 bytes"),
        (("--value-file", "/nonexistent/v"), None, "cannot read the value"),
    ],
)
def test_negative_a_bad_value_or_flag_exits_2_before_any_request(
    served: Served, args: tuple[str, ...], stdin: str | None, message: str
) -> None:
    result = _space(served, "secret", "set", "N", "--host", "a.org", *args, stdin=stdin)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert _space(served, "secret", "ls").stdout.splitlines()[1:] == []


def test_negative_the_servers_refusal_is_one_error_line_without_the_value(served: Served) -> None:
    result = _space(served, "secret", "set", "N", "--host", "a.org", "--header", "Host",
                    stdin=VALUE)  # fmt: skip
    assert result.exit_code == 1
    assert result.stderr.startswith("error: invalid_argument: header 'Host' frames the request")
    unknown = _space(served, "create", "--secret", "MISSING")
    assert unknown.exit_code == 1 and "no secret 'MISSING'" in unknown.stderr
    assert VALUE not in result.output


def test_rotate_master_rewraps_under_the_new_key(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with Served(data) as served:
        assert _space(served, "secret", "set", "N", "--host", "a.org", stdin=VALUE).exit_code == 0
    old = (data / "master.key").read_text().strip()
    new = base64.b64encode(bytes(range(32))).decode()
    env = {MASTER_KEY_ENV: f"k2:{new}", OLD_MASTER_KEYS_ENV: old}
    result = CliRunner().invoke(main, ["secret", "rotate-master", "--data-dir", str(data)], env=env)
    assert result.exit_code == 0, result.output
    assert result.stdout == "re-wrapped 1 data keys under master key k2\n"
    again = CliRunner().invoke(main, ["secret", "rotate-master", "--data-dir", str(data)],
                               env={MASTER_KEY_ENV: f"k2:{new}"})  # fmt: skip
    assert again.stdout == "re-wrapped 0 data keys under master key k2\n"


def test_negative_rotate_master_with_a_lost_key_is_one_error_line(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with Served(data) as served:
        assert _space(served, "secret", "set", "N", "--host", "a.org", stdin=VALUE).exit_code == 0
    env = {MASTER_KEY_ENV: base64.b64encode(bytes(32)).decode()}
    result = CliRunner().invoke(main, ["secret", "rotate-master", "--data-dir", str(data)], env=env)
    assert result.exit_code == 1
    assert result.stderr.startswith("error: secret store: secret 'N' of tenant 'acme' is wrapped")
