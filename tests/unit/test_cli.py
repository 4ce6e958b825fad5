"""The ``space`` CLI against the real API over a FakeNode (client commands) and its
process plumbing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner, Result

from space.cli import CliContext, _demo, _lifecycle, _pools, _server, main
from space.control.template_names import tenant_prefix
from space.node.api import PoolInfo, SandboxState
from space.sdk import Sandbox
from tests.unit._live_api import API_URL, TENANT, LiveApi

COMMANDS = [
    "control", "cp", "create", "demo", "egress", "exec", "fork", "hibernate", "keys", "ls",
    "metrics",
    "node", "pause", "pools", "ports", "quota", "restore", "resume", "rm", "secret", "serve",
    "snapshot",
    "template", "timeouts",
]  # fmt: skip


@pytest.fixture
def fake(sync_api: LiveApi) -> LiveApi:
    """The real API over a FakeNode with one running sandbox (``sid``), nothing recorded."""
    Sandbox.create(**sync_api.connection()).close()
    sync_api.requests.clear()
    sync_api.bodies.clear()
    return sync_api


@pytest.fixture
def sid(fake: LiveApi) -> str:
    """The id of ``fake``'s sandbox."""
    (first,) = fake.node.boxes
    return first


def _space(fake: LiveApi, *args: str, stdin: bytes | None = None, key: str | None = None) -> Result:
    return _space_on(fake.transport(), *args, stdin=stdin, key=key or fake.key)


