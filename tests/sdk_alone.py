"""A virtual environment holding only the base package (the SDK and client CLI).

The wheels come from ``.venv/sdk-wheels`` (scripts/setup.sh downloads the base
install's dependencies there), so the install needs no network; the project itself is
built from this checkout.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

__all__ = ["ROOT", "WHEELS", "make_sdk_venv"]

ROOT = Path(__file__).resolve().parents[1]
WHEELS = Path(sys.prefix) / "sdk-wheels"  # in the venv running the tests


def make_sdk_venv(directory: Path) -> Path:
    """A fresh venv in ``directory`` with the base package installed; its path."""
    if not WHEELS.is_dir():
        pytest.fail(f"{WHEELS} is missing: run scripts/setup.sh, which downloads the wheels")
    target = directory / "venv"
    venv.EnvBuilder(with_pip=True).create(target)
    subprocess.run(
        [target / "bin" / "pip", "install", "-q", "--no-index", "--find-links", WHEELS, ROOT],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return target
