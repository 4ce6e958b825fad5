"""SIGKILL of `space serve` in the middle of lifecycle operations loses nothing.

Each round writes a file and an epoch marker into the sandbox, starts one operation
(pause, resume, hibernate, snapshot, restore or fork) over REST, kills the server at a
random moment during it, starts it again and checks: every sandbox is in a settled
state and answers; the files it shows are exactly those of the epoch it shows (a
restore may roll the epoch back, never leave a mixture); every listed snapshot is
complete on disk and no unlisted one is left in the pool. The seed is printed so a
failure can be replayed.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .platform import Platform, running_platform

pytestmark = pytest.mark.vm

ROUNDS = 20
SETTLED = {"running", "paused", "hibernated"}
OPERATIONS = ("pause", "resume", "hibernate", "snapshot", "restore", "fork")


class Api:
    def __init__(self, platform: Platform, key: str) -> None:
        self.platform = platform
        self.headers = {"Authorization": f"Bearer {key}"}

    def call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(
            method, f"{self.platform.url}{path}", headers=self.headers, timeout=180, **kw
        )

    def ok(self, method: str, path: str, **kw: Any) -> Any:
        response = self.call(method, path, **kw)
        assert response.status_code < 300, (method, path, response.status_code, response.text)
        return response.json() if response.content else None

    def write(self, sid: str, path: str, data: str) -> None:
        self.ok("PUT", f"/v1/sandboxes/{sid}/files", params={"path": path}, content=data)

    def read(self, sid: str, path: str) -> str:
        response = self.call("GET", f"/v1/sandboxes/{sid}/files", params={"path": path})
        assert response.status_code == 200, (sid, path, response.text)
        return response.text


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    with running_platform(tmp_path / "space") as platform:
        api = Api(platform, platform.create_key("durable"))
        try:
            yield api
        finally:  # the platform keeps VMs across its stop: delete them first
            for sandbox in api.ok("GET", "/v1/sandboxes")["sandboxes"]:
                api.call("DELETE", f"/v1/sandboxes/{sandbox['id']}")
            for snapshot in api.ok("GET", "/v1/snapshots")["snapshots"]:
                api.call("DELETE", f"/v1/snapshots/{snapshot['id']}")


def _fire(api: Api, sid: str, op: str, snapshots: set[str], i: int) -> None:
    """Start ``op`` on ``sid`` in a thread; its answer does not matter (it is killed)."""
    request: tuple[str, str, dict[str, Any]]
    if op == "snapshot":
        request = ("POST", f"/v1/sandboxes/{sid}/snapshots", {"json": {"name": f"r{i}"}})
    elif op == "restore" and snapshots:
        target = random.choice(sorted(snapshots))
        request = ("POST", f"/v1/sandboxes/{sid}/restore", {"json": {"snapshot_id": target}})
    elif op == "fork":
        request = ("POST", f"/v1/sandboxes/{sid}/fork", {"json": {"count": 1}})
    else:
        request = ("POST", f"/v1/sandboxes/{sid}/{op if op != 'restore' else 'pause'}", {})
    method, path, kw = request

    def run() -> None:
        with contextlib.suppress(httpx.HTTPError):  # the server dies under it: expected
            api.call(method, path, **kw)

    threading.Thread(target=run, daemon=True).start()


def _check_sandbox(api: Api, sandbox: dict[str, Any], model: dict[int, frozenset[int]]) -> int:
    """The sandbox answers, and its files are exactly those of its epoch; returns it."""
    sid = sandbox["id"]
    assert sandbox["state"] in SETTLED, sandbox
    epoch = int(api.read(sid, "/home/user/epoch"))
    listing = api.ok("GET", f"/v1/sandboxes/{sid}/files/list", params={"path": "/home/user"})
    names = {e["name"] for e in listing["entries"] if e["name"].startswith("k")}
    assert names == {f"k{k}" for k in model[epoch]}, (sid, epoch, sorted(names))
    for k in model[epoch]:
        assert api.read(sid, f"/home/user/k{k}") == f"file {k}", (sid, k, epoch)
    return epoch


def _check_snapshots(api: Api, pool: Path) -> set[str]:
    listed = api.ok("GET", "/v1/snapshots")["snapshots"]
    on_disk = {p.name for p in (pool / "snapshots").iterdir()}
    ids = {s["id"] for s in listed}
    assert ids == on_disk, (ids, on_disk)
    for snapshot_id in ids:
        parts = {p.name for p in (pool / "snapshots" / snapshot_id).iterdir()}
        # The state holds the RAM: a snapshot has no RAM file of its own.
        assert {"rootfs.img", "vmstate"} <= parts, (snapshot_id, parts)
        assert "memory.ram" not in parts, (snapshot_id, parts)
    return ids


def test_sigkill_during_lifecycle_operations_leaves_everything_consistent(api: Api) -> None:
    seed = int(os.environ.get("SPACE_DURABILITY_SEED", time.time_ns() % 100_000))
    print(f"durability seed {seed}")
    random.seed(seed)
    platform = api.platform
    sid = api.ok("POST", "/v1/sandboxes", json={"memory_mib": 256})["id"]
    snapshots: set[str] = set()
    model: dict[int, frozenset[int]] = {-1: frozenset()}  # epoch -> the k files it has
    epoch = -1
    for i in range(ROUNDS):
        api.write(sid, f"/home/user/k{i}", f"file {i}")
        api.write(sid, "/home/user/epoch", str(i))
        model[i] = model[epoch] | {i}
        op = OPERATIONS[i % len(OPERATIONS)] if i < len(OPERATIONS) else random.choice(OPERATIONS)
        _fire(api, sid, op, snapshots, i)
        # Half the kills in the first 0.2 s, where the short operations are still going.
        time.sleep(random.uniform(0.0, random.choice((0.2, 1.5))))
        platform.stop(signal.SIGKILL)
        platform.start()
        sandboxes = api.ok("GET", "/v1/sandboxes")["sandboxes"]
        # A fork cut short leaves its unacknowledged children as errors to delete.
        settled = [s for s in sandboxes if s["id"] == sid or s["state"] != "error"]
        epochs = {s["id"]: _check_sandbox(api, s, model) for s in settled}
        snapshots = _check_snapshots(api, platform.data_dir / "pool")
        assert sid in epochs, f"round {i} ({op}) lost the sandbox"
        epoch = epochs[sid]
        for child in sandboxes:
            if child["id"] != sid:  # forks: checked above, then removed to bound the VMs
                api.ok("DELETE", f"/v1/sandboxes/{child['id']}")
