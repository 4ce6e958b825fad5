"""NodeConfig refuses settings a node cannot run with, before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from space.node.api import InvalidArgument
from space.node.core.config import DEFAULT_APT_SOURCES, NodeConfig


def test_the_defaults_are_valid_and_fetch_from_the_guest_release() -> None:
    config = NodeConfig(data_dir=Path("/tmp/x"))
    assert (config.warm_pool_min, config.warm_pool_max, config.max_parallel_starts) == (0, 0, 4)
    assert config.apt_sources == DEFAULT_APT_SOURCES
    assert all(" bookworm" in line for line in DEFAULT_APT_SOURCES)


def test_a_pool_of_equal_bounds_is_valid() -> None:
    config = NodeConfig(data_dir=Path("/tmp/x"), warm_pool_min=3, warm_pool_max=3)
    assert config.warm_pool_max == 3


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"warm_pool_min": 2, "warm_pool_max": 1}, "warm_pool_max"),
        ({"warm_pool_min": -1}, "warm_pool_min"),
        ({"max_parallel_starts": 0}, "max_parallel_starts"),
        ({"max_sandboxes": 0}, "max_sandboxes"),
        ({"max_sandboxes": 2.5}, "max_sandboxes"),
        ({"apt_sources": ("http://deb.debian.org/debian bookworm main",)}, "apt_sources"),
    ],
)
def test_negative_a_setting_out_of_range_is_refused_naming_it(
    changes: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidArgument, match=named):
        NodeConfig(data_dir=Path("/tmp/x"), **changes)
