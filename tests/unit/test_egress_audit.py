"""The egress audit log: one JSON line per event, tail reads, rotation, safe ids."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import pytest

from space.node.api import EgressEvent, InvalidArgument, Unavailable
from space.node.egress import audit
from space.node.egress.audit import (
    DEFAULT_BURST,
    DEFAULT_RATE_PER_S,
    DROP_DECISION,
    MAX_READ_LIMIT,
    AuditLog,
)


def _event(i: int = 0, *, host: str | None = "pypi.org", reason: str = "policy") -> EgressEvent:
    return EgressEvent(
        time=1700000000.0 + i / 8,
        protocol="tls",
        host=host,
        address="151.101.0.223",
        port=443,
        decision="allow",
        reason=reason,
        bytes_out=i,
        bytes_in=2 * i,
        secrets=("GITHUB_TOKEN", "NPM_TOKEN"),
    )


def _sized(i: int) -> EgressEvent:
    """An event whose line has the same length for every i in 0..9."""
    assert 0 <= i <= 9
    return dataclasses.replace(_event(), time=1700000000.5 + i, bytes_out=i, bytes_in=i)


def test_an_event_reads_back_equal(tmp_path: Path) -> None:
    log = AuditLog(tmp_path)
    dns_event = EgressEvent(1.5, "dns", "x.org", None, None, "deny", "no rule for host")
    log.write("sb-1", _event())
    log.write("sb-1", dns_event)
    assert log.read("sb-1") == [_event(), dns_event]


def test_each_event_is_one_json_line_keyed_by_field_name(tmp_path: Path) -> None:
    AuditLog(tmp_path).write("sb-1", _event(3))
    (line,) = (tmp_path / "sb-1.jsonl").read_text().splitlines()
    assert json.loads(line) == {
        "time": 1700000000.375,
        "protocol": "tls",
        "host": "pypi.org",
        "address": "151.101.0.223",
        "port": 443,
        "decision": "allow",
        "reason": "policy",
        "bytes_out": 3,
        "bytes_in": 6,
        "secrets": ["GITHUB_TOKEN", "NPM_TOKEN"],
    }


def test_a_hostile_host_name_stays_on_one_ascii_line(tmp_path: Path) -> None:
    log = AuditLog(tmp_path)
    hostile = _event(host='evil\n{"time": 0}\r\u2028é\x00')
    log.write("sb-1", hostile)
    data = (tmp_path / "sb-1.jsonl").read_bytes()
    assert data.isascii()
    assert data.count(b"\n") == 1
    assert log.read("sb-1") == [hostile]


def test_read_returns_the_most_recent_events_oldest_first(tmp_path: Path) -> None:
    log = AuditLog(tmp_path)
    for i in range(10):
        log.write("sb-1", _event(i))
    assert log.read("sb-1", limit=3) == [_event(7), _event(8), _event(9)]
    assert log.read("sb-1", limit=0) == []
    assert log.read("sb-1") == [_event(i) for i in range(10)]


def test_a_sandbox_without_a_log_has_no_events(tmp_path: Path) -> None:
    assert AuditLog(tmp_path / "missing").read("sb-1") == []


def test_logs_of_sandboxes_are_separate(tmp_path: Path) -> None:
    log = AuditLog(tmp_path)
    log.write("sb-1", _event(1))
    log.write("sb-2", _event(2))
    assert log.read("sb-1") == [_event(1)]
    assert log.read("sb-2") == [_event(2)]


def test_malformed_lines_are_skipped(tmp_path: Path) -> None:
    log = AuditLog(tmp_path)
    log.write("sb-1", _event(1))
    good = json.loads((tmp_path / "sb-1.jsonl").read_text())
    junk = [
        "not json",
        "[]",
        "\xff\xfe",
        json.dumps({**good, "port": True}),
        json.dumps({**good, "secrets": "GITHUB_TOKEN"}),
        json.dumps({**good, "host": 5}),
        json.dumps({**good, "time": 10**400}),
        json.dumps({k: v for k, v in good.items() if k != "port"}),
        "[" * 100000,
        '{"time": 1',
    ]
    with (tmp_path / "sb-1.jsonl").open("a", encoding="latin-1") as file:
        file.write("\n".join(junk) + "\n")
    log.write("sb-1", _event(2))
    assert log.read("sb-1") == [_event(1), _event(2)]


def test_skipped_lines_do_not_pull_in_the_rotated_file_too_early(tmp_path: Path) -> None:
    log = AuditLog(tmp_path)
    (tmp_path / "sb-1.jsonl.1").write_text(audit._encode(_event(0)).decode())
    for i in range(1, 4):
        log.write("sb-1", _event(i))
        with (tmp_path / "sb-1.jsonl").open("a") as file:
            file.write("garbage\n")
    assert log.read("sb-1", limit=3) == [_event(1), _event(2), _event(3)]
    assert log.read("sb-1", limit=4) == [_event(i) for i in range(4)]


def test_a_full_file_is_rotated_and_read_continues_into_the_rotated_one(tmp_path: Path) -> None:
    line_bytes = len(audit._encode(_sized(0)))
    log = AuditLog(tmp_path, max_bytes=3 * line_bytes)
    for i in range(5):
        log.write("sb-1", _sized(i))
    assert (tmp_path / "sb-1.jsonl.1").stat().st_size == 3 * line_bytes
    assert (tmp_path / "sb-1.jsonl").stat().st_size == 2 * line_bytes
    assert log.read("sb-1", limit=2) == [_sized(3), _sized(4)]
    assert log.read("sb-1", limit=4) == [_sized(i) for i in range(1, 5)]
    assert log.read("sb-1") == [_sized(i) for i in range(5)]


def test_a_second_rotation_replaces_the_older_file(tmp_path: Path) -> None:
    line_bytes = len(audit._encode(_sized(0)))
    log = AuditLog(tmp_path, max_bytes=2 * line_bytes)
    for i in range(5):
        log.write("sb-1", _sized(i))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sb-1.jsonl", "sb-1.jsonl.1"]
    assert log.read("sb-1") == [_sized(2), _sized(3), _sized(4)]
    for path in tmp_path.iterdir():
        assert path.stat().st_size <= 2 * line_bytes


def test_lines_split_across_read_blocks_are_read_whole(tmp_path: Path) -> None:
    log = AuditLog(tmp_path, burst=400)
    events = [_event(i, reason="r" * (i * 37 % 3000)) for i in range(400)]
    for event in events:
        log.write("sb-1", event)
    assert (tmp_path / "sb-1.jsonl").stat().st_size > 8 * audit._BLOCK_BYTES
    assert log.read("sb-1", limit=150) == events[-150:]
    assert log.read("sb-1", limit=1000) == events


def test_read_reads_only_the_tail_of_a_large_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "sb-1.jsonl"
    path.write_bytes(audit._encode(_event(0)) * 30000)
    assert path.stat().st_size > 4 * 1024 * 1024
    read_bytes = []
    real_pread = os.pread

    def counting_pread(fd: int, length: int, offset: int) -> bytes:
        read_bytes.append(length)
        return real_pread(fd, length, offset)

    monkeypatch.setattr(os, "pread", counting_pread)
    assert len(AuditLog(tmp_path).read("sb-1", limit=10)) == 10
    assert sum(read_bytes) <= audit._BLOCK_BYTES


def test_negative_a_write_error_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "not-a-dir"
    root.write_text("")
    with caplog.at_level(logging.WARNING, logger="space.node.egress.audit"):
        AuditLog(root).write("sb-1", _event())
    assert "sb-1" in caplog.text
    assert root.read_text() == ""


def test_negative_an_event_that_does_not_serialize_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="space.node.egress.audit"):
        AuditLog(tmp_path).write("sb-1", dataclasses.replace(_event(0), time=float("nan")))
    assert "lost an event" in caplog.text
    assert not (tmp_path / "sb-1.jsonl").exists()


def test_negative_a_planted_symlink_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("precious\n")
    root = tmp_path / "audit"
    root.mkdir()
    (root / "sb-1.jsonl").symlink_to(target)
    log = AuditLog(root)
    log.write("sb-1", _event())
    assert target.read_text() == "precious\n"
    with pytest.raises(Unavailable) as info:
        log.read("sb-1")
    assert info.value.sandbox_id == "sb-1"


def test_negative_a_read_error_other_than_a_missing_file_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "sb-1.jsonl").mkdir()
    with pytest.raises(Unavailable):
        AuditLog(tmp_path).read("sb-1")


def test_remove_deletes_both_files_and_is_idempotent(tmp_path: Path) -> None:
    line_bytes = len(audit._encode(_sized(0)))
    log = AuditLog(tmp_path, max_bytes=line_bytes)
    log.write("sb-1", _sized(0))
    log.write("sb-1", _sized(1))
    log.write("sb-2", _sized(2))
    log.remove("sb-1")
    log.remove("sb-1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sb-2.jsonl"]
    assert log.read("sb-1") == []


@pytest.mark.parametrize(
    "sandbox_id", ["../escape", ".hidden", "a/b", "", "/abs", "x" * 64, "sb\n1", None, 7]
)
def test_negative_an_id_that_could_escape_the_root_is_refused(
    tmp_path: Path, sandbox_id: object
) -> None:
    root = tmp_path / "audit"
    log = AuditLog(root)
    with pytest.raises(InvalidArgument):
        log.write(sandbox_id, _event())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        log.read(sandbox_id)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        log.remove(sandbox_id)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("limit", [-1, MAX_READ_LIMIT + 1])
def test_negative_a_limit_out_of_range_is_refused(tmp_path: Path, limit: int) -> None:
    with pytest.raises(InvalidArgument, match="limit"):
        AuditLog(tmp_path).read("sb-1", limit=limit)


def test_negative_a_max_bytes_below_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="max_bytes"):
        AuditLog(tmp_path, max_bytes=0)


def test_negative_a_log_that_cannot_be_removed_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "sb-1.jsonl").mkdir()
    with pytest.raises(Unavailable) as info:
        AuditLog(tmp_path).remove("sb-1")
    assert info.value.sandbox_id == "sb-1"
    assert (tmp_path / "sb-1.jsonl").is_dir()


# -- the write budget (issue 17: a guest's DNS flood wrote 3.7 MB in 30 s) -------------


class _Clock:
    """Monotonic seconds that a test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _admitted(log: AuditLog, sandbox_id: str = "sb-1") -> list[EgressEvent]:
    return [e for e in log.read(sandbox_id, MAX_READ_LIMIT) if e.decision != DROP_DECISION]


