"""The embedded platform for benchmarks: tests/integration/platform.py's ``Platform``
(`space serve` in a subprocess), with a teardown that removes what it left instead of
asserting nothing was left.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from space.limits import QUOTAS
from tests.integration.conftest import release_data_dir
from tests.integration.platform import SPACE, Platform, release

__all__ = ["Api", "embedded_platform", "say"]

_START_S = time.monotonic()


def say(message: str) -> None:
    """A progress line on stderr, stamped with the seconds since this module was loaded."""
    print(f"[{time.monotonic() - _START_S:7.1f} s] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Api:
    url: str
    key: str
    data_dir: Path


_TENANT = "bench"
#: Benchmarks measure the node (bench_fill --admit fills it until the node refuses), not
#: a tenant's quotas (issue 17): the bench tenant's limits are lifted past any node.
_NO_LIMIT = str(1 << 40)


def _lift_quotas(data_dir: Path) -> None:
    options = [arg for quota in QUOTAS for arg in (quota.option, _NO_LIMIT)]
    subprocess.run(
        [*SPACE, "quota", "set", "--tenant", _TENANT, *options, "--data-dir", str(data_dir)],
        check=True,
        capture_output=True,
        timeout=60,
    )


@contextlib.contextmanager
def embedded_platform(data_dir: Path, extra_args: Sequence[str] = ()) -> Iterator[Api]:
    """`space serve` on a fresh ``data_dir``. On exit, also on failure, the server is
    stopped and whatever it left under ``data_dir`` is removed (QEMUs, egress gateways,
    network namespaces, mounts, loop devices); leftovers are named on stderr. Sandboxes
    should be deleted through the API before: the server leaves VMs running when it
    stops. ``extra_args`` are more `space serve` options."""
    data_dir.mkdir(parents=True)
    # --release-pool: unmount the pool on exit when no VM is left (sandboxes deleted).
    platform = Platform(data_dir, extra_args=["--release-pool", *extra_args])
    try:
        platform.start()
        key = platform.create_key(_TENANT)
        _lift_quotas(data_dir)
        yield Api(platform.url, key, data_dir)
    except BaseException:
        say("failed; the end of serve.log:\n" + platform.log_tail())
        raise
    finally:
        platform.stop()
        leaked = release_data_dir(data_dir) + release(data_dir)
        if leaked:
            say(f"removed what the platform left: {leaked}")
