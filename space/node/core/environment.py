"""The environment every child process the platform starts gets: explicit and minimal.

Never the server's own ``os.environ``: it may hold SPACE_MASTER_KEY (docs/security.md)
or an operator's credentials, and whatever a child inherits it can leak (a QEMU's
/proc/PID/environ, a package script's log). Issue 18: "every child process starts from
an explicit, minimal environment".
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CHILD_PATH", "child_environment", "python_environment"]

#: The search path of every child: system directories only, never the caller's PATH.
CHILD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def child_environment(**extra: str) -> dict[str, str]:
    """A fresh environment: PATH (CHILD_PATH), LANG=C.UTF-8, then ``extra`` (which wins).

    A new dict on every call, so callers may add to it.
    """
    return {"PATH": CHILD_PATH, "LANG": "C.UTF-8", **extra}


def python_environment(**extra: str) -> dict[str, str]:
    """child_environment() for a Python child that runs the node's own code (the root
    broker, the egress gateway): PYTHONPATH names where this very ``space`` package was
    imported from, so it runs the node's code even from a source tree or an editable
    install."""
    package_root = Path(__file__).resolve().parents[3]
    return child_environment(PYTHONPATH=str(package_root), PYTHONUNBUFFERED="1", **extra)
