"""Persisted sandbox records: atomic writes, round trips, bad files reported."""

from __future__ import annotations

import json
from pathlib import Path

from space.node.api import SandboxSpec, SandboxState
from space.node.core.state import SandboxRecord, StateStore


def _record(sandbox_id: str = "sb-1") -> SandboxRecord:
    return SandboxRecord(
        spec=SandboxSpec(sandbox_id, cpus=2, memory_mib=512, env={"A": "1"}),
        state=SandboxState.CREATING,
        created_at=1700000000.5,
        template_digest="abc123",
        run_dir=f"/run/space/x/{sandbox_id}",
    )


def test_a_saved_record_loads_back_equal(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    record = _record().with_state(SandboxState.RUNNING, vmm_pid=4242)
    store.save(record)
    records, bad = StateStore(tmp_path).load_all()
    assert records == [record]
    assert bad == []


def test_saving_again_replaces_the_record_and_leaves_no_temp_files(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.save(_record())
    store.save(_record().with_state(SandboxState.ERROR, error="boom"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sb-1.json"]
    (record,) = store.load_all()[0]
    assert (record.state, record.error) == (SandboxState.ERROR, "boom")


def test_status_reflects_spec_state_and_pid() -> None:
    status = _record().with_state(SandboxState.RUNNING, vmm_pid=7).status()
    assert (status.sandbox_id, status.state, status.vmm_pid) == ("sb-1", SandboxState.RUNNING, 7)
    assert (status.cpus, status.memory_mib, status.disk_mib) == (2, 512, 2048)


def test_remove_is_idempotent(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.save(_record())
    store.remove("sb-1")
    store.remove("sb-1")
    assert store.load_all() == ([], [])


def test_negative_unparsable_and_foreign_version_files_are_reported_not_loaded(
    tmp_path: Path,
) -> None:
    store = StateStore(tmp_path)
    store.save(_record("good"))
    (tmp_path / "torn.json").write_text('{"spec": ')
    data = _record("future").to_json() | {"version": 99}
    (tmp_path / "future.json").write_text(json.dumps(data))
    records, bad = store.load_all()
    assert [r.sandbox_id for r in records] == ["good"]
    assert sorted(p.name for p in bad) == ["future.json", "torn.json"]
