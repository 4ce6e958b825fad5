"""Benchmark of the artifact store's round trip of a hibernated sandbox (issue 19).

Starts two Nodes sharing a node key and a filesystem artifact store in a temporary
directory (tests/integration/moves_nodes.py), and ``--runs`` times: hibernates a 256 MiB
sandbox (a file written, a background process running) on the source, uploads it
(``archive_sandbox``: a read-only snapshot, the full btrfs send stream and its
description, each object sealed under its own data key, the manifest last) and imports
it on the target from the store alone (``import_archive``: the bundle checked, the stream
received in staging by the root broker, the sandbox registered hibernated). Prints the
median and p90 of each, the bundle's stored bytes, and the wake on the target of the
last one. Beside it, for scale, the same sandbox's direct move (full stream) is in
bench/bench_move.py. Everything is removed at the end, also on failure.
Usage: `PYTHONPATH=. .venv/bin/python bench/bench_archive.py [--runs 5]` as root.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench._stats import summary
from bench.bench_move import hibernated_sandbox
from space.node.core.config import ArtifactStoreConfig
from tests.integration.moves_nodes import two_nodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-archive-") as tmp:
        store_dir = Path(tmp) / "store"
        store = ArtifactStoreConfig(kind="fs", path=store_dir)
        with two_nodes(Path(tmp) / "cluster", store) as nodes:
            uploads, imports, stored = [], [], []
            for i in range(args.runs):
                sid = f"bench-archive-{i}"
                hibernated_sandbox(nodes, sid)
                start = time.monotonic()
                archive = nodes.run(nodes.source.archive_sandbox(sid)).archive
                uploads.append(time.monotonic() - start)
                assert archive is not None
                stored.append(
                    sum(p.stat().st_size for p in (store_dir / archive).rglob("*") if p.is_file())
                )
                start = time.monotonic()
                nodes.run(nodes.target.import_archive(sid, archive))
                imports.append(time.monotonic() - start)
                nodes.run(nodes.source.delete_sandbox(sid))
                nodes.run(nodes.source.delete_archive(archive))
                if i < args.runs - 1:
                    nodes.run(nodes.target.delete_sandbox(sid))
            start = time.monotonic()
            nodes.run(nodes.target.resume_sandbox(f"bench-archive-{args.runs - 1}"))
            wake_s = time.monotonic() - start
            print(summary("upload to the store (archive)", uploads, "s"))
            print(summary("import from the store", imports, "s"))
            print(f"{'bundle bytes stored':<34} median {sorted(stored)[len(stored) // 2]:,}")
            print(f"{'wake on the target (last import)':<34} {wake_s:.2f} s")
            for status in nodes.run(nodes.target.list_sandboxes()):
                nodes.run(nodes.target.delete_sandbox(status.sandbox_id))
    sys.exit(0)


if __name__ == "__main__":
    main()
