"""The real, unmodified E2B SDK (``.venv-e2b``, tests/e2b_sdk.py) drives a real
`space serve` through its control API (issue 20): create with metadata and envs, list
with filters and pages, get_info, set_timeout, update_network, pause, connect (which
resumes), kill, fork, snapshots and metrics, and the SDK's own exceptions for an unknown
template, an unknown id and a bad key.

Only control-plane calls: the SDK reaches no envd for any of them (create and connect
do not call into the sandbox), so nothing here needs the sandbox-side routes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..e2b_sdk import run_e2b
from .platform import Platform, running_platform

pytestmark = pytest.mark.vm

# A cold boot under TCG can pass the SDK's 60 s default request timeout.
_CREATE = "request_timeout=600"


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("space-e2b-control")) as p:
        yield p


def test_the_e2b_sdk_creates_lists_times_out_pauses_connects_and_kills(
    platform: Platform,
) -> None:
    key = platform.create_key("e2b-control")
    result = run_e2b(
        f"""
        import os

        import httpx
        from e2b import ALL_TRAFFIC, SandboxState

        def our_egress(sandbox_id):  # our own /v1 API, for what the SDK cannot read
            url = f"{{os.environ['E2B_API_URL']}}/v1/sandboxes/{{sandbox_id}}/egress"
            return httpx.get(url, headers={{"X-API-Key": os.environ["E2B_API_KEY"]}}).json()

        first = Sandbox.create(
            "base", metadata={{"suite": "e2b", "n": "1"}}, envs={{"A": "1"}}, timeout=300,
            {_CREATE},
        )
        second = Sandbox.create(metadata={{"suite": "e2b", "n": "2"}}, timeout=300, {_CREATE})
        info = first.get_info()
        only_first = Sandbox.list(query=SandboxQuery(metadata={{"n": "1"}})).next_items()
        pages, paginator = [], Sandbox.list(limit=1)
        while paginator.has_next:
            pages.append([s.sandbox_id for s in paginator.next_items()])
        before = first.get_info().end_at
        first.set_timeout(3600)
        after = first.get_info().end_at
        default_rules = len(our_egress(first.sandbox_id)["allow"])
        first.update_network({{"allow_out": ["pypi.org"], "deny_out": [ALL_TRAFFIC]}})
        updated = our_egress(first.sandbox_id)
        network_info = first.get_info()
        paused = first.pause()
        paused_again = Sandbox.pause(first.sandbox_id)
        state_paused = Sandbox.get_info(first.sandbox_id).state.value
        listed_paused = Sandbox.list(
            query=SandboxQuery(state=[SandboxState.PAUSED])
        ).next_items()
        connected = Sandbox.connect(first.sandbox_id, timeout=1200)
        state_connected = connected.get_info().state.value
        report({{
            "ids": [first.sandbox_id, second.sandbox_id],
            "info": {{
                "id": info.sandbox_id, "template": info.template_id,
                "metadata": info.metadata, "state": info.state.value,
                "envd": info.envd_version,
            }},
            "only_first": [s.sandbox_id for s in only_first],
            "pages": pages,
            "extended_s": (after - before).total_seconds(),
            "default_rules": default_rules, "updated": updated,
            "internet_after": network_info.allow_internet_access,
            "network_after": network_info.network,
            "paused": paused, "paused_again": paused_again,
            "state_paused": state_paused,
            "listed_paused": [s.sandbox_id for s in listed_paused],
            "connected": connected.sandbox_id, "state_connected": state_connected,
            "token": connected._envd_access_token is not None,
            "killed": [first.kill(), Sandbox.kill(second.sandbox_id), first.kill()],
            "left": [s.sandbox_id for s in Sandbox.list().next_items()],
        }})
        """,
        url=platform.url,
        api_key=key,
        timeout_s=900,
    )
    first, second = result["ids"]
    assert result["info"] == {
        "id": first,
        "template": "base",
        "metadata": {"suite": "e2b", "n": "1"},
        "state": "running",
        "envd": "0.6.4",
    }
    assert result["only_first"] == [first]
    assert result["pages"] == [[first], [second]]
    assert result["extended_s"] > 3000  # from about 300 s left to about 3600 s
    assert result["default_rules"] == 12  # internet: names of 1-10 labels, IPv4, IPv6
    assert result["updated"] == {"allow": [{"domain": "pypi.org", "ports": [80, 443]}]}
    assert result["internet_after"] is False
    assert result["network_after"] == {"allow_out": ["pypi.org"], "deny_out": ["0.0.0.0/0"]}
    assert result["paused"] is True and result["paused_again"] is False
    assert result["state_paused"] == "paused" and result["listed_paused"] == [first]
    assert result["connected"] == first and result["state_connected"] == "running"
    assert result["token"] is True
    assert result["killed"] == [True, True, False]
    assert result["left"] == []


def test_negative_the_e2b_sdk_raises_its_own_exceptions(platform: Platform) -> None:
    key = platform.create_key("e2b-errors")
    result = run_e2b(
        f"""
        def status_of(call, *args, **kwargs):
            try:
                call(*args, **kwargs)
            except e2b.SandboxException as error:
                return [type(error).__name__, error.status_code]
            return None

        report({{
            "template": status_of(Sandbox.create, "no-such-template", {_CREATE}),
            "bad_timeout": status_of(Sandbox.create, timeout=10**9, {_CREATE}),
            "get_info": error_of(Sandbox.get_info, "sb-000000000000000000000000"),
            "connect": error_of(Sandbox.connect, "sb-000000000000000000000000"),
            "set_timeout": error_of(Sandbox.set_timeout, "sb-000000000000000000000000", 60),
            "kill": Sandbox.kill("sb-000000000000000000000000"),
            "bad_key": error_of(lambda: Sandbox.list(api_key="sk_space_wrong").next_items()),
            "left": [s.sandbox_id for s in Sandbox.list().next_items()],
        }})
        """,
        url=platform.url,
        api_key=key,
        timeout_s=300,
    )
    assert result == {
        "template": ["SandboxException", 404],
        "bad_timeout": ["SandboxException", 400],
        "get_info": "SandboxNotFoundException",
        "connect": "SandboxNotFoundException",
        "set_timeout": "SandboxNotFoundException",
        "kill": False,
        "bad_key": "AuthenticationException",
        "left": [],
    }


def test_the_e2b_sdk_forks_snapshots_restores_and_reads_metrics(platform: Platform) -> None:
    key = platform.create_key("e2b-snapshots")
    result = run_e2b(
        f"""
        import asyncio

        parent = Sandbox.create(metadata={{"role": "parent"}}, timeout=300, {_CREATE})
        (child,) = parent.fork(count=1, timeout=120, {_CREATE})
        child_info = child.get_info()
        snapshot = parent.create_snapshot(name="first")
        listed = parent.list_snapshots().next_items()
        restored = Sandbox.create(snapshot.snapshot_id, timeout=300, {_CREATE})
        restored_info = restored.get_info()
        metrics = parent.get_metrics()

        async def listed_async():
            paginator = AsyncSandbox.list(query=SandboxQuery(metadata={{"role": "parent"}}))
            return [s.sandbox_id for s in await paginator.next_items()]

        async_ids = asyncio.run(listed_async())
        killed = [s.kill() for s in (restored, child, parent)]
        report({{
            "parent": parent.sandbox_id,
            "child": child.sandbox_id,
            "child_metadata": child_info.metadata,
            "child_state": child_info.state.value,
            "child_left_s": (child_info.end_at - child_info.started_at).total_seconds(),
            "snapshot": [snapshot.snapshot_id, snapshot.names],
            "listed": [s.snapshot_id for s in listed],
            "restored_template": restored_info.template_id,
            "restored_metadata": restored_info.metadata,
            "metrics": [[m.cpu_count, m.mem_total > 0, m.disk_total > 0] for m in metrics],
            "async_ids": async_ids,
            "deleted": Sandbox.delete_snapshot(snapshot.snapshot_id),
            "deleted_again": Sandbox.delete_snapshot(snapshot.snapshot_id),
            "killed": killed,
        }})
        """,
        url=platform.url,
        api_key=key,
        timeout_s=900,
    )
    assert result["child"] != result["parent"]
    assert result["child_metadata"] == {"role": "parent"}  # a fork copies its parent
    assert result["child_state"] == "running"
    assert 100 <= result["child_left_s"] <= 400  # about 120 s from its fork
    snapshot_id, names = result["snapshot"]
    assert snapshot_id.startswith("sn-") and names == ["first"]
    assert result["listed"] == [snapshot_id]
    assert result["restored_template"] == "base"
    assert result["metrics"] and all(m[1] and m[2] for m in result["metrics"])
    assert result["async_ids"] == [result["parent"], result["child"]]
    assert result["deleted"] is True and result["deleted_again"] is False
    assert result["killed"] == [True, True, True]