def _drop_notes(log: AuditLog, sandbox_id: str = "sb-1") -> list[int]:
    """The counts the log's drop events state."""
    notes = [e for e in log.read(sandbox_id, MAX_READ_LIMIT) if e.decision == DROP_DECISION]
    assert all(e.protocol == "audit" for e in notes)
    return [int(e.reason.split()[0]) for e in notes]


def test_negative_a_flood_of_ten_thousand_events_in_a_second_keeps_burst_and_rate(
    tmp_path: Path,
) -> None:
    clock = _Clock()
    log = AuditLog(tmp_path, clock=clock)
    for i in range(10_000):
        clock.now = 1000.0 + i / 10_000  # 10,000 events over one second
        log.write("sb-1", _event(i))
    admitted = _admitted(log)
    assert len(admitted) <= DEFAULT_BURST + DEFAULT_RATE_PER_S
    assert admitted[:DEFAULT_BURST] == [_event(i) for i in range(DEFAULT_BURST)]
    clock.now += 2
    log.write("sb-1", _event(10_000))  # writing resumes: the drops are written first
    dropped = 10_000 - len(admitted)
    assert log.dropped("sb-1") == dropped == sum(_drop_notes(log))
    assert log.read("sb-1", 1) == [_event(10_000)]
    files = list(tmp_path.iterdir())
    assert sum(f.stat().st_size for f in files) < 100 * 1024  # not 3.7 MB
    assert log.dropped("sb-2") == 0


