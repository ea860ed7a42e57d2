#!/usr/bin/env bash
# Installs what mmad needs on a Debian (bookworm) machine into ./.venv.
#   scripts/setup.sh            runtime: daemon + cpu/vulkan/wgpu backends
#   scripts/setup.sh --dev      also the test tools (pytest, tritonclient, ...) and the client SDK
# Mesa's lavapipe (a CPU Vulkan driver) comes from bookworm-backports (Mesa 25), so the Vulkan
# and wgpu backends run even without a GPU. Set MMAD_SKIP_APT=1 to skip the system packages.
set -euo pipefail
cd "$(dirname "$0")/.."
dev=0
[ "${1:-}" = "--dev" ] && dev=1

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
  echo "setup: need root (or sudo) for: $*" >&2; return 1; fi; }

if [ "${MMAD_SKIP_APT:-0}" != 1 ] && command -v apt-get >/dev/null; then
  # bookworm-backports from the same mirror the machine already uses
  if ! grep -qs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; then
    # the first Debian archive among the enabled source files (not security, not third-party repos)
    sources=()
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
      [ -f "$f" ] && sources+=("$f")
    done
    mirror=$(awk '$1 == "deb" || $1 == "URIs:" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\/[^ ]*\/debian\/?$/) { print $i; exit } }' \
             "${sources[@]}" /dev/null)
    echo "deb ${mirror:?no Debian mirror found in /etc/apt} bookworm-backports main" \
      | as_root tee /etc/apt/sources.list.d/mmad-backports.list >/dev/null
  fi
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv python3-pip git curl >/dev/null
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -t bookworm-backports \
    mesa-vulkan-drivers libvulkan1 >/dev/null
  if [ "$dev" = 1 ]; then
    # the compose file is validated by the docker client alone (no engine needed)
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
  fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip "setuptools>=77" wheel
if [ "$dev" = 1 ]; then
  .venv/bin/python -m pip install -q -e ".[vulkan,wgpu,dev]" -e ./client
else
  .venv/bin/python -m pip install -q -e ".[vulkan,wgpu]"
fi
echo "setup: done ($(.venv/bin/python --version), $(.venv/bin/mmad --version))"
