"""spaced, the space daemon that runs inside every guest (stdlib only).

It speaks docs/protocol.md on one byte stream: the virtio-serial port ``space.agent``
in a VM, or stdin/stdout for a process-level guest in tests. ``init`` is the PID 1 that
starts it; ``python3 -m space.guest`` runs the daemon itself.
"""

import os

#: The directory holding the ``space`` package spaced runs from: the PYTHONPATH of the
#: processes that import it again (spaced from init, a spawner helper from spaced).
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

AGENT_VERSION = "0.1.0"
AGENT = f"spaced/{AGENT_VERSION}"
