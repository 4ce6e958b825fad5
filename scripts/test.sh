#!/usr/bin/env bash
# Sets everything up, then runs every gate: ruff (format + lint), mypy (strict), and the
# whole pytest suite (unit, security, and integration tests that boot real VMs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

echo "== ruff format --check"
.venv/bin/ruff format --check space tests bench
echo "== ruff check"
.venv/bin/ruff check space tests bench
echo "== mypy (strict on space/, check_untyped_defs on tests/ and bench/)"
.venv/bin/mypy
.venv/bin/mypy tests bench
echo "== pytest"
exec .venv/bin/pytest -q -p no:cacheprovider --durations=25 "$@"
