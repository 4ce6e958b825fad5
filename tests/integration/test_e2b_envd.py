"""The real, unmodified E2B SDK's in-sandbox calls (commands, PTY, files, watches)
against a real platform and a real VM: envd's routes, translated by the control plane
into our guest operations (issue 20).

The sandbox is made by ``Sandbox.create`` and each script reaches it by
``Sandbox.connect``, as a user's code does: every byte of a command or a file goes
through the SDK's own Connect and HTTP clients, with only the variables docs/e2b.md
names set.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2b_sdk import run_e2b

from .platform import Platform, running_platform

pytestmark = pytest.mark.vm

#: The platform's --sandbox-domain: what E2B's get_host names (no DNS: the Host header).
DOMAIN = "e2b.test"


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    data_dir = tmp_path_factory.mktemp("e2b-envd") / "data"
    with running_platform(data_dir, ["--sandbox-domain", DOMAIN]) as platform:
        yield platform


@pytest.fixture(scope="module")
def sandbox(platform: Platform) -> Iterator[dict[str, str]]:
    key = platform.create_key("acme")
    created = run_e2b(
        """
        sandbox = Sandbox.create("base", timeout=3600, request_timeout=600)
        report(sandbox.sandbox_id)
        """,
        url=platform.url,
        api_key=key,
        timeout_s=700,
    )
    try:
        yield {"id": created, "key": key}
    finally:
        # Killed, the sandbox is no longer running to the SDK (not a wrong token).
        after = run_e2b(
            f"""
            sandbox = Sandbox.connect({created!r})
            killed = sandbox.kill()
            report([killed, sandbox.is_running(), error_of(sandbox.commands.run, "true")])
            """,
            url=platform.url,
            api_key=key,
        )
        assert after == [True, False, "SandboxNotRunningException"]


def _run(platform: Platform, sandbox: dict[str, str], script: str) -> Any:
    """``script`` with ``sandbox``: the SDK's Sandbox, connected by id."""
    prelude = f"sandbox = Sandbox.connect({sandbox['id']!r}, timeout=3600)\n"
    return run_e2b(prelude + script, url=platform.url, api_key=sandbox["key"], timeout_s=300)


def test_commands_run_with_callbacks_stdin_and_a_background_kill(
    platform: Platform, sandbox: dict[str, str]
) -> None:
    result = _run(
        platform,
        sandbox,
        """
out, err = [], []
done = sandbox.commands.run(
    "echo hello; echo oops >&2; exit 0", on_stdout=out.append, on_stderr=err.append
)
failed = error_of(sandbox.commands.run, "exit 7")
with_env = sandbox.commands.run("echo $GREETING from $(pwd) as $(whoami)",
                                envs={"GREETING": "hi"}, cwd="/tmp")
as_root = sandbox.commands.run("whoami", user="root")

cat = sandbox.commands.run("cat", background=True, stdin=True)
sandbox.commands.send_stdin(cat.pid, "piped\\n")
sandbox.commands.close_stdin(cat.pid)
cat_result = cat.wait()

big = sandbox.commands.run("head -c 3000000 /dev/urandom | base64 -w 0")
later = sandbox.commands.run("echo one; sleep 3; echo two", background=True)
reattached = sandbox.commands.connect(later.pid).wait()

sleeper = sandbox.commands.run("sleep 600", background=True)
listed = [p.pid for p in sandbox.commands.list()]
killed = sleeper.kill()
killed_again = sandbox.commands.kill(sleeper.pid)
after = [p.pid for p in sandbox.commands.list()]
report({
    "stdout": done.stdout, "stderr": done.stderr, "exit": done.exit_code,
    "callbacks": ["".join(out), "".join(err)], "failed": failed,
    "env": with_env.stdout, "root": as_root.stdout,
    "cat": cat_result.stdout, "big": len(big.stdout), "reattached": reattached.stdout,
    "sleeper_listed": sleeper.pid in listed, "killed": killed,
    "killed_again": killed_again, "sleeper_after": sleeper.pid in after,
})
""",
    )
    assert result == {
        "stdout": "hello\n",
        "stderr": "oops\n",
        "exit": 0,
        "callbacks": ["hello\n", "oops\n"],
        "failed": "CommandExitException",
        "env": "hi from /tmp as user\n",
        "root": "root\n",
        "cat": "piped\n",
        "big": 4_000_000,
        "reattached": "one\ntwo\n",
        "sleeper_listed": True,
        "killed": True,
        "killed_again": False,
        "sleeper_after": False,
    }


