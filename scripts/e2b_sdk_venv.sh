#!/usr/bin/env bash
# Builds .venv-e2b, a virtualenv holding only the real E2B SDK at the pinned versions
# (scripts/e2b-sdk-requirements.txt), for tests/e2b_sdk.py. Needs no root: a git
# worktree sharing another checkout's .venv runs it to get its own. Rebuilt only when
# the pins change (their hash is the stamp).
set -euo pipefail
cd "$(dirname "$0")/.."

requirements=scripts/e2b-sdk-requirements.txt
stamp=".venv-e2b/.space-setup-$(sha256sum "$requirements" | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  printf '[setup %(%H:%M:%S)T] %s\n' -1 "creating .venv-e2b with the pinned E2B SDK" >&2
  rm -rf .venv-e2b
  /usr/bin/python3 -m venv .venv-e2b
  .venv-e2b/bin/pip install -q -r "$requirements"
  touch "$stamp"
fi
