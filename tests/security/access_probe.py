"""What a given uid may open: one probe for the local-user and gateway tests."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

_PROBE = """
import json, os, sys
found = {}
for path in json.load(sys.stdin):
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            os.listdir(path)
        else:
            os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW))
        found[path] = 0
    except OSError as exc:
        found[path] = exc.errno
print(json.dumps(found))
"""


def errnos_as(uid: int, gid: int, paths: list[str], *, cwd: Path | None = None) -> dict[str, int]:
    """Each of ``paths`` (listed if a directory, else opened) tried as ``uid``/``gid``
    with no groups: 0 if it worked, else the errno."""
    ids = [f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
    done = subprocess.run(
        ["setpriv", *ids, "--", "/usr/bin/python3", "-I", "-c", _PROBE],
        input=json.dumps(paths),
        capture_output=True,
        text=True,
        cwd=cwd,
        check=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    found: dict[str, int] = json.loads(done.stdout)
    return found
