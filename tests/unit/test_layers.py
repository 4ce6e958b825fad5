"""Each layer imports only what its seam allows (ARCHITECTURE.md), checked with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "space"

# Which space.* modules each layer may import, as prefixes.
ALLOWED: dict[str, tuple[str, ...]] = {
    "protocol": ("space.protocol",),
    "guest": ("space.guest", "space.protocol"),
    "node": ("space.node", "space.protocol", "space.limits", "space.keyfile"),
    # The control plane reaches a node only through the node's contract and the HTTP
    # client of a remote node (ARCHITECTURE.md).
    "control": (
        "space.control",
        "space.node.api",
        "space.node.http.client",
        "space.limits",
        "space.keyfile",
    ),
    "sdk": ("space.sdk", "space.limits"),
}


@pytest.mark.parametrize("shared", ["limits.py", "keyfile.py"])
def test_the_modules_layers_share_import_nothing_of_space(shared: str) -> None:
    # More than one layer imports each, so it may import no layer.
    assert space_imports(PACKAGE / shared) == set()


def space_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return {name for name in found if name == "space" or name.startswith("space.")}


def allowed(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_through_its_seams(layer: str) -> None:
    modules = sorted((PACKAGE / layer).rglob("*.py"))
    assert modules, f"no modules found for layer {layer}"
    offending = {
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in modules
        for name in space_imports(path)
        if not allowed(name, ALLOWED[layer])
    }
    assert offending == set()


def test_negative_the_checker_notices_a_cross_layer_import(tmp_path: Path) -> None:
    module = tmp_path / "bad.py"
    module.write_text(
        "from space.node.agent import Node\nfrom space.node.api import NodeService\nimport os\n"
    )
    names = space_imports(module)
    assert names == {"space.node.agent", "space.node.api"}
    assert not allowed("space.node.agent", ALLOWED["control"])
    assert allowed("space.node.api", ALLOWED["control"])
    # A sibling whose name merely starts like an allowed one is no way in either.
    assert not allowed("space.node.api_private", ALLOWED["control"])
    assert not allowed("space.node.http.server", ALLOWED["control"])


def test_benchmarks_import_only_public_modules() -> None:
    bench = PACKAGE.parent / "bench"
    offending = {
        f"{path.name}: {name}"
        for path in sorted(bench.glob("*.py"))
        for name in space_imports(path)
        if any(part.startswith("_") for part in name.split("."))
    }
    assert offending == set()


#: What runs as root inside the root broker's process only; the node agent asks
#: through space.node.privileged's client and request set.
ROOT_ONLY = (
    "space.node.privileged.server",
    "space.node.privileged._storage",
    "space.node.privileged._network",
    "space.node.privileged._jails",
    "space.node.privileged._gateway",
    "space.node.privileged._gvisor_tree",
    "space.node.privileged.cgroups",
    "space.node.privileged.netns_socket",
)


def test_nothing_outside_the_root_broker_imports_what_runs_as_root() -> None:
    privileged = PACKAGE / "node" / "privileged"
    offending = {
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if not path.is_relative_to(privileged)
        for name in space_imports(path)
        if allowed(name, ROOT_ONLY)
    }
    assert offending == set()