def test_a_sustained_flood_notes_its_drops_once_a_second(tmp_path: Path) -> None:
    clock = _Clock()
    log = AuditLog(tmp_path, clock=clock, rate_per_s=10, burst=10)
    for i in range(600 * 5):  # 600/s for 5 s, as probe 10's DNS flood
        clock.now = 1000.0 + i / 600
        log.write("sb-1", _event(i))
    assert 4 <= len(_drop_notes(log)) <= 6
    kept = len(_admitted(log))
    assert kept <= 10 + 10 * 5
    clock.now += 2
    log.write("sb-1", _event(0))
    assert log.dropped("sb-1") == sum(_drop_notes(log)) == 600 * 5 - kept


def test_events_within_the_rate_are_all_kept(tmp_path: Path) -> None:
    clock = _Clock()
    log = AuditLog(tmp_path, clock=clock)
    for i in range(1000):  # 40 a second, under the rate, for 25 s
        clock.now = 1000.0 + i / 40
        log.write("sb-1", _event(i))
    assert log.read("sb-1", 1000) == [_event(i) for i in range(1000)]
    assert log.dropped("sb-1") == 0
    assert not (tmp_path / "sb-1.dropped").exists()


def test_one_sandbox_flooding_leaves_anothers_budget_whole(tmp_path: Path) -> None:
    clock = _Clock()
    log = AuditLog(tmp_path, clock=clock)
    for i in range(5000):
        log.write("sb-a", _event(i))
    for i in range(DEFAULT_BURST):
        log.write("sb-b", _event(i))
    assert log.read("sb-b", MAX_READ_LIMIT) == [_event(i) for i in range(DEFAULT_BURST)]


