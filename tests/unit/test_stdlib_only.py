"""space.protocol and space.guest run on the guest's own python3: stdlib imports only."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "space"
MODULES = sorted([*(ROOT / "protocol").rglob("*.py"), *(ROOT / "guest").rglob("*.py")])
ALLOWED_OWN = ("space.protocol", "space.guest")


def imported_modules(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_there_are_guest_and_protocol_modules_to_check() -> None:
    assert any(p.parent.name == "guest" for p in MODULES)
    assert any(p.parent.name == "protocol" for p in MODULES)


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_module_imports_only_the_stdlib_or_its_own_packages(path: Path) -> None:
    foreign = [
        name
        for name in imported_modules(path)
        if name.split(".")[0] not in sys.stdlib_module_names
        and name != "space"
        and not name.startswith(ALLOWED_OWN)
    ]
    assert foreign == []