def _space_on(
    transport: httpx.AsyncBaseTransport, *args: str, stdin: bytes | None = None, key: str
) -> Result:
    return CliRunner().invoke(
        main,
        [*args],
        obj=CliContext(transport=transport),
        env={"SPACE_API_KEY": key, "SPACE_API_URL": API_URL},
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


def test_exec_streams_output_and_exits_with_the_remote_exit_code(fake: LiveApi, sid: str) -> None:
    fake.scripts["make test"] = [
        ("stdout", b"ok 1\n"),
        ("stderr", b"warning\n"),
        ("exit", 7, None, False),
    ]
    result = _space(fake, "exec", sid, "--", "make", "test")
    assert (result.exit_code, result.stdout, result.stderr) == (7, "ok 1\n", "warning\n")
    assert fake.exec_bodies[0]["argv"] == ["make", "test"]


def test_exec_of_one_word_runs_it_through_the_shell_with_env_and_stdin(
    fake: LiveApi, sid: str
) -> None:
    fake.scripts["cat | wc -c"] = [("stdout", b"5\n"), ("exit", 0, None, False)]
    result = _space(fake, "exec", sid, "-i", "-e", "A=b", "--", "cat | wc -c", stdin=b"hello")
    assert (result.exit_code, result.stdout) == (0, "5\n")
    body = fake.exec_bodies[0]
    # -i streams stdin (issue 20): stdin stays open for pieces, none is sent up front.
    assert (body["cmd"], body["env"], body["open_stdin"]) == ("cat | wc -c", {"A": "b"}, True)
    assert "stdin" not in body


@pytest.mark.parametrize(
    ("exit_event", "status"),
    [
        (("exit", None, 9, False), 137),
        (("exit", None, 9, True), 124),
        (("exit", 0, None, False), 0),
    ],
)
def test_exec_maps_signals_to_128_plus_n_and_timeouts_to_124(
    fake: LiveApi, sid: str, exit_event: tuple[object, ...], status: int
) -> None:
    fake.scripts["sleep 100"] = [exit_event]
    assert _space(fake, "exec", sid, "--", "sleep 100").exit_code == status


def test_negative_exec_in_an_unknown_sandbox_prints_one_error_line_and_exits_1(
    fake: LiveApi,
) -> None:
    result = _space(fake, "exec", "ghost", "--", "true")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: not_found: ")
    assert "ghost" in result.stderr and "Traceback" not in result.stderr


def test_negative_a_wrong_key_is_reported_as_unauthenticated(fake: LiveApi) -> None:
    result = _space(fake, "ls", "--api-key", "wrong")
    assert result.exit_code == 1 and result.stderr.startswith("error: unauthenticated: ")


def test_create_prints_the_id_and_ls_shows_it(fake: LiveApi, sid: str) -> None:
    created = _space(fake, "create", "--cpus", "2", "--timeout-s", "0")
    listed = _space(fake, "ls")
    new_id = created.stdout.strip()
    assert created.exit_code == 0 and new_id in fake.node.boxes
    assert fake.node.boxes[new_id].status.cpus == 2
    assert "creating a sandbox" in created.stderr  # progress goes to stderr
    assert listed.stdout.splitlines()[0].split() == [
        "ID", "TEMPLATE", "STATE", "CPUS", "MEMORY_MIB", "CREATED", "EXPIRES",
    ]  # fmt: skip
    assert {line.split()[0] for line in listed.stdout.splitlines()[1:]} == {sid, new_id}


def test_rm_deletes_each_sandbox_and_fails_on_an_unknown_one(fake: LiveApi, sid: str) -> None:
    removed = _space(fake, "rm", sid)
    missing = _space(fake, "rm", sid)
    assert (removed.exit_code, removed.stdout, fake.node.boxes) == (0, f"{sid}\n", {})
    assert missing.exit_code == 1 and missing.stderr.startswith("error: not_found")


def test_cp_copies_into_and_out_of_a_sandbox(fake: LiveApi, sid: str, tmp_path: Path) -> None:
    local = tmp_path / "in.bin"
    local.write_bytes(os.urandom(50_000))
    up = _space(fake, "cp", str(local), f"{sid}:/home/user/")
    down = _space(fake, "cp", f"{sid}:/home/user/in.bin", str(tmp_path / "out.bin"))
    assert (up.exit_code, down.exit_code) == (0, 0)
    assert fake.node.boxes[sid].files["/home/user/in.bin"] == local.read_bytes()
    assert (tmp_path / "out.bin").read_bytes() == local.read_bytes()


def test_negative_cp_between_two_local_paths_is_a_usage_error(fake: LiveApi) -> None:
    result = _space(fake, "cp", "a", "b")
    assert result.exit_code == 2 and result.stderr.startswith("error: exactly one")


def test_demo_runs_the_session_and_deletes_its_sandbox(fake: LiveApi, sid: str) -> None:
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
    assert list(fake.node.boxes) == [sid]  # the demo's own sandboxes are gone
    assert list(fake.node.templates) == [("base", "latest")]  # and so is its template


def test_negative_demo_failure_still_deletes_the_sandbox(fake: LiveApi, sid: str) -> None:
    fake.scripts["python3 -c " + _demo.DEMO_CODE] = [("exit", 127, None, False)]
    result = _space(fake, "demo")
    assert result.exit_code == 1 and "command_exit" in result.stderr
    assert list(fake.node.boxes) == [sid]


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
    snap_id: str, parent: str | None, minute: int, sandbox_id: str = "sbx1"
) -> dict[str, object]:
    """A Snapshot object as the API answers it, with the times and sizes given."""
    return {
        "id": snap_id, "name": f"name-{snap_id}", "sandbox_id": sandbox_id, "parent_id": parent,
        "node_id": "local", "created_at": f"2026-11-30T12:{minute:02d}:00+00:00",
        "template": "base", "cpus": 1, "memory_mib": 256, "disk_mib": 2048,
        "memory_bytes": 256 << 20, "exclusive_bytes": None if parent is None else 1536,
    }  # fmt: skip


