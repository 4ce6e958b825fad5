"""NodeConfig refuses settings a node cannot run with, before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from space.node.api import InvalidArgument
from space.node.core.capacity import Policy
from space.node.core.config import DEFAULT_APT_SOURCES, NodeConfig


def test_the_defaults_are_valid_and_fetch_from_the_guest_release() -> None:
    config = NodeConfig(data_dir=Path("/tmp/x"))
    assert (config.warm_pool_min, config.warm_pool_max, config.max_parallel_starts) == (0, 0, 4)
    assert (config.build_slots, config.queued_builds_per_tenant) == (2, 4)
    assert config.apt_sources == DEFAULT_APT_SOURCES
    assert all(" bookworm" in line for line in DEFAULT_APT_SOURCES)


def test_admission_is_by_capacity_with_no_cap_on_sandboxes_unless_the_operator_sets_one() -> None:
    config = NodeConfig(data_dir=Path("/tmp/x"))
    assert config.max_sandboxes is None
    assert config.capacity == Policy()  # reserves relative to the host, overcommit 2.0
    assert config.capacity.memory_overcommit == 2.0
    chosen = NodeConfig(
        data_dir=Path("/tmp/x"),
        max_sandboxes=1,
        memory_reserve_mib=0,
        memory_overcommit=0.5,
        pool_reserve_mib=0,
    )
    assert chosen.capacity == Policy(
        memory_reserve_mib=0, memory_overcommit=0.5, pool_reserve_mib=0, max_sandboxes=1
    )


def test_a_pool_of_equal_bounds_is_valid() -> None:
    config = NodeConfig(data_dir=Path("/tmp/x"), warm_pool_min=3, warm_pool_max=3)
    assert config.warm_pool_max == 3


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"warm_pool_min": 2, "warm_pool_max": 1}, "warm_pool_max"),
        ({"warm_pool_min": -1}, "warm_pool_min"),
        ({"max_parallel_starts": 0}, "max_parallel_starts"),
        ({"build_slots": 0}, "build_slots"),
        ({"queued_builds_per_tenant": -1}, "queued_builds_per_tenant"),
        ({"max_sandboxes": 0}, "max_sandboxes"),
        ({"max_sandboxes": 2.5}, "max_sandboxes"),
        ({"max_sandboxes": True}, "max_sandboxes"),
        ({"memory_reserve_mib": -1}, "memory_reserve_mib"),
        ({"pool_reserve_mib": 1.5}, "pool_reserve_mib"),
        ({"memory_overcommit": 0}, "memory_overcommit"),
        ({"memory_overcommit": -1.0}, "memory_overcommit"),
        ({"memory_overcommit": 101}, "memory_overcommit"),
        ({"memory_overcommit": float("nan")}, "memory_overcommit"),
        ({"memory_overcommit": "2"}, "memory_overcommit"),
        ({"apt_sources": ("http://deb.debian.org/debian bookworm main",)}, "apt_sources"),
    ],
)
def test_negative_a_setting_out_of_range_is_refused_naming_it(
    changes: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidArgument, match=named):
        NodeConfig(data_dir=Path("/tmp/x"), **changes)
