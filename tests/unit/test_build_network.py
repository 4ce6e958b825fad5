"""The hint a failed run step gets when its build has no network."""

from __future__ import annotations

from pathlib import Path

import pytest

from space.node.agent._build_network import OFFLINE_HINT, BuildNetwork
from space.node.egress.audit import AuditLog

OFFLINE_OUTPUTS = [
    "urllib.error.URLError: <urlopen error [Errno -3] Temporary failure in name resolution>",
    "curl: (6) Could not resolve host: pypi.org",
    "WARNING: Retrying ... Failed to establish a new connection: [Errno 101] Network is "
    "unreachable",
    "npm ERR! getaddrinfo EAI_AGAIN registry.npmjs.org",
    "fatal: unable to access 'https://github.com/x/y/': Could not resolve host: github.com",
]


@pytest.mark.parametrize("output", OFFLINE_OUTPUTS)
def test_a_step_that_tried_the_network_in_an_offline_build_gets_the_hint(
    tmp_path: Path, output: str
) -> None:
    network = BuildNetwork("build-1", None, AuditLog(tmp_path))
    assert network.offline_hint(f"step 2 (abc, run) exited with code 1; last output:\n{output}")
    assert network.offline_hint(output) == OFFLINE_HINT


def test_negative_other_failures_and_builds_with_a_policy_get_no_hint(tmp_path: Path) -> None:
    offline = BuildNetwork("build-1", None, AuditLog(tmp_path))
    assert offline.offline_hint("make: *** [all] Error 2") is None
    online = BuildNetwork("build-1", tmp_path / "ca.pem", AuditLog(tmp_path))
    assert online.offline_hint(OFFLINE_OUTPUTS[0]) is None