def test_a_capped_flood_still_rotates_and_stays_under_twice_the_file_cap(tmp_path: Path) -> None:
    clock = _Clock()
    line_bytes = len(audit._encode(_sized(0)))
    log = AuditLog(tmp_path, clock=clock, max_bytes=50 * line_bytes, rate_per_s=20, burst=20)
    for i in range(60 * 200):  # 200/s for 60 s
        clock.now = 1000.0 + i / 200
        log.write("sb-1", _sized(i % 10))
    assert (tmp_path / "sb-1.jsonl.1").exists()
    for name in ("sb-1.jsonl", "sb-1.jsonl.1"):
        assert (tmp_path / name).stat().st_size <= 50 * line_bytes
    assert log.dropped("sb-1") > 0 and _drop_notes(log)


def test_the_drop_total_survives_a_new_writer(tmp_path: Path) -> None:
    clock = _Clock()
    first = AuditLog(tmp_path, clock=clock, rate_per_s=1, burst=1)
    for i in range(4):
        first.write("sb-1", _event(i))  # 1 kept, 3 dropped
    clock.now += 2
    first.write("sb-1", _event(4))
    assert first.dropped("sb-1") == 3
    second = AuditLog(tmp_path, clock=clock, rate_per_s=1, burst=1)  # a restarted gateway
    for i in range(3):
        second.write("sb-1", _event(i))  # 1 kept, 2 dropped
    clock.now += 2
    second.write("sb-1", _event(5))
    assert second.dropped("sb-1") == AuditLog(tmp_path).dropped("sb-1") == 5


def test_remove_deletes_the_drop_total_too(tmp_path: Path) -> None:
    clock = _Clock()
    log = AuditLog(tmp_path, clock=clock, rate_per_s=1, burst=1)
    for i in range(3):
        log.write("sb-1", _event(i))
    clock.now += 2
    log.write("sb-1", _event(3))
    assert log.dropped("sb-1") == 2
    log.remove("sb-1")
    assert list(tmp_path.iterdir()) == [] and log.dropped("sb-1") == 0


@pytest.mark.parametrize(("rate", "burst"), [(0, 10), (-1, 10), (10, 0)])
def test_negative_a_budget_that_admits_nothing_is_refused(
    tmp_path: Path, rate: float, burst: int
) -> None:
    with pytest.raises(InvalidArgument):
        AuditLog(tmp_path, rate_per_s=rate, burst=burst)