def _listing(snapshots: list[dict[str, object]], paths: list[str]) -> httpx.MockTransport:
    """A tiny API answering every snapshot listing with ``snapshots`` (of its sandbox, on
    ``/v1/sandboxes/{id}/snapshots``), recording each path. The snapshot tree printer is
    tested on forests the real API cannot make (fixed times, cycles, lost parents)."""

    def answer(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        paths.append(path)
        wanted = [s for s in snapshots if path in ("/v1/snapshots", _of(s["sandbox_id"]))]
        return httpx.Response(200, json={"snapshots": wanted})

    return httpx.MockTransport(answer)


def _of(sandbox_id: object) -> str:
    return f"/v1/sandboxes/{sandbox_id}/snapshots"


def _take(fake: LiveApi, sid: str, name: str) -> str:
    """The id of a new snapshot of ``sid`` named ``name``, taken with the CLI."""
    taken = _space(fake, "snapshot", "create", sid, name)
    assert taken.exit_code == 0, taken.stderr
    return taken.stdout.strip()


def _puts_and_posts(fake: LiveApi) -> list[tuple[str, str]]:
    return [(method, path) for method, path, _ in fake.requests if method in ("PUT", "POST")]


def test_hibernate_then_resume_print_each_new_state(fake: LiveApi, sid: str) -> None:
    hibernated = _space(fake, "hibernate", sid)
    resumed = _space(fake, "resume", sid)
    assert (hibernated.exit_code, hibernated.stdout) == (0, f"{sid}  hibernated\n")
    assert (resumed.exit_code, resumed.stdout) == (0, f"{sid}  running\n")
    assert fake.node.boxes[sid].status.state == SandboxState.RUNNING


def test_negative_hibernate_in_a_state_that_forbids_it_prints_the_conflict(
    fake: LiveApi, sid: str
) -> None:
    fake.run_sync(fake.set_node_state(sid, SandboxState.ERROR))
    result = _space(fake, "hibernate", sid)
    assert result.exit_code == 1
    assert result.stderr == f"error: conflict: cannot hibernate sandbox {sid}: it is error " \
        f"(operation=sandbox.hibernate, sandbox={sid}, status=409)\n"  # fmt: skip


def test_create_from_snapshot_with_idle_timeout_sends_them_and_no_sizes(
    fake: LiveApi, sid: str
) -> None:
    snap = _take(fake, sid, "clean")
    result = _space(fake, "create", "--from-snapshot", snap, "--idle-timeout", "120")
    body = fake.bodies[-1][2]
    assert result.exit_code == 0, result.stderr
    assert (body["from_snapshot"], body["idle_timeout_s"]) == (snap, 120)
    assert not {"template", "cpus", "memory_mib", "disk_mib"} & body.keys()
    assert f"from snapshot {snap!r}" in result.stderr
    assert fake.node.boxes[result.stdout.strip()].status.head_snapshot == snap


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
    fake: LiveApi, sid: str, args: tuple[str, ...]
) -> None:
    result = _space(fake, "create", *args)
    assert result.exit_code == 2 and fake.requests == []
    assert list(fake.node.boxes) == [sid]


def test_snapshot_create_prints_the_id_and_a_taken_name_fails_with_the_message(
    fake: LiveApi,
    sid: str,
) -> None:
    first = _space(fake, "snapshot", "create", sid, "clean")
    again = _space(fake, "snapshot", "create", sid, "clean")
    snap_id = first.stdout.strip()
    assert first.exit_code == 0 and list(fake.node.snapshots) == [snap_id]
    assert f"snapshotting sandbox {sid} as 'clean'" in first.stderr
    assert again.exit_code == 1 and again.stdout == ""
    assert again.stderr.splitlines()[-1].startswith(
        f"error: conflict: sandbox {sid} already has a snapshot named 'clean'"
    )


def test_snapshot_ls_prints_the_forest_as_an_indented_tree() -> None:
    forest = [
        _snapshot("snpB", None, 5),
        _snapshot("snpA", None, 1),
        _snapshot("snpA2", "snpA", 4),
        _snapshot("snpA1", "snpA", 2),
        _snapshot("snpA1x", "snpA1", 3),
        _snapshot("snpO", "deleted-long-ago", 6),  # parent not listed: shown as a root
    ]
    result = _space_on(_listing(forest, []), "snapshot", "ls", key="sk-test")
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


def test_snapshot_ls_with_sandbox_asks_for_that_sandbox_only(fake: LiveApi, sid: str) -> None:
    mine = _take(fake, sid, "a")
    other = Sandbox.create(**fake.connection())
    other.snapshot("z")
    other.close()
    result = _space(fake, "snapshot", "ls", "--sandbox", sid)
    assert result.exit_code == 0
    assert [line.split()[0] for line in result.stdout.splitlines()] == ["ID", mine]
    assert fake.requests[-1][1] == f"/v1/sandboxes/{sid}/snapshots"


def test_negative_snapshot_ls_survives_a_parent_cycle_printing_each_snapshot_once() -> None:
    cycles = [
        _snapshot("snpA", "snpB", 1),
        _snapshot("snpB", "snpA", 2),
        _snapshot("snpC", "snpC", 3),
    ]
    result = _space_on(_listing(cycles, []), "snapshot", "ls", key="sk-test")
    assert result.exit_code == 0, result.stderr
    assert [line.split()[0] for line in result.stdout.splitlines()[1:]] == ["snpA", "snpB", "snpC"]
    assert result.stdout.splitlines()[2].startswith("  snpB")


