"""Every module imported under space/ is declared in the install shape that needs it.

The client side (the SDK, the client CLI, ``space/__init__.py``, ``space/limits.py`` and
the protocol) must be covered by the base ``dependencies``: that is all an SDK-only
install gets (tests/unit/test_sdk_alone.py). Everything else may also use the ``server``
extra. The CLI's server commands (space/cli/_server.py) import the server inside their
functions, behind the "pip install 'space[server]'" message: those imports count as
server. Import names map to distributions through the environment running the tests
(``importlib.metadata.packages_distributions``), so a module no installed distribution
provides is undeclared too.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "space"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CLIENT = ("sdk", "cli", "__init__.py", "limits.py", "protocol")
#: Client files whose function bodies may import the server (guarded, see above).
SERVER_COMMANDS = ("cli/_server.py",)


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def declared(extra: str | None) -> set[str]:
    """The distribution names (normalised) of the base install, or of one extra."""
    specs = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
    return {_normal(Requirement(spec).name) for spec in specs}


def imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level name, inside a function) of every absolute import in ``path``."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name.split(".")[0], in_function) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], in_function))
        inside = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def undeclared(
    paths: Iterable[Path],
    root: Path,
    base: set[str],
    server: set[str],
    providers: Mapping[str, list[str]],
) -> list[str]:
    """``path: module`` for every third-party import no declared distribution provides."""
    problems = []
    for path in paths:
        relative = path.relative_to(root).as_posix()
        client = relative.startswith(CLIENT)
        for name, in_function in imports(path):
            if name in sys.stdlib_module_names or name == "space":
                continue
            allowed = (
                base
                if client and not (in_function and relative in SERVER_COMMANDS)
                else {
                    *base,
                    *server,
                }
            )
            if not {_normal(d) for d in providers.get(name, [])} & allowed:
                problems.append(f"{relative}: {name}")
    return sorted(set(problems))


def _check(paths: Iterable[Path], root: Path = PACKAGE) -> list[str]:
    return undeclared(
        paths,
        root,
        declared(None),
        declared("server"),
        importlib.metadata.packages_distributions(),
    )


def test_every_module_imported_under_space_is_declared_where_it_is_needed() -> None:
    assert _check(sorted(PACKAGE.rglob("*.py"))) == []


def test_the_walk_sees_the_imports_it_is_meant_to_check() -> None:
    found = {name for path in PACKAGE.rglob("*.py") for name, _ in imports(path)}
    assert {"httpx", "click", "fastapi", "cryptography", "OpenSSL", "dns", "tomli_w"} <= found


def test_negative_an_undeclared_import_is_flagged(tmp_path: Path) -> None:
    (tmp_path / "node").mkdir()
    (tmp_path / "node" / "thing.py").write_text("import hypothesis\nimport os\n")
    (tmp_path / "sdk").mkdir()
    (tmp_path / "sdk" / "thing.py").write_text(
        "from fastapi import FastAPI\nimport httpx\n\ndef f():\n    import no_such_module_x\n"
    )
    paths = sorted(tmp_path.rglob("*.py"))
    assert _check(paths, tmp_path) == [
        "node/thing.py: hypothesis",  # installed (dev), but no install shape declares it
        "sdk/thing.py: fastapi",  # declared, but only in the server extra
        "sdk/thing.py: no_such_module_x",  # no distribution provides it
    ]


def test_negative_only_the_server_commands_may_import_the_server_lazily(tmp_path: Path) -> None:
    (tmp_path / "cli").mkdir()
    body = "import click\n\ndef serve():\n    import uvicorn\n"
    (tmp_path / "cli" / "_server.py").write_text(body)
    (tmp_path / "cli" / "_other.py").write_text(body)
    (tmp_path / "cli" / "_top.py").write_text("import uvicorn\n")
    paths = sorted(tmp_path.rglob("*.py"))
    assert _check(paths, tmp_path) == ["cli/_other.py: uvicorn", "cli/_top.py: uvicorn"]


def test_every_declared_dependency_has_a_floor_the_installed_version_meets() -> None:
    for spec in [*PROJECT["dependencies"], *PROJECT["optional-dependencies"]["server"]]:
        requirement = Requirement(spec)
        floors = [s for s in requirement.specifier if s.operator in (">=", "==")]
        if requirement.name == "httpcore":
            continue  # only a cap, for mitmproxy's h11 pin (see pyproject.toml)
        assert floors, f"{spec}: no floor"
        installed = Version(importlib.metadata.version(requirement.name))
        assert requirement.specifier.contains(installed, prereleases=True), spec


def test_the_server_extra_names_psycopg_3() -> None:
    # SQLAlchemy imports the driver, so the import scan above cannot see it (issue 19).
    server = [Requirement(spec) for spec in PROJECT["optional-dependencies"]["server"]]
    (requirement,) = [r for r in server if r.name == "psycopg"]
    assert (requirement.name, requirement.extras) == ("psycopg", {"binary"})
    assert not requirement.specifier.contains("2.9") and requirement.specifier.contains("3.3.9")


def test_the_artifact_store_s_s3_client_and_test_server_are_declared() -> None:
    # boto3 is imported lazily (only a node with an S3 store loads it), and moto runs as
    # a server process the tests start: name both outright (issue 19).
    extras = PROJECT["optional-dependencies"]
    assert {"boto3", "botocore"} <= declared("server")
    (moto,) = [Requirement(spec) for spec in extras["dev"] if Requirement(spec).name == "moto"]
    assert moto.extras == {"server"} and moto.specifier.contains("5.2.5")
