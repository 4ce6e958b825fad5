"""The ``space`` CLI against the fake API (client commands) and its process plumbing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from space.cli import CliContext, _demo, _lifecycle, _pools, _server, main
from tests.unit.test_sdk_fake_api import API_KEY, FakeApi

COMMANDS = [
    "cp", "create", "demo", "egress", "exec", "fork", "hibernate", "keys", "ls", "node", "pause",
    "pools", "restore", "resume", "rm", "secret", "serve", "snapshot", "template", "timeouts",
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
    fake.scripts["python3 greet.py"] = [
        ("stdout", b"hello in /opt/demo\n"),
        ("exit", 0, None, False),
    ]
    for name, answer in (("pypi.org", b"198.18.0.2\n"), ("example.com", b"refused: gaierror\n")):
        fake.scripts[f"python3 -c {_demo.DEMO_RESOLVE} {name}"] = [
            ("stdout", answer),
            ("exit", 0, None, False),
        ]
    result = _space(fake, "demo")
    assert result.exit_code == 0, result.stderr
    assert "example.com -> refused" in result.stdout
    assert "Python 3.11.2" in result.stdout and " ms" in result.stdout
    assert "build template demo" in result.stdout and "demo:latest" in result.stdout
    assert list(fake.sandboxes) == ["sbx1"]  # the demo's own sandboxes are gone
    assert fake.templates == []  # and so is its template


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


# lifecycle commands (issue 3)


def _snapshot(
    fake: FakeApi, snap_id: str, parent: str | None, minute: int, sandbox_id: str = "sbx1"
) -> None:
    fake.snapshots[snap_id] = {
        "id": snap_id, "name": f"name-{snap_id}", "sandbox_id": sandbox_id, "parent_id": parent,
        "node_id": "local", "created_at": f"2026-11-30T12:{minute:02d}:00+00:00",
        "template": "base", "cpus": 1, "memory_mib": 256, "disk_mib": 2048,
        "memory_bytes": 256 << 20, "exclusive_bytes": None if parent is None else 1536,
    }  # fmt: skip


def _puts_and_posts(fake: FakeApi) -> list[tuple[str, str]]:
    return [(method, path) for method, path, _ in fake.requests if method in ("PUT", "POST")]


def test_hibernate_then_resume_print_each_new_state(fake: FakeApi) -> None:
    hibernated = _space(fake, "hibernate", "sbx1")
    resumed = _space(fake, "resume", "sbx1")
    assert (hibernated.exit_code, hibernated.stdout) == (0, "sbx1  hibernated\n")
    assert (resumed.exit_code, resumed.stdout) == (0, "sbx1  running\n")
    assert fake.sandboxes["sbx1"]["state"] == "running"


def test_negative_hibernate_in_a_state_that_forbids_it_prints_the_conflict(fake: FakeApi) -> None:
    fake.sandboxes["sbx1"]["state"] = "error"
    result = _space(fake, "hibernate", "sbx1")
    assert result.exit_code == 1
    assert result.stderr == "error: conflict: cannot hibernate sandbox sbx1: it is error " \
        "(operation=sandbox.hibernate, sandbox=sbx1, status=409)\n"  # fmt: skip


def test_create_from_snapshot_with_idle_timeout_sends_them_and_no_sizes(fake: FakeApi) -> None:
    _snapshot(fake, "snp1", None, 1)
    result = _space(fake, "create", "--from-snapshot", "snp1", "--idle-timeout", "120")
    body = fake.bodies[-1][2]
    assert result.exit_code == 0, result.stderr
    assert (body["from_snapshot"], body["idle_timeout_s"]) == ("snp1", 120)
    assert not {"template", "cpus", "memory_mib", "disk_mib"} & body.keys()
    assert "from snapshot 'snp1'" in result.stderr
    assert fake.sandboxes[result.stdout.strip()]["head_snapshot"] == "snp1"


@pytest.mark.parametrize(
    "args",
    [
        ("--from-snapshot", "snp1", "--cpus", "2"),
        ("--from-snapshot", "snp1", "--template", "base"),
        ("--idle-timeout", "0"),
        ("--idle-timeout", "soon"),
    ],
)
def test_negative_bad_create_lifecycle_arguments_are_usage_errors_sending_nothing(
    fake: FakeApi, args: tuple[str, ...]
) -> None:
    result = _space(fake, "create", *args)
    assert result.exit_code == 2 and fake.requests == []
    assert list(fake.sandboxes) == ["sbx1"]


def test_snapshot_create_prints_the_id_and_a_taken_name_fails_with_the_message(
    fake: FakeApi,
) -> None:
    first = _space(fake, "snapshot", "create", "sbx1", "clean")
    again = _space(fake, "snapshot", "create", "sbx1", "clean")
    snap_id = first.stdout.strip()
    assert first.exit_code == 0 and list(fake.snapshots) == [snap_id]
    assert "snapshotting sandbox sbx1 as 'clean'" in first.stderr
    assert again.exit_code == 1 and again.stdout == ""
    assert again.stderr.splitlines()[-1].startswith(
        "error: conflict: a snapshot named 'clean' exists"
    )


def test_snapshot_ls_prints_the_forest_as_an_indented_tree(fake: FakeApi) -> None:
    _snapshot(fake, "snpB", None, 5)
    _snapshot(fake, "snpA", None, 1)
    _snapshot(fake, "snpA2", "snpA", 4)
    _snapshot(fake, "snpA1", "snpA", 2)
    _snapshot(fake, "snpA1x", "snpA1", 3)
    _snapshot(fake, "snpO", "deleted-long-ago", 6)  # parent not listed: shown as a root
    result = _space(fake, "snapshot", "ls")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == [
        "ID          NAME         CREATED              MEMORY     EXCLUSIVE",
        "snpA        name-snpA    2026-11-30 12:01:00  256.0 MiB  -",
        "  snpA1     name-snpA1   2026-11-30 12:02:00  256.0 MiB  1.5 KiB",
        "    snpA1x  name-snpA1x  2026-11-30 12:03:00  256.0 MiB  1.5 KiB",
        "  snpA2     name-snpA2   2026-11-30 12:04:00  256.0 MiB  1.5 KiB",
        "snpB        name-snpB    2026-11-30 12:05:00  256.0 MiB  -",
        "snpO        name-snpO    2026-11-30 12:06:00  256.0 MiB  1.5 KiB",
    ]


def test_snapshot_ls_with_sandbox_asks_for_that_sandbox_only(fake: FakeApi) -> None:
    _snapshot(fake, "snpA", None, 1)
    _snapshot(fake, "snpZ", None, 2, sandbox_id="sbx9")
    result = _space(fake, "snapshot", "ls", "--sandbox", "sbx1")
    assert result.exit_code == 0
    assert [line.split()[0] for line in result.stdout.splitlines()] == ["ID", "snpA"]
    assert fake.requests[-1][1] == "/v1/sandboxes/sbx1/snapshots"


def test_negative_snapshot_ls_survives_a_parent_cycle_printing_each_snapshot_once(
    fake: FakeApi,
) -> None:
    _snapshot(fake, "snpA", "snpB", 1)
    _snapshot(fake, "snpB", "snpA", 2)
    _snapshot(fake, "snpC", "snpC", 3)
    result = _space(fake, "snapshot", "ls")
    assert result.exit_code == 0, result.stderr
    assert [line.split()[0] for line in result.stdout.splitlines()[1:]] == ["snpA", "snpB", "snpC"]
    assert result.stdout.splitlines()[2].startswith("  snpB")


def test_snapshot_ls_prints_only_the_header_when_there_are_none(fake: FakeApi) -> None:
    result = _space(fake, "snapshot", "ls")
    assert (result.exit_code, result.stdout.split()) == (
        0, ["ID", "NAME", "CREATED", "MEMORY", "EXCLUSIVE"]
    )  # fmt: skip


def test_snapshot_rm_is_idempotent_and_reparents_the_children(fake: FakeApi) -> None:
    _snapshot(fake, "snpA", None, 1)
    _snapshot(fake, "snpB", "snpA", 2)
    _snapshot(fake, "snpC", "snpB", 3)
    removed = _space(fake, "snapshot", "rm", "snpB")
    again = _space(fake, "snapshot", "rm", "snpB")
    assert (removed.exit_code, removed.stdout, again.exit_code) == (0, "snpB\n", 0)
    assert fake.snapshots["snpC"]["parent_id"] == "snpA" and "snpB" not in fake.snapshots


def test_restore_prints_the_state_and_the_snapshot(fake: FakeApi) -> None:
    _snapshot(fake, "snpA", None, 1)
    result = _space(fake, "restore", "sbx1", "snpA")
    assert (result.exit_code, result.stdout) == (0, "sbx1  running  snpA\n")
    assert fake.bodies[-1][2] == {"snapshot_id": "snpA"}


def test_negative_restore_to_an_unknown_snapshot_fails_with_not_found(fake: FakeApi) -> None:
    result = _space(fake, "restore", "sbx1", "snp404")
    assert result.exit_code == 1 and result.stderr.startswith("error: not_found: ")


def test_fork_prints_one_child_id_per_line(fake: FakeApi) -> None:
    result = _space(fake, "fork", "sbx1", "-n", "3")
    children = result.stdout.split()
    assert result.exit_code == 0, result.stderr
    assert len(children) == 3 and set(fake.sandboxes) == {"sbx1", *children}
    assert fake.bodies[-1][2] == {"count": 3}


@pytest.mark.parametrize("n", ["0", "17", "two"])
def test_negative_fork_count_out_of_range_is_a_usage_error_sending_nothing(
    fake: FakeApi, n: str
) -> None:
    result = _space(fake, "fork", "sbx1", "-n", n)
    assert result.exit_code == 2 and fake.requests == []


def test_timeouts_sends_only_the_options_given_with_none_as_null(fake: FakeApi) -> None:
    changed = _space(fake, "timeouts", "sbx1", "--idle", "60", "--max-lifetime", "none")
    only_idle = _space(fake, "timeouts", "sbx1", "--idle", "None")
    assert (changed.exit_code, changed.stdout) == (
        0,
        "sbx1  idle_timeout_s=60  max_lifetime_s=none\n",
    )
    assert only_idle.stdout == "sbx1  idle_timeout_s=none  max_lifetime_s=none\n"
    assert [body for _, path, body in fake.bodies if path.endswith("/timeouts")] == [
        {"idle_timeout_s": 60, "max_lifetime_s": None},
        {"idle_timeout_s": None},
    ]


def test_timeouts_without_options_only_shows_them(fake: FakeApi) -> None:
    fake.sandboxes["sbx1"].update(idle_timeout_s=300, max_lifetime_s=3600)
    result = _space(fake, "timeouts", "sbx1")
    assert (result.exit_code, result.stdout) == (
        0,
        "sbx1  idle_timeout_s=300  max_lifetime_s=3600\n",
    )
    assert _puts_and_posts(fake) == []


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "soon", "²", ""])
def test_negative_timeouts_with_a_bad_value_is_a_usage_error_sending_nothing(
    fake: FakeApi, value: str
) -> None:
    result = _space(fake, "timeouts", "sbx1", "--idle", value)
    assert result.exit_code == 2 and fake.requests == []
    assert "whole seconds" in result.stderr


@pytest.mark.parametrize(
    ("n_bytes", "shown"),
    [
        (None, "-"), (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (3 << 29, "1.5 GiB"),
        (1 << 50, "1024.0 TiB"),
    ],
)  # fmt: skip
def test_sizes_are_printed_in_binary_units(n_bytes: int | None, shown: str) -> None:
    assert _lifecycle._size(n_bytes) == shown


def _pool(node_id: str, template: str, hits: int, misses: int) -> dict[str, object]:
    rate = hits / (hits + misses) if hits + misses else None
    return {
        "node_id": node_id, "template": template, "size": 2, "target": 3, "min_size": 0,
        "max_size": 12, "hits": hits, "misses": misses, "hit_rate": rate,
    }  # fmt: skip


def test_pools_prints_one_row_per_pool_with_the_hit_rate_as_a_percentage(fake: FakeApi) -> None:
    fake.pools = [_pool("node-a", "base", 2, 1), _pool("node-b", "python", 0, 0)]
    result = _space(fake, "pools")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == [
        "NODE    TEMPLATE  SIZE/TARGET  MIN..MAX  HITS  MISSES  HIT_RATE",
        "node-a  base      2/3          0..12     2     1       66.7%",
        "node-b  python    2/3          0..12     0     0       -",
    ]
    assert fake.requests[-1][:2] == ("GET", "/v1/pools")


def test_pools_prints_only_the_header_when_there_are_none(fake: FakeApi) -> None:
    result = _space(fake, "pools")
    assert (result.exit_code, result.stdout.split()) == (
        0, ["NODE", "TEMPLATE", "SIZE/TARGET", "MIN..MAX", "HITS", "MISSES", "HIT_RATE"]
    )  # fmt: skip


def test_negative_pools_with_a_malformed_answer_prints_one_error_line(fake: FakeApi) -> None:
    fake.pools = [_pool("node-a", "base", 2, 1) | {"hits": "two"}]
    result = _space(fake, "pools")
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr.startswith("error: internal: malformed pool")
    assert len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    ("rate", "shown"), [(None, "-"), (0.0, "0.0%"), (1.0, "100.0%"), (0.12345, "12.3%")]
)
def test_hit_rates_are_printed_as_percentages(rate: float | None, shown: str) -> None:
    assert _pools.hit_rate(rate) == shown
