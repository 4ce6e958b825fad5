"""End to end through every layer: SDK -> REST -> control plane -> node -> QEMU -> spaced.

One `space serve` per module, real VMs under QEMU, a real btrfs pool on a loop file.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from space import Sandbox
from space.sdk import InvalidArgument, NotFound

from .platform import SPACE, Platform, qemu_pids, running_platform

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("space-e2e")) as p:
        yield p


@pytest.fixture(scope="module")
def key(platform: Platform) -> str:
    return platform.create_key("tenant-a")


@pytest.fixture(scope="module")
def sbx(platform: Platform, key: str) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(api_url=platform.url, api_key=key, memory_mib=256)
    yield sandbox
    sandbox.kill()


def test_exec_returns_stdout_stderr_and_exit_code(sbx: Sandbox) -> None:
    result = sbx.commands.run("echo one; echo two >&2; echo three; exit 3")
    assert result.stdout == "one\nthree\n"
    assert result.stderr == "two\n"
    assert result.exit_code == 3


def test_exec_streams_chunks_in_order_to_callbacks(sbx: Sandbox) -> None:
    seen: list[str] = []
    code = "import sys,time\nfor i in range(5):\n    print(i, flush=True); time.sleep(0.05)"
    result = sbx.commands.run(["python3", "-c", code], on_stdout=seen.append)
    assert "".join(seen) == "0\n1\n2\n3\n4\n"
    assert result.exit_code == 0


def test_exec_passes_stdin_env_and_cwd(sbx: Sandbox) -> None:
    result = sbx.commands.run(
        "cat; echo $GREETING; pwd", stdin="from stdin\n", env={"GREETING": "hej"}, cwd="/tmp"
    )
    assert result.stdout == "from stdin\nhej\n/tmp\n"


def test_exec_reports_a_signal_and_a_timeout(sbx: Sandbox) -> None:
    killed = sbx.commands.run("kill -9 $$")
    assert killed.signal == 9
    slow = sbx.commands.run(["sleep", "30"], timeout_s=1)
    assert slow.timed_out


def test_ten_concurrent_execs_each_get_their_own_output(sbx: Sandbox) -> None:
    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(lambda i: sbx.commands.run(f"sleep 0.2; echo {i}"), range(10)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(10)]


def test_background_process_is_listed_reattached_and_killed(sbx: Sandbox) -> None:
    handle = sbx.commands.run("echo started; touch /tmp/bg; sleep 600", background=True)
    deadline = time.monotonic() + 30
    while not sbx.files.exists("/tmp/bg") and time.monotonic() < deadline:
        time.sleep(0.05)
    listed = {p.process_id: p for p in sbx.commands.list()}
    assert listed[handle.process_id].running
    sbx.commands.kill(handle.process_id)
    result = handle.wait()
    assert "started" in result.stdout
    assert result.signal == 9


def test_files_round_trip_names_with_spaces_and_unicode(sbx: Sandbox) -> None:
    path = "/home/user/dir with space/naïve ☃.txt"
    sbx.files.write(path, "snowman ☃\n")
    assert sbx.files.read(path) == "snowman ☃\n"
    names = [e.name for e in sbx.files.list("/home/user/dir with space")]
    assert names == ["naïve ☃.txt"]
    sbx.files.rename(path, "/home/user/dir with space/moved.txt")
    assert sbx.files.stat("/home/user/dir with space/moved.txt").size == len("snowman ☃\n".encode())
    sbx.files.remove("/home/user/dir with space", recursive=True)
    assert not sbx.files.exists("/home/user/dir with space")


def test_a_100_mib_file_round_trips_with_a_matching_hash(sbx: Sandbox, tmp_path: Path) -> None:
    source = tmp_path / "big.bin"
    with source.open("wb") as f:
        for _ in range(100):
            f.write(os.urandom(1024 * 1024))
    sbx.files.upload_from(str(source), "/home/user/big.bin")
    inside = sbx.commands.run("sha256sum /home/user/big.bin").stdout.split()[0]
    expected = hashlib.sha256(source.read_bytes()).hexdigest()
    assert inside == expected
    back = tmp_path / "back.bin"
    sbx.files.download_to("/home/user/big.bin", str(back))
    assert hashlib.sha256(back.read_bytes()).hexdigest() == expected
    sbx.files.remove("/home/user/big.bin")


def test_negative_unknown_sandbox_and_bad_input_get_clear_errors(
    platform: Platform, key: str, sbx: Sandbox
) -> None:
    with pytest.raises(NotFound):
        Sandbox.connect("sbx-does-not-exist", api_url=platform.url, api_key=key)
    with pytest.raises(InvalidArgument) as info:
        Sandbox.create(api_url=platform.url, api_key=key, cpus=0)
    assert "cpus" in str(info.value)
    with pytest.raises(NotFound):
        sbx.files.read("/no/such/file")


def test_negative_another_tenant_sees_404_on_every_sandbox_call(
    platform: Platform, sbx: Sandbox
) -> None:
    other = {"Authorization": f"Bearer {platform.create_key('tenant-b')}"}
    base = f"{platform.url}/v1/sandboxes/{sbx.sandbox_id}"
    calls: list[tuple[str, str, dict[str, Any]]] = [
        ("GET", base, {}),
        ("POST", f"{base}/exec", {"json": {"cmd": "true"}}),
        ("GET", f"{base}/processes", {}),
        ("GET", f"{base}/files", {"params": {"path": "/etc/hostname"}}),
        ("PUT", f"{base}/files", {"params": {"path": "/tmp/x"}, "content": b"x"}),
        ("GET", f"{base}/files/list", {"params": {"path": "/"}}),
        ("GET", f"{base}/files/stat", {"params": {"path": "/"}}),
        ("DELETE", f"{base}/files", {"params": {"path": "/tmp"}}),
        ("DELETE", base, {}),
    ]
    for method, url, kwargs in calls:
        response = httpx.request(method, url, headers=other, timeout=30, **kwargs)
        assert response.status_code == 404, (method, url, response.text)
        assert response.json()["error"]["code"] == "not_found"
    assert sbx.commands.run("true").exit_code == 0


def test_delete_leaves_no_vm_behind(platform: Platform, key: str) -> None:
    before = set(qemu_pids(platform.data_dir))
    sandbox = Sandbox.create(api_url=platform.url, api_key=key)
    assert sandbox.commands.run("true").exit_code == 0
    assert len(set(qemu_pids(platform.data_dir)) - before) == 1
    sandbox.kill()
    assert set(qemu_pids(platform.data_dir)) == before
    assert not (platform.data_dir / "pool" / "sandboxes" / sandbox.sandbox_id).exists()
    with pytest.raises(NotFound):
        Sandbox.connect(sandbox.sandbox_id, api_url=platform.url, api_key=key)


def test_a_killed_server_readopts_its_running_sandbox(platform: Platform, key: str) -> None:
    sandbox = Sandbox.create(api_url=platform.url, api_key=key)
    sandbox.files.write("/home/user/kept.txt", "kept")
    handle = sandbox.commands.run("sleep 600", background=True)
    platform.stop(signal.SIGKILL)
    platform.start()
    again = Sandbox.connect(sandbox.sandbox_id, api_url=platform.url, api_key=key)
    assert again.files.read("/home/user/kept.txt") == "kept"
    assert handle.process_id in {p.process_id for p in again.commands.list() if p.running}
    assert again.commands.run("echo alive").stdout == "alive\n"
    again.kill()


def test_a_vmm_killed_under_a_running_sandbox_shows_as_error_within_seconds(
    platform: Platform, key: str
) -> None:
    sandbox = Sandbox.create(api_url=platform.url, api_key=key)
    try:
        (pid,) = [
            p
            for p in qemu_pids(platform.data_dir)
            if sandbox.sandbox_id.encode() in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 15  # the reaper asks the node every 5 s
        info = sandbox.get_info()
        while info.state != "error" and time.monotonic() < deadline:
            time.sleep(0.25)
            info = sandbox.get_info()
        assert info.state == "error", info
        assert info.error
    finally:
        sandbox.kill()


def test_many_threads_share_one_sync_client_safely(sbx: Sandbox) -> None:
    errors: list[BaseException] = []

    def work() -> None:
        try:
            assert sbx.commands.run("true").exit_code == 0
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []


def test_lifecycle_through_the_sdk_hibernate_snapshot_restore_fork(
    platform: Platform, key: str
) -> None:
    sbx = Sandbox.create(api_url=platform.url, api_key=key, memory_mib=256)
    children: list[Sandbox] = []
    twin: Sandbox | None = None
    try:
        sbx.files.write("/home/user/state.txt", "one")
        snap = sbx.snapshot("one")
        assert [s.snapshot_id for s in sbx.snapshots()] == [snap.snapshot_id]
        sbx.files.write("/home/user/state.txt", "two")

        assert sbx.hibernate().state == "hibernated"
        assert sbx.files.read("/home/user/state.txt") == "two"  # wakes it transparently
        assert sbx.get_info().state == "running"

        assert sbx.restore(snap).head_snapshot == snap.snapshot_id
        assert sbx.files.read("/home/user/state.txt") == "one"

        children = sbx.fork(1)
        children[0].files.write("/home/user/state.txt", "child")
        assert sbx.files.read("/home/user/state.txt") == "one"

        twin = Sandbox.create(api_url=platform.url, api_key=key, from_snapshot=snap)
        assert twin.files.read("/home/user/state.txt") == "one"
        assert (
            twin.commands.run("hostname").stdout.strip()
            != sbx.commands.run("hostname").stdout.strip()
        )
        info = sbx.set_timeouts(idle_timeout_s=600)
        assert info.idle_timeout_s == 600
    finally:
        for sandbox in [*children, *([twin] if twin else []), sbx]:
            sandbox.kill()
        for snapshot in Sandbox.list_snapshots(api_url=platform.url, api_key=key):
            Sandbox.delete_snapshot(snapshot, api_url=platform.url, api_key=key)


def test_a_template_built_with_the_cli_serves_sandboxes_of_its_tenant_only(
    platform: Platform, key: str, tmp_path: Path
) -> None:
    (tmp_path / "space.toml").write_text(
        'name = "e2e"\ntag = "v1"\nbase = "debian:bookworm"\n'
        'env = { FROM = "the template" }\n'
        '[[steps]]\ncopy = { src = "hello.txt", dst = "/opt/hello.txt" }\n'
    )
    (tmp_path / "hello.txt").write_text("hello\n")
    cli = {**os.environ, "SPACE_API_URL": platform.url, "SPACE_API_KEY": key}
    built = subprocess.run(
        [*SPACE, "template", "build", str(tmp_path)], env=cli, capture_output=True, text=True
    )
    assert built.returncode == 0, built.stdout + built.stderr
    assert "step 1/2 copy" in built.stdout and "built e2e:v1" in built.stdout
    listed = subprocess.run([*SPACE, "template", "ls"], env=cli, capture_output=True, text=True)
    assert "e2e:v1" in listed.stdout and "base:latest" in listed.stdout

    sbx = Sandbox.create("e2e:v1", api_url=platform.url, api_key=key)
    try:
        out = sbx.commands.run('cat /opt/hello.txt; echo "$FROM"').stdout
        assert out == "hello\nthe template\n"
    finally:
        sbx.kill()
    other = platform.create_key("tenant-b")
    with pytest.raises(NotFound):
        Sandbox.create("e2e:v1", api_url=platform.url, api_key=other)
    removed = subprocess.run([*SPACE, "template", "rm", "e2e:v1"], env=cli, capture_output=True)
    assert removed.returncode == 0, removed.stderr
    with pytest.raises(NotFound):
        Sandbox.create("e2e:v1", api_url=platform.url, api_key=key)
