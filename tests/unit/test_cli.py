"""The ``space`` CLI against the fake API (client commands) and its process plumbing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from space.cli import CliContext, _demo, _server, main
from tests.unit.test_sdk_fake_api import API_KEY, FakeApi

COMMANDS = [
    "cp", "create", "demo", "exec", "keys", "ls", "node", "pause", "resume", "rm", "serve",
    "template",
]  # fmt: skip


@pytest.fixture
def fake() -> FakeApi:
    fake = FakeApi()
    fake.sandboxes["sbx1"] = {
        "id": "sbx1", "template": "base", "state": "running", "cpus": 1, "memory_mib": 256,
        "disk_mib": 2048, "env": {}, "metadata": {}, "created_at": "2026-11-30T12:00:00Z",
        "expires_at": None, "node_id": "local",
    }  # fmt: skip
    return fake


def _space(fake: FakeApi, *args: str, stdin: bytes | None = None) -> Result:
    return CliRunner().invoke(
        main,
        [*args],
        obj=CliContext(transport=fake.transport()),
        env={"SPACE_API_KEY": API_KEY, "SPACE_API_URL": "http://space"},
        input=stdin,
    )


def test_help_lists_every_command() -> None:
    result = CliRunner().invoke(main, ["--help"])
    listed = [line.split()[0] for line in result.output.split("Commands:")[1].splitlines() if line]
    assert result.exit_code == 0
    assert listed == COMMANDS


def test_help_does_not_import_the_node_or_control_plane() -> None:
    code = "import sys; from space.cli import main; print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('space.')}))"  # noqa: E501
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "node" not in done.stdout and "control" not in done.stdout


def test_exec_streams_output_and_exits_with_the_remote_exit_code(fake: FakeApi) -> None:
    fake.scripts["make test"] = [
        ("stdout", b"ok 1\n"),
        ("stderr", b"warning\n"),
        ("exit", 7, None, False),
    ]
    result = _space(fake, "exec", "sbx1", "--", "make", "test")
    assert (result.exit_code, result.stdout, result.stderr) == (7, "ok 1\n", "warning\n")
    assert fake.exec_bodies[0]["argv"] == ["make", "test"]


def test_exec_of_one_word_runs_it_through_the_shell_with_env_and_stdin(fake: FakeApi) -> None:
    fake.scripts["cat | wc -c"] = [("stdout", b"5\n"), ("exit", 0, None, False)]
    result = _space(fake, "exec", "sbx1", "-i", "-e", "A=b", "--", "cat | wc -c", stdin=b"hello")
    assert (result.exit_code, result.stdout) == (0, "5\n")
    body = fake.exec_bodies[0]
    assert (body["cmd"], body["env"], body["stdin"]) == ("cat | wc -c", {"A": "b"}, "hello")


@pytest.mark.parametrize(
    ("exit_event", "status"),
    [
        (("exit", None, 9, False), 137),
        (("exit", None, 9, True), 124),
        (("exit", 0, None, False), 0),
    ],
)
def test_exec_maps_signals_to_128_plus_n_and_timeouts_to_124(
    fake: FakeApi, exit_event: tuple[object, ...], status: int
) -> None:
    fake.scripts["sleep 100"] = [exit_event]
    assert _space(fake, "exec", "sbx1", "--", "sleep 100").exit_code == status


def test_negative_exec_in_an_unknown_sandbox_prints_one_error_line_and_exits_1(
    fake: FakeApi,
) -> None:
    result = _space(fake, "exec", "ghost", "--", "true")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: not_found: ")
    assert "ghost" in result.stderr and "Traceback" not in result.stderr


def test_negative_a_wrong_key_is_reported_as_unauthenticated(fake: FakeApi) -> None:
    result = _space(fake, "ls", "--api-key", "wrong")
    assert result.exit_code == 1 and result.stderr.startswith("error: unauthenticated: ")


def test_create_prints_the_id_and_ls_shows_it(fake: FakeApi) -> None:
    created = _space(fake, "create", "--cpus", "2", "--timeout-s", "0")
    listed = _space(fake, "ls")
    new_id = created.stdout.strip()
    assert created.exit_code == 0 and new_id in fake.sandboxes
    assert fake.sandboxes[new_id]["cpus"] == 2
    assert "creating a sandbox" in created.stderr  # progress goes to stderr
    assert listed.stdout.splitlines()[0].split() == [
        "ID", "TEMPLATE", "STATE", "CPUS", "MEMORY_MIB", "CREATED", "EXPIRES",
    ]  # fmt: skip
    assert {line.split()[0] for line in listed.stdout.splitlines()[1:]} == {"sbx1", new_id}


def test_rm_deletes_each_sandbox_and_fails_on_an_unknown_one(fake: FakeApi) -> None:
    removed = _space(fake, "rm", "sbx1")
    missing = _space(fake, "rm", "sbx1")
    assert (removed.exit_code, removed.stdout, fake.sandboxes) == (0, "sbx1\n", {})
    assert missing.exit_code == 1 and missing.stderr.startswith("error: not_found")


def test_cp_copies_into_and_out_of_a_sandbox(fake: FakeApi, tmp_path: Path) -> None:
    local = tmp_path / "in.bin"
    local.write_bytes(os.urandom(50_000))
    up = _space(fake, "cp", str(local), "sbx1:/home/user/")
    down = _space(fake, "cp", "sbx1:/home/user/in.bin", str(tmp_path / "out.bin"))
    assert (up.exit_code, down.exit_code) == (0, 0)
    assert fake.files[("sbx1", "/home/user/in.bin")] == local.read_bytes()
    assert (tmp_path / "out.bin").read_bytes() == local.read_bytes()


def test_negative_cp_between_two_local_paths_is_a_usage_error(fake: FakeApi) -> None:
    result = _space(fake, "cp", "a", "b")
    assert result.exit_code == 2 and result.stderr.startswith("error: exactly one")


def test_demo_runs_the_session_and_deletes_its_sandbox(fake: FakeApi) -> None:
    fake.scripts["python3 -c " + _demo.DEMO_CODE] = [
        ("stdout", b"3.11.2\n"),
        ("exit", 0, None, False),
    ]
    result = _space(fake, "demo")
    assert result.exit_code == 0, result.stderr
    assert "Python 3.11.2" in result.stdout and " ms" in result.stdout
    assert list(fake.sandboxes) == ["sbx1"]  # the demo's own sandbox is gone


def test_negative_demo_failure_still_deletes_the_sandbox(fake: FakeApi) -> None:
    result = _space(fake, "demo")  # no script for python3: exits 127
    assert result.exit_code == 1 and "command_exit" in result.stderr
    assert list(fake.sandboxes) == ["sbx1"]


def test_server_stop_kills_a_server_that_ignores_sigterm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_demo, "STOP_GRACE_S", 0.3)
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"  # noqa: E501
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) as server:
        try:
            assert server.stdout is not None and server.stdout.readline() == b"up\n"
            _demo._stop(server)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
    assert server.returncode == -signal.SIGKILL


def test_sigterm_stops_a_server_coroutine_after_its_finally_blocks_ran() -> None:
    cleaned: list[str] = []

    async def serving() -> None:
        import asyncio

        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0)
            cleaned.append("node closed")

    _server._run_until_signal(serving())
    assert cleaned == ["node closed"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
