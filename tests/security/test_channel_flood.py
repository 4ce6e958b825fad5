"""Hostile guest on a real platform (issue 17, probe 3): root in tenant A's guest takes
the virtio-serial port from spaced and floods the host with well-formed frames.

Before the channel had a budget, the node agent sat at 100% CPU, tenant B's
``exec echo`` went from 0.14 s to 0.88 s p50, and A stayed ``running`` with nothing
logged. Now A's channel is throttled and closed, A's VM is stopped and A turns
``error`` with the reason (on the node at once, in the control plane's row after a
reaper round), B's execs keep their pace, and A can still be deleted.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from space.sdk import Sandbox

from ..integration.platform import Platform, qemu_pids, running_platform

pytestmark = [pytest.mark.vm, pytest.mark.solo]

#: B's exec p50 during A's flood may be at most this times its baseline (issue 17).
MAX_SLOWDOWN = 1.5
#: A turns error within this long of the flood's start: the budget notices abuse
#: within ABUSE_AFTER_S (5 s) plus a chunk; the reaper runs every second here.
ERROR_WITHIN_S = 30.0

# Run as root in A's guest (background, so it outlives spaced): once spaced is idle
# (killed mid-frame, it would leave the host's decoder out of step), kill it until the
# port is ours (init restarts spaced at once, but it imports for a while before it
# opens the port), then write frames as fast as the port takes them.
_FLOOD = r"""
import glob, os, signal, struct, sys, time
kind = sys.argv[1]
if kind == "credit":  # CREDIT for a stream the host never opened
    frame = struct.pack(">IBII", 9, 7, 12345, 1)
else:  # PONGs of the host's keep-alive payload: well-formed, each only a sign of life
    frame = struct.pack(">IBI", 10, 11, 0) + b"alive"
ports = glob.glob("/sys/class/virtio-ports/*")
(port,) = [p for p in ports if open(p + "/name").read().strip() == "space.agent"]
device = "/dev/" + os.path.basename(port)
me = os.getpid()
time.sleep(3)  # until spaced has sent our exec's RESULT: no frame half written
deadline = time.monotonic() + 60
fd = None
while fd is None and time.monotonic() < deadline:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) in (1, me):
            continue
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"space.guest" in argv and b"space.guest.init" not in argv:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
    try:
        fd = os.open(device, os.O_RDWR)
    except OSError:
        time.sleep(0.001)
open("/tmp/flood.started", "w").write(str(time.time()))
blob = memoryview(frame * (32768 // len(frame)))  # a port write takes at most 32 KiB
while True:
    done = 0
    while done < len(blob):
        done += os.write(fd, blob[done:])
"""


#: Keeps A's vCPU busy, as the flood program does, while B's baseline is measured.
_BURN = "python3 -c 'while True: pass'"


class _Cpu:
    """The CPU the platform's process (control plane and node agent) uses from now on,
    as a share of one core."""

    def __init__(self, platform: Platform) -> None:
        assert platform.process is not None
        self._stat = Path(f"/proc/{platform.process.pid}/stat")
        self._started = time.monotonic(), self._ticks()

    def _ticks(self) -> int:
        fields = self._stat.read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime

    def share(self) -> float:
        wall_s = time.monotonic() - self._started[0]
        return (self._ticks() - self._started[1]) / os.sysconf("SC_CLK_TCK") / wall_s


def _exec_echo_s(sandbox: Sandbox) -> float:
    started = time.monotonic()
    result = sandbox.commands.run(["echo", "hi"])
    assert result.stdout == "hi\n"
    return time.monotonic() - started


def _node_record(data_dir: Path, sandbox_id: str) -> dict[str, object]:
    (path,) = data_dir.rglob(f"sandboxes/{sandbox_id}.json")
    record: dict[str, object] = json.loads(path.read_text())
    return record


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    data_dir = tmp_path_factory.mktemp("space-flood")
    with running_platform(data_dir, ["--reaper-interval", "1"]) as p:
        yield p


@pytest.fixture(scope="module")
def tenant_b(platform: Platform) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(api_url=platform.url, api_key=platform.create_key("tenant-b"))
    yield sandbox
    sandbox.kill()


@pytest.mark.parametrize("flood", ["credit", "pong"])
def test_negative_a_guest_flooding_its_channel_turns_error_and_b_keeps_its_pace(
    platform: Platform, tenant_b: Sandbox, flood: str
) -> None:
    key_a = platform.create_key("tenant-a")
    hostile = Sandbox.create(api_url=platform.url, api_key=key_a)
    sid = hostile.sandbox_id
    try:
        hostile.files.write("/tmp/flood.py", _FLOOD)
        # The baseline is taken with A's vCPU as busy as the flood keeps it (under TCG
        # a busy guest costs a host core whatever it does), so what differs is the
        # flood's cost to the node agent.
        burner = hostile.commands.run(_BURN, background=True, user="root")
        for _ in range(3):  # warm B's path
            _exec_echo_s(tenant_b)
        baseline = statistics.median(_exec_echo_s(tenant_b) for _ in range(9))
        burner.kill()

        agent = _Cpu(platform)
        started = time.monotonic()
        hostile.commands.run(f"python3 /tmp/flood.py {flood}", background=True, user="root")
        during: list[float] = []
        record = _node_record(platform.data_dir, sid)
        while record["state"] != "error" and time.monotonic() - started < ERROR_WITHIN_S:
            during.append(_exec_echo_s(tenant_b))
            record = _node_record(platform.data_dir, sid)
        agent_share = agent.share()
        assert record["state"] == "error", f"A still {record['state']}: {platform.log_tail()}"
        assert "guest channel abuse" in str(record["error"])
        noticed_s = time.monotonic() - started

        row = _row(platform, key_a, sid)
        deadline = time.monotonic() + 10
        while row["state"] != "error" and time.monotonic() < deadline:
            time.sleep(0.5)
            row = _row(platform, key_a, sid)
        assert row["state"] == "error" and "guest channel abuse" in str(row["error"])
        assert not [pid for pid in qemu_pids(platform.data_dir) if _runs(pid, sid)]
        assert f"sandbox {sid}" in (platform.data_dir / "serve.log").read_text()

        during += [_exec_echo_s(tenant_b) for _ in range(max(0, 5 - len(during)))]
        p50 = statistics.median(during)
        # Taken again once A is stopped: the suite's other worker loads the machine in
        # phases, and B's pace is compared with the slower of the two calm figures.
        after = statistics.median(_exec_echo_s(tenant_b) for _ in range(9))
        print(
            f"\n{flood} flood: A error after {noticed_s:.1f} s; node agent CPU "
            f"{agent_share:.0%} of a core meanwhile; B exec echo p50 {baseline * 1000:.0f} ms "
            f"before, {p50 * 1000:.0f} ms during ({len(during)} execs), "
            f"{after * 1000:.0f} ms after"
        )
        assert p50 <= MAX_SLOWDOWN * max(baseline, after)
        assert tenant_b.get_info().state == "running"
    finally:
        hostile.kill()  # an errored sandbox stays deletable
    answer = httpx.get(
        f"{platform.url}/v1/sandboxes/{sid}",
        headers={"Authorization": f"Bearer {key_a}"},
        timeout=30,
    )
    assert answer.status_code == 404


def _row(platform: Platform, key: str, sandbox_id: str) -> dict[str, object]:
    answer = httpx.get(
        f"{platform.url}/v1/sandboxes/{sandbox_id}",
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    answer.raise_for_status()
    row: dict[str, object] = answer.json()
    return row


def _runs(pid: int, sandbox_id: str) -> bool:
    try:
        return sandbox_id.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
