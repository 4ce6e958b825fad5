"""``python -m space.cli``: the same as the ``space`` console script."""

from __future__ import annotations

from space.cli import main

main(prog_name="space")
