"""Suite-wide rules: tests that boot VMs need root, and fail loudly instead of skipping."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _vm_tests_need_root(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("vm") and os.geteuid() != 0:
        pytest.fail("this test boots QEMU VMs on a btrfs pool: run the suite as root")
