"""A benchmark's node run the way ``space serve`` runs it: a child process of the same
script starts the root broker and drops to the node agent's user, prints its figures as
JSON, and the parent (root) releases the data dir whatever the child did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.integration.conftest import release_data_dir

__all__ = ["node_child"]


@contextmanager
def node_child(
    script: str, runs: int, user: str, prefix: str, extra: Sequence[str] = ()
) -> Iterator[tuple[Path, Any]]:
    """Run ``script --runs --user [extra] --data-dir`` and yield a scratch directory
    (removed after the block) and the child's figures. The data dir is inside the scratch dir,
    which the agent's user may search."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        os.chmod(tmp, 0o711)  # the node agent's user reaches its data dir
        data_dir = Path(tmp) / "data"
        command = [sys.executable, script, f"--runs={runs}", f"--user={user}", *extra]
        try:
            child = subprocess.run(
                [*command, f"--data-dir={data_dir}"], stdout=subprocess.PIPE, check=True
            )
        finally:
            leaked = release_data_dir(data_dir)
            if leaked:
                print(f"cleaned up leftovers: {leaked}", file=sys.stderr)
        yield Path(tmp), json.loads(child.stdout)
