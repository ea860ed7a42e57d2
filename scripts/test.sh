#!/usr/bin/env bash
# Installs everything the tests need (scripts/setup.sh --dev: lavapipe, wgpu, tritonclient, ...)
# and runs the whole suite. GPU tests skip with the reason when no GPU is present.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev || exit 1
.venv/bin/mmad probe
.venv/bin/python -m pytest -ra --durations=15 "$@"
status=$?
[ "$status" = 5 ] && { echo "test: pytest collected no tests" >&2; exit 1; }
exit "$status"
