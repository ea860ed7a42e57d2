#!/usr/bin/env bash
# Installs mmad (scripts/setup.sh) and starts the daemon on the best backend here, with the
# demo model ready: http://127.0.0.1:8000/v2/models/demo . Extra arguments go to `mmad serve`.
#   scripts/start.sh [--warm-cache] [mmad serve arguments]
# --warm-cache: first `mmad cache warm --bench-models --demo` (compiles the benchmark models and
# the demo model and, on cuda, measures their variants), so the daemon serves them at once on
# their measured variants.
set -euo pipefail
cd "$(dirname "$0")/.."
warm=0
if [ "${1:-}" = "--warm-cache" ]; then
  warm=1
  shift
fi
scripts/setup.sh
.venv/bin/mmad probe
if [ "$warm" = 1 ]; then
  .venv/bin/mmad cache warm --bench-models --demo
fi
exec .venv/bin/mmad serve "$@"