def test_a_pty_takes_input_a_resize_and_a_connect_by_pid(
    platform: Platform, sandbox: dict[str, str]
) -> None:
    result = _run(
        platform,
        sandbox,
        """
from e2b import PtySize

seen = bytearray()
terminal = sandbox.pty.create(PtySize(rows=24, cols=80))
sandbox.pty.send_stdin(terminal.pid, b"stty size; echo mark-$((6*7))\\n")
events = iter(terminal)
while b"mark-42" not in seen:
    seen.extend(next(events)[2] or b"")
# Connect again by pid (one guest request): its output is a terminal's, replay included.
terminal.disconnect()
again = sandbox.pty.connect(terminal.pid)
sandbox.pty.resize(terminal.pid, PtySize(rows=40, cols=132))
sandbox.pty.send_stdin(terminal.pid, b"stty size; exit\\n")
for _, _, chunk in again:
    seen.extend(chunk or b"")
ended = again.wait()
report({"text": seen.decode(errors="replace"), "exit": ended.exit_code})
""",
    )
    assert result["text"].count("mark-42") >= 2  # the connect replayed the terminal's output
    assert "24 80" in result["text"] and "40 132" in result["text"]
    assert result["exit"] == 0


def test_files_round_trip_ten_mib_list_watch_and_errors(
    platform: Platform, sandbox: dict[str, str]
) -> None:
    result = _run(
        platform,
        sandbox,
        """
import hashlib, os, time
from e2b import FileType, FilesystemEventType

data = os.urandom(10 * 1024 * 1024)
started = time.monotonic()
info = sandbox.files.write("/home/user/big.bin", data)
wrote = time.monotonic()
back = sandbox.files.read("/home/user/big.bin", format="bytes")
read = time.monotonic()
streamed = sandbox.files.write("/home/user/stream.bin", iter([b"a" * 1000, b"b" * 1000]))
text = sandbox.files.read("/home/user/stream.bin")

sandbox.files.make_dir("/home/user/d/e")
made_again = sandbox.files.make_dir("/home/user/d/e")
sandbox.files.write("/home/user/d/e/f.txt", "f")
listed = sorted(e.path for e in sandbox.files.list("/home/user/d", depth=2))
stat = sandbox.files.get_info("/home/user/big.bin")

events = []
watch = sandbox.files.watch_dir("/home/user/d", recursive=True)
sandbox.files.write("/home/user/d/e/new.txt", "x")
sandbox.files.rename("/home/user/d/e/new.txt", "/home/user/d/moved.txt")
deadline = time.monotonic() + 30
while time.monotonic() < deadline and not any(e.name == "moved.txt" for e in events):
    events.extend(watch.get_new_events())
    time.sleep(0.5)
watch.stop()
sandbox.files.remove("/home/user/d")

report({
    "same": hashlib.sha256(back).hexdigest() == hashlib.sha256(data).hexdigest(),
    "seconds": [round(wrote - started, 2), round(read - wrote, 2)],
    "written": [info.path, info.type.value], "streamed": len(text),
    "made_again": made_again, "listed": listed,
    "stat": [stat.size, stat.type.value, stat.owner, stat.permissions],
    "events": sorted({(e.name, e.type.name) for e in events}),
    "exists": sandbox.files.exists("/home/user/d"),
    "missing": error_of(sandbox.files.read, "/home/user/no-such-file"),
    "missing_list": error_of(sandbox.files.list, "/home/user/no-such-dir"),
})
""",
    )
    assert result["same"] is True
    # Figures for the report: 10 MiB up (multipart) and down, through the SDK (TCG VM).
    print(f"10 MiB write {result['seconds'][0]} s, read {result['seconds'][1]} s")
    assert result["written"] == ["/home/user/big.bin", "file"]
    assert result["streamed"] == 2000
    assert result["made_again"] is False
    assert result["listed"] == ["/home/user/d/e", "/home/user/d/e/f.txt"]
    assert result["stat"] == [10 * 1024 * 1024, "file", "user", "-rw-r--r--"]
    # Names are relative to the watched directory; our guest writes a file as a
    # temporary one renamed into place, which a watch sees too.
    assert ["e/new.txt", "CREATE"] in result["events"]
    assert ["moved.txt", "CREATE"] in result["events"]
    assert result["exists"] is False
    # The SDK's NotFoundException for files (its subclass FileNotFoundException).
    assert result["missing"] == "FileNotFoundException"
    assert result["missing_list"] == "FileNotFoundException"