def test_snapshot_ls_prints_only_the_header_when_there_are_none(fake: LiveApi) -> None:
    result = _space(fake, "snapshot", "ls")
    assert (result.exit_code, result.stdout.split()) == (
        0, ["ID", "NAME", "CREATED", "MEMORY", "EXCLUSIVE"]
    )  # fmt: skip


def test_snapshot_rm_is_idempotent_and_reparents_the_children(fake: LiveApi, sid: str) -> None:
    a, b, c = (_take(fake, sid, name) for name in "abc")
    removed = _space(fake, "snapshot", "rm", b)
    again = _space(fake, "snapshot", "rm", b)
    assert (removed.exit_code, removed.stdout, again.exit_code) == (0, f"{b}\n", 0)
    listed = {s.snapshot_id: s.parent_id for s in Sandbox.list_snapshots(**fake.connection())}
    assert listed == {a: None, c: a}


def test_restore_prints_the_state_and_the_snapshot(fake: LiveApi, sid: str) -> None:
    snap = _take(fake, sid, "a")
    result = _space(fake, "restore", sid, snap)
    assert (result.exit_code, result.stdout) == (0, f"{sid}  running  {snap}\n")
    assert fake.bodies[-1][2] == {"snapshot_id": snap}


def test_negative_restore_to_an_unknown_snapshot_fails_with_not_found(
    fake: LiveApi, sid: str
) -> None:
    result = _space(fake, "restore", sid, "snp404")
    assert result.exit_code == 1 and result.stderr.startswith("error: not_found: ")


def test_fork_prints_one_child_id_per_line(fake: LiveApi, sid: str) -> None:
    result = _space(fake, "fork", sid, "-n", "3")
    children = result.stdout.split()
    assert result.exit_code == 0, result.stderr
    assert len(children) == 3 and set(fake.node.boxes) == {sid, *children}
    assert fake.bodies[-1][2] == {"count": 3}


@pytest.mark.parametrize("n", ["0", "17", "two"])
def test_negative_fork_count_out_of_range_is_a_usage_error_sending_nothing(
    fake: LiveApi, sid: str, n: str
) -> None:
    result = _space(fake, "fork", sid, "-n", n)
    assert result.exit_code == 2 and fake.requests == []


def test_timeouts_sends_only_the_options_given_with_none_as_null(fake: LiveApi, sid: str) -> None:
    changed = _space(fake, "timeouts", sid, "--idle", "60", "--max-lifetime", "none")
    only_idle = _space(fake, "timeouts", sid, "--idle", "None")
    assert (changed.exit_code, changed.stdout) == (
        0,
        f"{sid}  idle_timeout_s=60  max_lifetime_s=none\n",
    )
    assert only_idle.stdout == f"{sid}  idle_timeout_s=none  max_lifetime_s=none\n"
    assert [body for _, path, body in fake.bodies if path.endswith("/timeouts")] == [
        {"idle_timeout_s": 60, "max_lifetime_s": None},
        {"idle_timeout_s": None},
    ]


def test_timeouts_without_options_only_shows_them(fake: LiveApi, sid: str) -> None:
    sandbox = Sandbox.connect(sid, **fake.connection())
    sandbox.set_timeouts(idle_timeout_s=300, max_lifetime_s=3600)
    sandbox.close()
    fake.requests.clear()
    result = _space(fake, "timeouts", sid)
    assert (result.exit_code, result.stdout) == (
        0,
        f"{sid}  idle_timeout_s=300  max_lifetime_s=3600\n",
    )
    assert _puts_and_posts(fake) == []


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "soon", "²", ""])
def test_negative_timeouts_with_a_bad_value_is_a_usage_error_sending_nothing(
    fake: LiveApi, sid: str, value: str
) -> None:
    result = _space(fake, "timeouts", sid, "--idle", value)
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


