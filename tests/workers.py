"""Which pytest-xdist worker this process is: tests that need host-wide names or
addresses (tests/egress_world.py, tests/integration/hosts.py) give each worker its own."""

from __future__ import annotations

import os
import re


def xdist_worker() -> int:
    """This worker's number (``gw<N>``); 0 outside pytest-xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    found = re.fullmatch(r"gw(\d+)", name)
    return int(found.group(1)) if found else 0
