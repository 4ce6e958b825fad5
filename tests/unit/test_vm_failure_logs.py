"""A failed VM test's report carries the tails of its logs (tests/logs.py and the hook in
tests/conftest.py), bounded, and only for ``vm`` tests that failed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import logs

pytest_plugins = ["pytester"]

INNER_TESTS = """
from pathlib import Path

import pytest

from tests import logs


def _node(tmp_path: Path) -> None:
    data, run = tmp_path / "node", tmp_path / "run"
    (data / "sandboxes").mkdir(parents=True)
    (run / "sb-1").mkdir(parents=True)
    lines = [f"console line {i}" for i in range(100)]
    (data / "sandboxes" / "sb-1.console.log").write_text("\\n".join(lines) + "\\n")
    (run / "sb-1" / "qemu.log").write_text("qemu: could not open disk\\n")
    (data / "serve.log").write_text("serve: listening\\n")
    logs.register(data, run)


@pytest.mark.vm
def test_vm_fails(tmp_path: Path) -> None:
    _node(tmp_path)
    assert False, "the VM did not boot"


@pytest.mark.vm
def test_vm_passes(tmp_path: Path) -> None:
    _node(tmp_path)


def test_unmarked_fails(tmp_path: Path) -> None:
    _node(tmp_path)
    assert False
"""


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[Path, Path | None]:
    """An empty registry for this test only (the inner runs are in-process)."""
    empty: dict[Path, Path | None] = {}
    monkeypatch.setattr(logs, "_REGISTERED", empty)
    return empty


def _sections_by_test(pytester: pytest.Pytester) -> dict[str, list[tuple[str, str]]]:
    pytester.makeini("[pytest]\nmarkers =\n    vm: boots VMs\n")
    # The suite's hooks, without its autouse fixtures.
    pytester.makeconftest(
        "from tests.conftest import pytest_runtest_makereport, pytest_runtest_setup"
    )
    pytester.makepyfile(test_inner=INNER_TESTS)
    recorder = pytester.inline_run("-p", "no:cacheprovider")
    sections: dict[str, list[tuple[str, str]]] = {}
    for report in recorder.getreports("pytest_runtest_logreport"):
        found = [(title, text) for title, text in report.sections if title.startswith("log ")]
        sections.setdefault(report.nodeid.rpartition("::")[2], []).extend(found)
    return sections


def test_a_failed_vm_test_reports_the_tails_of_console_qemu_and_serve_logs(
    pytester: pytest.Pytester, registry: dict[Path, Path | None]
) -> None:
    by_title = dict(_sections_by_test(pytester)["test_vm_fails"])
    console = next(text for title, text in by_title.items() if title.endswith("sb-1.console.log"))
    qemu = next(text for title, text in by_title.items() if title.endswith("sb-1/qemu.log"))
    serve = next(text for title, text in by_title.items() if title.endswith("serve.log"))
    assert console.splitlines() == [f"console line {i}" for i in range(40, 100)]
    assert (qemu, serve) == ("qemu: could not open disk", "serve: listening")


def test_negative_a_passing_vm_test_and_a_failed_unmarked_test_get_no_logs(
    pytester: pytest.Pytester, registry: dict[Path, Path | None]
) -> None:
    sections = _sections_by_test(pytester)
    assert sections["test_vm_passes"] == [] and sections["test_unmarked_fails"] == []
    assert sections["test_vm_fails"] != []


def test_a_tail_reads_at_most_its_byte_limit_and_drops_the_cut_first_line(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    log.write_bytes(b"x" * 10_000 + b"\nlast but one\nlast\n")
    assert logs.tail(log, lines=60, max_bytes=100) == "last but one\nlast"
    assert logs.tail(log, lines=1) == "last"
    assert len(logs.tail(log).encode()) <= logs.TAIL_BYTES
    assert logs.tail(tmp_path / "gone.log").startswith("(unreadable:")


def test_only_logs_changed_since_the_test_began_are_shown_newest_first(tmp_path: Path) -> None:
    data, run = tmp_path / "node", tmp_path / "run"
    (data / "sandboxes").mkdir(parents=True)
    for i in range(logs.MAX_FILES + 3):
        (data / "sandboxes" / f"sb-{i:02}.console.log").write_text(f"sandbox {i}\n")
    old = data / "sandboxes" / "sb-00.console.log"
    os.utime(old, (1_000_000, 1_000_000))
    for i in range(1, logs.MAX_FILES + 3):  # distinct mtimes: sb-14 is the newest
        os.utime(data / "sandboxes" / f"sb-{i:02}.console.log", (2e9 + i, 2e9 + i))
    sections = logs.failure_sections(since=1e9, dirs=[(data, run)])
    assert len(sections) == logs.MAX_FILES
    assert sections[0] == (f"log {data / 'sandboxes' / 'sb-14.console.log'}", "sandbox 14")
    assert all("sb-00" not in title for title, _ in sections)