def test_pools_prints_one_row_per_pool_with_the_hit_rate_as_a_percentage(fake: LiveApi) -> None:
    fake.node.pools = [
        PoolInfo("base", 2, 3, 0, 12, hits=2, misses=1),
        PoolInfo(f"{tenant_prefix(TENANT)}python", 2, 3, 0, 12, hits=0, misses=0),
    ]
    result = _space(fake, "pools")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == [
        "NODE   TEMPLATE  SIZE/TARGET  MIN..MAX  HITS  MISSES  HIT_RATE",
        "local  base      2/3          0..12     2     1       66.7%",
        "local  python    2/3          0..12     0     0       -",
    ]
    assert fake.requests[-1][:2] == ("GET", "/v1/pools")


def test_pools_prints_only_the_header_when_there_are_none(fake: LiveApi) -> None:
    result = _space(fake, "pools")
    assert (result.exit_code, result.stdout.split()) == (
        0, ["NODE", "TEMPLATE", "SIZE/TARGET", "MIN..MAX", "HITS", "MISSES", "HIT_RATE"]
    )  # fmt: skip


def test_negative_pools_with_a_malformed_answer_prints_one_error_line() -> None:
    # The real API cannot answer this: a tiny handler plays a broken server.
    body = {"pools": [_pool("node-a", "base", 2, 1) | {"hits": "two"}]}
    transport = httpx.MockTransport(lambda _request: httpx.Response(200, json=body))
    result = _space_on(transport, "pools", key="sk-test")
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr.startswith("error: internal: malformed pool")
    assert len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    ("rate", "shown"), [(None, "-"), (0.0, "0.0%"), (1.0, "100.0%"), (0.12345, "12.3%")]
)
def test_hit_rates_are_printed_as_percentages(rate: float | None, shown: str) -> None:
    assert _pools.hit_rate(rate) == shown


def test_the_node_api_listens_on_loopback_unless_told_otherwise() -> None:
    # Issue 18: a node agent reachable from the network only when the operator says so.
    (listen,) = [p for p in _server.node.params if p.name == "listen"]
    assert listen.default == "127.0.0.1:8081"


# the cluster's node options (issue 19)


def _cluster(**given: object) -> dict[str, object]:
    from space.cli._cluster import cluster_settings

    options: dict[str, object] = {
        "key_file": None,
        "peer_ca_file": None,
        "artifact_key_file": None,
        "artifact_store": None,
        "artifact_s3_endpoint": None,
        "artifact_s3_region": "us-east-1",
        "artifact_s3_credentials_file": None,
    }
    return cluster_settings(options | given)


def test_the_artifact_store_url_names_a_directory_or_a_bucket(tmp_path: Path) -> None:
    from space.node.core.config import ArtifactStoreConfig

    fs = _cluster(artifact_store=f"file://{tmp_path}", key_file=tmp_path / "k")
    assert fs["artifact_store"] == ArtifactStoreConfig(kind="fs", path=tmp_path)
    assert fs["key_file"] == tmp_path / "k"
    s3 = _cluster(artifact_store="s3://my-bucket", artifact_s3_endpoint="http://10.0.0.5:9000")
    assert s3["artifact_store"] == ArtifactStoreConfig(
        kind="s3", s3_bucket="my-bucket", s3_endpoint_url="http://10.0.0.5:9000"
    )
    assert "artifact_store" not in _cluster()


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"artifact_store": "ftp://host/dir"}, "file:///absolute/dir or s3://bucket"),
        ({"artifact_store": "file://host/dir"}, "file:///absolute/dir or s3://bucket"),
        ({"artifact_store": "s3://bucket/prefix"}, "file:///absolute/dir or s3://bucket"),
        ({"artifact_store": "s3://Not_A_Bucket"}, "needs a bucket name"),
        ({"artifact_store": "file:///d", "artifact_s3_endpoint": "http://x"}, "file:///"),
        ({"artifact_s3_endpoint": "http://x"}, "need --artifact-store s3://"),
        ({"artifact_store": "s3://b-1", "artifact_s3_endpoint": "ftp://x"}, "s3_endpoint_url"),
    ],
)
def test_negative_a_bad_artifact_store_option_is_a_usage_error(
    given: dict[str, object], said: str
) -> None:
    import click

    with pytest.raises(click.BadParameter, match=said.replace("?", r"\?")):
        _cluster(**given)
    result = CliRunner().invoke(
        main,
        ["node", "--control-url", "http://x:1", "--token-file", "/dev/null"]
        + [f"--{k.replace('_', '-')}={v}" for k, v in given.items()],
    )
    assert result.exit_code == 2 and said.split(" ")[0] in result.output
