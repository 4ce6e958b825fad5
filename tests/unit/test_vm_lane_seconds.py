"""tests/vm_lane_seconds.json, by which the VM lane hands out its longest groups first
(tests/conftest.py), names only groups that exist: one renamed would fall back to a guess
from its count of tests without a word."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import GROUP_SECONDS
from tests.integration.test_conformance import _PARTS

ROOT = Path(__file__).resolve().parents[2]


def test_every_group_of_the_table_is_a_test_file_or_a_part_of_the_matrix() -> None:
    table = json.loads(GROUP_SECONDS.read_text())
    parts = {f"conformance-{part}" for part in _PARTS.values()}
    assert table, "the table is empty: every group would be guessed"
    for group, row in table.items():
        assert group in parts or (ROOT / group).is_file(), f"{group} is no group of the lane"
        assert row["s"] > 0 and row["tests"] >= 1, group
