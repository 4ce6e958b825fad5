"""spaced, the space daemon that runs inside every guest (stdlib only).

It speaks docs/protocol.md on one byte stream: the virtio-serial port ``space.agent``
in a VM, or stdin/stdout for a process-level guest in tests. ``init`` is the PID 1 that
starts it; ``python3 -m space.guest`` runs the daemon itself.
"""

AGENT_VERSION = "0.1.0"
AGENT = f"spaced/{AGENT_VERSION}"
