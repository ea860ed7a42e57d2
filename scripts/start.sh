#!/usr/bin/env bash
# Installs mmad (scripts/setup.sh) and starts the daemon on the best backend here, with the
# demo model ready: http://127.0.0.1:8000/v2/models/demo . Extra arguments go to `mmad serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/mmad probe
exec .venv/bin/mmad serve "$@"
