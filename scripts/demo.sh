#!/usr/bin/env bash
# Sets everything up, then runs the main job: the embedded platform (`space serve`: control
# plane + a local node) and a short demo session against it, printing each step's time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/space demo --embedded "$@"