def test_the_async_sdk_streams_input_output_and_a_directory_watch(
    platform: Platform, sandbox: dict[str, str]
) -> None:
    result = run_e2b(
        f"""
import asyncio
import os

async def main():
    sandbox = await AsyncSandbox.connect({sandbox["id"]!r}, timeout=3600)
    out = []
    done = await sandbox.commands.run("seq 1 3", on_stdout=out.append)

    cat = await sandbox.commands.run("cat", background=True, stdin=True)
    async with sandbox.commands.stream_input(cat.pid) as feed:
        await feed.send("one ")
        await feed.send(b"two")
    await sandbox.commands.close_stdin(cat.pid)
    fed = await cat.wait()

    await sandbox.files.make_dir("/home/user/aw")
    events = []
    watch = await sandbox.files.watch_dir("/home/user/aw", on_event=events.append)
    await sandbox.files.write("/home/user/aw/x.txt", "x")
    for _ in range(60):
        if any(e.name == "x.txt" for e in events):
            break
        await asyncio.sleep(0.5)
    await watch.stop()
    await sandbox.files.remove("/home/user/aw")
    report({{"out": "".join(out), "stdout": done.stdout, "fed": fed.stdout,
             "events": sorted({{(e.name, e.type.name) for e in events}})}})

asyncio.run(main())
# The SDK's native HTTP client (pyqwest) sometimes aborts the interpreter at exit after
# async streams (SIGABRT, nothing on stderr), once the result is out: leave without
# its finalizers.
os._exit(0)
""",
        url=platform.url,
        api_key=sandbox["key"],
        timeout_s=300,
    )
    assert result["out"] == result["stdout"] == "1\n2\n3\n"
    assert result["fed"] == "one two"
    assert ["x.txt", "CREATE"] in result["events"]


def test_negative_a_wrong_access_token_is_an_authentication_error(
    platform: Platform, sandbox: dict[str, str]
) -> None:
    result = _run(
        platform,
        sandbox,
        """
from e2b.connection_config import ConnectionConfig

config = sandbox.connection_config
wrong = dict(config.sandbox_headers, **{"X-Access-Token": "not-the-token"})
forged = Sandbox(
    sandbox_id=sandbox.sandbox_id, sandbox_domain=None,
    envd_version=sandbox._envd_version, envd_access_token="not-the-token",
    connection_config=ConnectionConfig(extra_sandbox_headers=wrong),
)
report({
    "run": error_of(forged.commands.run, "true"),
    "read": error_of(forged.files.read, "/etc/hostname"),
})
""",
    )
    assert result == {"run": "AuthenticationException", "read": "AuthenticationException"}


def test_a_paused_sandbox_resumes_for_a_command(
    platform: Platform, sandbox: dict[str, str]
) -> None:
    result = _run(
        platform,
        sandbox,
        """
sandbox.files.write("/home/user/kept.txt", "kept")
sandbox.pause()
paused = Sandbox.get_info(sandbox.sandbox_id).state.value
out = sandbox.commands.run("cat /home/user/kept.txt").stdout
report({"paused": paused, "out": out,
        "state": Sandbox.get_info(sandbox.sandbox_id).state.value})
""",
    )
    assert result == {"paused": "paused", "out": "kept", "state": "running"}


def test_the_sdk_needs_no_http_version_setting_over_plain_http(
    platform: Platform, sandbox: dict[str, str]
) -> None:
    """E2B_HTTP_VERSION unset (the SDK's default, "2") works over plain http: its
    transport speaks HTTP/1.1 where no TLS negotiates HTTP/2; "1.1" works too."""
    script = 'report(sandbox.commands.run("echo ok").stdout)'
    assert _run(platform, sandbox, script) == "ok\n"
    one = run_e2b(
        f"sandbox = Sandbox.connect({sandbox['id']!r})\n" + script,
        url=platform.url,
        api_key=sandbox["key"],
        env={"E2B_HTTP_VERSION": "1.1"},
    )
    assert one == "ok\n"


def test_get_host_reaches_a_server_in_the_sandbox_with_the_traffic_token(
    platform: Platform, sandbox: dict[str, str]
) -> None:
    """E2B's port exposure: a server started by commands.run is reached at
    ``sandbox.get_host(port)`` through SPACE (the Host header stands in for wildcard
    DNS), with the create answer's traffic token; without it, refused."""
    result = _run(
        platform,
        sandbox,
        """
import os, time
import httpx

sandbox.files.write("/home/user/site/index.html", "served from the guest")
sandbox.commands.run(
    "python3 -m http.server 8000 --directory /home/user/site", background=True, timeout=0
)
host = sandbox.get_host(8000)
url = os.environ["E2B_SANDBOX_URL"]
token = {"e2b-traffic-access-token": sandbox.traffic_access_token}
for _ in range(120):
    answer = httpx.get(url + "/index.html", headers={"Host": host, **token}, timeout=60)
    if answer.status_code != 502:  # 502: nothing listening yet
        break
    time.sleep(0.5)
refused = httpx.get(url + "/index.html", headers={"Host": host}, timeout=60)
report({"host": host, "status": answer.status_code, "body": answer.text,
        "without_token": refused.status_code})
""",
    )
    assert result == {
        "host": f"8000-{sandbox['id']}.{DOMAIN}",
        "status": 200,
        "body": "served from the guest",
        "without_token": 401,
    }
