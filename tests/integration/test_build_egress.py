"""Template builds that reach the network through the spec's ``build_egress`` policy.

A node resolving through the test's own little internet (tests/egress_world.py) builds
templates whose run steps fetch from it. A step reaches what the policy allows, over
verified HTTPS, and nothing else; the build's CA is gone from the template it made;
without a policy a build has no network at all.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from space.node.agent._build_network import OFFLINE_HINT
from space.node.api import BuildFailed, SandboxSpec
from space.node.core.config import NodeConfig
from space.node.network.trust import BUNDLE, CA_FILE

from ..egress_guest import RECORDS
from ..egress_world import World, egress_world
from .conftest import NodeHarness, started_node
from .test_lifecycle import _sh
from .test_templates import _build, _built, _context, _logs, _removing_templates

pytestmark = pytest.mark.vm


@dataclass
class Built:
    h: NodeHarness
    world: World


@pytest.fixture(scope="module")
def built(node_config: NodeConfig) -> Iterator[Built]:
    with egress_world() as world:
        world.records.update(RECORDS)
        config = replace(
            node_config, egress_resolvers=(world.resolver,), egress_upstream_ca=world.upstream_ca
        )
        with started_node(config) as harness, _removing_templates(harness):
            yield Built(harness, world)


_FETCH = (
    'python3 -c "import urllib.request as u; '
    "print(u.urlopen('{url}', timeout=20).read().decode())\""
)
_CERTS = f"grep -c 'BEGIN CERTIFICATE' {BUNDLE}"


def _spec(steps: list[str], *, name: str, egress: str = "") -> str:
    runs = "".join(f"\n[[steps]]\nrun = '''{cmd}'''\n" for cmd in steps)
    head = textwrap.dedent(f"""\
        name = "{name}"
        base = "debian:bookworm"
        start = "sh /opt/app/server.sh"

        [[steps]]
        copy = {{ src = "app", dst = "/opt/app" }}
        """)
    return head + (f"\n[build_egress]\n{egress}\n" if egress else "") + runs


_ALLOW_TLS = 'allow = [{ domain = "tls.allowed.test", ports = [443] }]'


def test_a_run_step_fetches_what_build_egress_allows_and_the_template_keeps_no_ca(
    built: Built, tmp_path: Path
) -> None:
    h = built.h
    steps = [
        _FETCH.format(url="https://tls.allowed.test/") + " > /opt/fetched",
        f"{_CERTS} > /opt/during",
        # Copies every CA of /usr/local/share, the build's too, into the bundle.
        "update-ca-certificates",
    ]
    spec = _spec(steps, name="fetcher", egress=_ALLOW_TLS)
    events = h.run(_build(h.node, _context(tmp_path, spec)))
    _built(events)
    assert any("through the build's egress policy" in line for line in _logs(events))
    assert any(hit.host == "tls.allowed.test" for hit in built.world.hits_of("tls"))

    h.run(h.node.create_sandbox(SandboxSpec("from-fetcher", template="fetcher")))
    try:
        assert "tls host=tls.allowed.test" in _sh(h, "from-fetcher", "cat /opt/fetched")
        during = int(_sh(h, "from-fetcher", "cat /opt/during"))
        assert int(_sh(h, "from-fetcher", _CERTS)) == during - 1, "the build CA is still trusted"
        leftovers = f"ls {CA_FILE} /etc/ssl/certs/space-egress.pem; grep -c SPACE {BUNDLE}"
        assert _sh(h, "from-fetcher", f"{leftovers} 2>/dev/null || true") == "0"
    finally:
        h.run(h.node.delete_sandbox("from-fetcher"))


def test_negative_a_step_reaching_past_build_egress_fails_and_names_the_refusal(
    built: Built, tmp_path: Path
) -> None:
    h = built.h
    before = len(built.world.hits_of("upstream"))
    steps = [_FETCH.format(url="http://tls.allowed.test/")]  # port 80: not allowed
    spec = _spec(steps, name="past", egress=_ALLOW_TLS)
    events = h.run(_build(h.node, _context(tmp_path, spec)))
    outcome = events[-1]
    assert isinstance(outcome, BuildFailed), outcome
    assert "the build's egress policy refused: tls.allowed.test:80" in outcome.message
    assert any(line.startswith("egress refused tls.allowed.test:80") for line in _logs(events))
    assert len(built.world.hits_of("upstream")) == before


def test_negative_without_build_egress_a_build_has_no_network(built: Built, tmp_path: Path) -> None:
    h = built.h
    hits, asked = len(built.world.hits), len(built.world.asked)
    steps = [_FETCH.format(url="https://tls.allowed.test/")]
    events = h.run(_build(h.node, _context(tmp_path, _spec(steps, name="offline"))))
    outcome = events[-1]
    assert isinstance(outcome, BuildFailed), outcome
    assert "urlopen error" in outcome.message  # the guest's own error: no network
    assert "egress policy refused" not in outcome.message
    assert OFFLINE_HINT in outcome.message and OFFLINE_HINT in _logs(events)
    assert len(built.world.hits) == hits
    assert len(built.world.asked) == asked
