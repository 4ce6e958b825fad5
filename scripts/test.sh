#!/usr/bin/env bash
# Sets everything up, then runs every gate: ruff (format + lint), mypy (strict), and the
# whole pytest suite (unit, security, and integration tests that boot real VMs) in two
# lanes: the fast one on two workers, then the VM one (three workers, then its solo tests
# alone).
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
pytest=(.venv/bin/pytest -q -p no:cacheprovider --durations=25)
if [ $# -gt 0 ]; then  # what to run was given: one run of exactly that
  echo "== pytest $*"
  exec "${pytest[@]}" "$@"
fi
# Two lanes, one after the other, each run to its end whatever the other did. The fast
# lane (two workers) is CPU alone; the VM lane's workers also wait on guests, so a third
# fills the cores (1189 s against 1373 s on two). The fast lane's tests share no names,
# ports or directories. The VM lane's share none either (host-wide addresses are the
# worker's own: tests/workers.py); it hands out groups (--dist loadgroup,
# tests/conftest.py): a whole file, so a module's shared VM boots once, or a part of
# the conformance matrix; the longest first, by tests/vm_lane_seconds.json.
echo "== pytest: the fast lane (-m 'not vm', two workers)"
fast=0
"${pytest[@]}" -m "not vm" -n 2 || fast=$?
echo "== pytest: the VM lane (-m 'vm and not solo', three workers)"
vm=0
"${pytest[@]}" -m "vm and not solo" -n 3 --dist loadgroup || vm=$?
echo "== pytest: the VM lane's solo tests (-m 'vm and solo', alone: a hundred VMs, a pace)"
solo=0
"${pytest[@]}" -m "vm and solo" || solo=$?
echo "== fast lane exit $fast, VM lane exit $vm, solo exit $solo"
for code in "$fast" "$vm" "$solo"; do
  if [ "$code" -ne 0 ]; then exit "$code"; fi
done
