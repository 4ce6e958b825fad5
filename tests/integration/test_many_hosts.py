"""Issue 19 with real processes: three node hosts (each in its own network namespace,
with its own data directory and btrfs pool) and two control-plane replicas on one
PostgreSQL database (tests/integration/hosts.py).

The tests share one cluster and run in order: placement spreads and any replica serves
any sandbox; an idempotent create retried on the other replica makes one sandbox; a
replica killed (-9) during creates leaves no orphan VM or row once the survivor has
settled them; a node killed (-9) turns its sandboxes ``lost``, new creates go
elsewhere, and when it starts again its sandboxes come back running; a paused sandbox
with a file and a running process moves off a node drained with ``space node drain``
(the nodes share one node key) and goes on where it went, the drained node gets no new
sandboxes until ``space node activate``; the nodes keep snapshots and hibernated
sandboxes in an S3 bucket (moto's server on the host's end of the bridge): a snapshot
makes a sandbox on another node once its own is killed, and a hibernated sandbox of the
killed node wakes on another with its file and process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest

from space import Sandbox
from space.node.agent.node_user import DEFAULT_USER

from ..guest_programs import COUNTER_FILE, counter
from ..ports import free_port
from ..postgres import PostgresCluster
from ..unit._moto import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY, moto_server
from .hosts import BRIDGE_ADDRESS, Cluster, NodeHost, cluster
from .platform import SPACE, shared_node_key

pytestmark = pytest.mark.vm

_TENANT = "many-hosts"


@pytest.fixture(scope="module")
def hosts(postgres: PostgresCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("hosts")
    with postgres.database() as url, contextlib.ExitStack() as stack:

        def store_options() -> list[str]:
            # Once the bridge is up: the S3 endpoint listens on the host's end of it.
            return _s3_store(root, stack.enter_context(moto_server(host=BRIDGE_ADDRESS)))

        ports = [free_port(), free_port()]
        made = stack.enter_context(
            cluster(root, url, nodes=3, replicas=2, ports=ports, node_options=store_options)
        )
        yield made


def _s3_store(root: Path, endpoint: str) -> list[str]:
    """A bucket of ``endpoint`` (moto's S3 server) as every node's artifact store, and
    the `space node` options naming it: its credentials and the store's master key in
    files the node agents' user reads."""
    bucket = f"space-{secrets.token_hex(4)}"
    boto3.client(
        "s3", endpoint_url=endpoint, region_name=REGION,
        aws_access_key_id=ACCESS_KEY_ID, aws_secret_access_key=SECRET_ACCESS_KEY,
    ).create_bucket(Bucket=bucket)  # fmt: skip
    master_key = shared_node_key(root / "artifact-key")  # the same format: 32 bytes, base64
    credentials = master_key.parent / "s3.credentials"
    credentials.write_text(f"{ACCESS_KEY_ID}\n{SECRET_ACCESS_KEY}\n")
    credentials.chmod(0o600)
    agent = pwd.getpwnam(DEFAULT_USER)
    os.chown(credentials, agent.pw_uid, agent.pw_gid)
    return [
        "--artifact-store", f"s3://{bucket}", "--artifact-s3-endpoint", endpoint,
        "--artifact-s3-credentials-file", str(credentials),
        "--artifact-key-file", str(master_key),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def key(hosts: Cluster) -> str:
    return hosts.create_key(_TENANT)


def _api(
    hosts: Cluster, key: str, method: str, path: str, *, replica: int = -1, **kwargs: Any
) -> httpx.Response:
    url = hosts.replicas[replica].url + path
    headers = {"Authorization": f"Bearer {key}", **kwargs.pop("headers", {})}
    return httpx.request(method, url, headers=headers, timeout=120, **kwargs)


def _wait(what: str, check: Callable[[], bool], timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not in {timeout_s} s: {what}"
        time.sleep(0.5)


def _on_nodes(hosts: Cluster, alive: list[NodeHost]) -> dict[str, str]:
    """Sandbox id → node id of every sandbox the ``alive`` node agents run."""
    return {
        status["sandbox_id"]: host.node_id
        for host in alive
        for status in hosts.node_api(host, "sandboxes")
        if status["state"] != "deleted"
    }


def _rows(hosts: Cluster, key: str) -> dict[str, dict[str, Any]]:
    listed = _api(hosts, key, "GET", "/v1/sandboxes").json()["sandboxes"]
    return {row["id"]: row for row in listed}


def _delete_all(hosts: Cluster, key: str) -> None:
    for sandbox_id in _rows(hosts, key):
        assert _api(hosts, key, "DELETE", f"/v1/sandboxes/{sandbox_id}").status_code == 204


@contextlib.contextmanager
def _clients() -> Iterator[list[Sandbox]]:
    """A list to put SDK sandboxes in; each is closed (its connections) at the end."""
    opened: list[Sandbox] = []
    try:
        yield opened
    finally:
        for sandbox in opened:
            sandbox.close()


def test_placement_spreads_and_any_replica_serves_any_sandbox(hosts: Cluster, key: str) -> None:
    first, second = (replica.url for replica in hosts.replicas)
    with _clients() as opened:
        try:
            made = [Sandbox.create(api_url=first, api_key=key) for _ in range(3)]
            opened += made
            rows = _rows(hosts, key)
            placed = {s.sandbox_id: rows[s.sandbox_id]["node_id"] for s in made}
            assert set(placed.values()) == {host.node_id for host in hosts.hosts}
            for sandbox in made:
                # Through the other replica: the same sandbox, its node reached from there.
                there = Sandbox.connect(sandbox.sandbox_id, api_url=second, api_key=key)
                opened.append(there)
                echoed = there.commands.run(f"echo {sandbox.sandbox_id}").stdout.strip()
                assert echoed == sandbox.sandbox_id
            assert _on_nodes(hosts, hosts.hosts) == placed
        finally:
            _delete_all(hosts, key)
    assert _on_nodes(hosts, hosts.hosts) == {}


def test_an_idempotent_create_retried_on_the_other_replica_makes_one_sandbox(
    hosts: Cluster, key: str
) -> None:
    idem = {"Idempotency-Key": "retry-" + secrets.token_hex(4)}
    try:
        made = _api(hosts, key, "POST", "/v1/sandboxes", replica=0, json={}, headers=idem)
        assert made.status_code == 201, made.text
        again = _api(hosts, key, "POST", "/v1/sandboxes", replica=1, json={}, headers=idem)
        assert again.status_code in (200, 201) and again.json()["id"] == made.json()["id"]
        assert list(_rows(hosts, key)) == [made.json()["id"]]
        assert list(_on_nodes(hosts, hosts.hosts)) == [made.json()["id"]]
    finally:
        _delete_all(hosts, key)


def test_a_replica_killed_during_creates_leaves_no_orphan_vm_or_row(
    hosts: Cluster, key: str
) -> None:
    keys = [f"crash-{i}-{secrets.token_hex(4)}" for i in range(6)]

    async def create(client: httpx.AsyncClient, idem: str) -> int | str:
        try:
            headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": idem}
            url = hosts.replicas[0].url + "/v1/sandboxes"
            return (await client.post(url, json={}, headers=headers)).status_code
        except httpx.HTTPError as exc:
            return type(exc).__name__

    async def kill_during_creates() -> list[int | str]:
        # In one thread: CPython 3.11's parser is not safe against threads that import
        # at once (SystemError "AST constructor recursion depth mismatch").
        async with httpx.AsyncClient(timeout=120) as client:
            creates = asyncio.gather(*(create(client, idem) for idem in keys))
            await asyncio.sleep(0.5)  # some creates on their nodes, some not yet
            hosts.replicas[0].kill()
            return await creates

    answered = asyncio.run(kill_during_creates())
    # Each retried on the survivor: the sandbox the first request made, or one made now.
    retried = {
        idem: _api(hosts, key, "POST", "/v1/sandboxes", json={}, headers={"Idempotency-Key": idem})
        for idem in keys
    }
    try:
        assert all(r.status_code in (200, 201) for r in retried.values()), (answered, retried)
        ids = {r.json()["id"] for r in retried.values()}
        assert len(ids) == len(keys)  # one sandbox per key, never two
        # The survivor settles what the dead replica left half made.
        _wait(
            "every row settled",
            lambda: all(row["state"] != "creating" for row in _rows(hosts, key).values()),
        )
        rows = _rows(hosts, key)
        assert ids <= set(rows)
        on_nodes = _on_nodes(hosts, hosts.hosts)
        # No VM without a row, and every running row has its VM where the row says.
        assert set(on_nodes) <= set(rows), (on_nodes, rows)
        for sandbox_id, row in rows.items():
            assert row["state"] in ("running", "error"), row
            if row["state"] == "running":
                assert on_nodes[sandbox_id] == row["node_id"]
    finally:
        _delete_all(hosts, key)
    _wait("nothing left on the nodes", lambda: _on_nodes(hosts, hosts.hosts) == {})


def test_a_killed_node_turns_its_sandboxes_lost_until_it_comes_back(
    hosts: Cluster, key: str
) -> None:
    survivor = hosts.replicas[-1].url
    with _clients() as opened:
        _lose_and_bring_back(hosts, key, survivor, opened)


def _lose_and_bring_back(hosts: Cluster, key: str, survivor: str, opened: list[Sandbox]) -> None:
    try:
        sandbox = Sandbox.create(api_url=survivor, api_key=key)
        opened.append(sandbox)
        sandbox.files.write("/tmp/kept", "still here")
        where = _rows(hosts, key)[sandbox.sandbox_id]["node_id"]
        victim = next(host for host in hosts.hosts if host.node_id == where)
        victim.kill()  # the agent alone, as a crash: its VM goes on running

        def state() -> str:
            row = _api(hosts, key, "GET", f"/v1/sandboxes/{sandbox.sandbox_id}").json()
            return str(row["state"])

        _wait("the sandbox is lost", lambda: state() == "lost", timeout_s=60)
        row = _api(hosts, key, "GET", f"/v1/sandboxes/{sandbox.sandbox_id}").json()
        assert victim.node_id in row["error"]
        nodes = httpx.get(
            survivor + "/v1/nodes", headers={"Authorization": f"Bearer {hosts.token}"}, timeout=30
        ).json()["nodes"]
        assert {n["node_id"]: n["state"] for n in nodes}[victim.node_id] == "lost"
        refused = _api(hosts, key, "POST", f"/v1/sandboxes/{sandbox.sandbox_id}/pause")
        assert refused.status_code == 409
        elsewhere = [Sandbox.create(api_url=survivor, api_key=key) for _ in range(2)]
        opened += elsewhere
        rows = _rows(hosts, key)
        assert all(rows[s.sandbox_id]["node_id"] != victim.node_id for s in elsewhere)

        victim.start(hosts.replicas, hosts.token_file)  # re-adopts its VM, heartbeats
        victim.wait_registered()
        _wait("the sandbox is back", lambda: state() == "running", timeout_s=90)
        assert sandbox.files.read("/tmp/kept") == "still here"
    finally:
        _delete_all(hosts, key)
    _wait("nothing left on the nodes", lambda: _on_nodes(hosts, hosts.hosts) == {})


_COUNTER = counter(0.2)


def _space_node(hosts: Cluster, command: str, node_id: str) -> str:
    """``space node COMMAND NODE_ID`` against the surviving replica; its output."""
    out = subprocess.run(
        [*SPACE, "node", command, node_id, "--control-url", hosts.replicas[-1].url,
         "--token-file", str(hosts.token_file)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def _node_states(hosts: Cluster) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {hosts.token}"}
    nodes = httpx.get(hosts.replicas[-1].url + "/v1/nodes", headers=headers, timeout=30)
    return {n["node_id"]: n["state"] for n in nodes.json()["nodes"]}


def _count(sandbox: Sandbox) -> int:
    """The counter's value (0 before it first wrote it)."""
    result = sandbox.commands.run(f"cat {COUNTER_FILE} 2>/dev/null || echo 0")
    assert result.exit_code == 0, result
    return int(result.stdout.strip() or 0)


def test_a_drained_node_s_paused_sandbox_moves_and_goes_on_on_another_node(
    hosts: Cluster, key: str
) -> None:
    survivor = hosts.replicas[-1].url
    with _clients() as opened:
        try:
            sandbox = Sandbox.create(api_url=survivor, api_key=key)
            opened.append(sandbox)
            source = _rows(hosts, key)[sandbox.sandbox_id]["node_id"]
            try:
                _drain_and_go_on(hosts, key, sandbox, source)
                new = [Sandbox.create(api_url=survivor, api_key=key) for _ in range(2)]
                opened += new
                rows = _rows(hosts, key)
                assert all(rows[s.sandbox_id]["node_id"] != source for s in new)
                assert source not in _on_nodes(hosts, hosts.hosts).values()
            finally:
                activated = _space_node(hosts, "activate", source)
        finally:
            _delete_all(hosts, key)
    assert source in activated and _node_states(hosts)[source] == "active"
    _wait("nothing left on the nodes", lambda: _on_nodes(hosts, hosts.hosts) == {})


def _drain_and_go_on(hosts: Cluster, key: str, sandbox: Sandbox, source: str) -> None:
    """Pause ``sandbox`` (a file, a counter running) on ``source``, drain ``source``
    with the CLI, and check that it moved, and goes on where it went when resumed."""
    sandbox.files.write("/home/user/moved.txt", "made before the drain")
    sandbox.commands.run(_COUNTER, background=True, timeout_s=None)
    _wait("the counter runs", lambda: _count(sandbox) > 2, timeout_s=30)
    before = _count(sandbox)
    sandbox.pause()
    drained = _space_node(hosts, "drain", source)
    assert source in drained and "draining" in drained
    _wait(
        "the sandbox is on another node",
        lambda: _rows(hosts, key)[sandbox.sandbox_id]["node_id"] != source,
        timeout_s=180,
    )
    row = _rows(hosts, key)[sandbox.sandbox_id]
    assert row["state"] == "hibernated"
    holders = [
        host.node_id
        for host in hosts.hosts
        for status in hosts.node_api(host, "sandboxes")
        if status["sandbox_id"] == sandbox.sandbox_id
    ]
    assert holders == [row["node_id"]]  # there, and no longer on the source
    assert _node_states(hosts)[source] == "draining"

    sandbox.resume()
    assert sandbox.files.read("/home/user/moved.txt") == "made before the drain"
    woke_at = _count(sandbox)
    assert woke_at >= before  # the same process, from where it was suspended
    _wait("the counter goes on", lambda: _count(sandbox) > woke_at, timeout_s=30)
    assert _rows(hosts, key)[sandbox.sandbox_id]["node_id"] == row["node_id"]


def test_a_killed_nodes_snapshot_and_hibernated_sandbox_come_back_elsewhere_from_s3(
    hosts: Cluster, key: str
) -> None:
    survivor = hosts.replicas[-1].url
    snapshots: list[str] = []
    with _clients() as opened:
        try:
            sandbox = Sandbox.create(api_url=survivor, api_key=key)
            opened.append(sandbox)
            sandbox.files.write("/home/user/kept.txt", "made before the node died")
            sandbox.commands.run(_COUNTER, background=True, timeout_s=None)
            _wait("the counter runs", lambda: _count(sandbox) > 2, timeout_s=30)
            snapshot = sandbox.snapshot("before-the-crash")
            snapshots.append(snapshot.snapshot_id)
            before = _count(sandbox)
            sandbox.hibernate()

            def row() -> dict[str, Any]:
                return _rows(hosts, key)[sandbox.sandbox_id]

            def stored() -> bool:
                path = f"/v1/snapshots/{snapshot.snapshot_id}"
                return bool(_api(hosts, key, "GET", path).json()["archived"])

            _wait("the sandbox is in the store", lambda: row()["archived"], timeout_s=180)
            _wait("the snapshot is in the store", stored, timeout_s=180)
            home = row()["node_id"]
            (victim,) = [host for host in hosts.hosts if host.node_id == home]
            victim.kill()  # -9: its lease runs out, and it is lost

            _wait(
                "the sandbox is woken elsewhere from the store",
                lambda: row()["node_id"] != home and row()["state"] == "hibernated",
                timeout_s=180,
            )
            sandbox.resume()
            assert sandbox.files.read("/home/user/kept.txt") == "made before the node died"
            woke_at = _count(sandbox)
            assert woke_at >= before
            _wait("its counter goes on", lambda: _count(sandbox) > woke_at, timeout_s=30)

            child = Sandbox.create(api_url=survivor, api_key=key, from_snapshot=snapshot)
            opened.append(child)
            assert _rows(hosts, key)[child.sandbox_id]["node_id"] not in (home, None)
            assert child.files.read("/home/user/kept.txt") == "made before the node died"
            started = _count(child)
            _wait("the snapshot's counter goes on", lambda: _count(child) > started, 30)
        finally:
            _delete_all(hosts, key)
            for snapshot_id in snapshots:
                Sandbox.delete_snapshot(snapshot_id, api_url=survivor, api_key=key)
            for host in hosts.hosts:  # the killed one back: its stale copy goes
                if host.process is None:
                    host.start(hosts.replicas, hosts.token_file)
                    host.wait_registered()
    _wait("nothing left on the nodes", lambda: _on_nodes(hosts, hosts.hosts) == {}, 120)
