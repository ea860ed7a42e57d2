#!/usr/bin/env bash
# Installs what mmad needs on a Debian (bookworm) machine into ./.venv.
#   scripts/setup.sh            runtime: daemon + cpu/vulkan/wgpu backends, and the cuda backend
#                               where an NVIDIA driver is present
#   scripts/setup.sh --dev      also the test tools (pytest, tritonclient, ...), the export extra
#                               (torch 2.13.0, onnx, onnxruntime) and the client SDK
# Mesa's lavapipe (a CPU Vulkan driver) comes from bookworm-backports (Mesa 25), so the Vulkan
# and wgpu backends run even without a GPU. Set MMAD_SKIP_APT=1 to skip the system packages; apt
# waits up to MMAD_APT_LOCK_TIMEOUT seconds (default 600) for another package manager's lock.
# The cuda backend: with an NVIDIA driver (libcuda, nvidia-smi or /proc/driver/nvidia) the extra
# for the driver's CUDA major, cuda12 or cuda13 (CuPy's wheel for it with the CUDA libraries, and
# nvmath-python); mmad/install.py reads the driver and says why. MMAD_CUDA=12 or 13 installs that
# one whatever the driver says, MMAD_CUDA=none none.
# torch (--dev) comes from the default index: on PyPI a CUDA build of several GB. PyTorch's own CPU
# build (2.13.0+cpu, a few hundred MB) instead: MMAD_TORCH_INDEX=https://download.pytorch.org/whl/cpu
# (any index URL; only torch is taken from it).
# Python packages are installed at the versions in constraints.txt (the tested ones).
# A re-run skips apt when every package is already installed (Mesa from backports), and pip when
# .venv/.mmad-setup records an install of this same pyproject/client/constraints/setup script (a --dev
# install also counts for a plain one) with the same CUDA extra and torch index; MMAD_SETUP_FORCE=1
# installs again regardless.
set -euo pipefail
cd "$(dirname "$0")/.."
dev=0
[ "${1:-}" = "--dev" ] && dev=1

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
  echo "setup: need root (or sudo) for: $*" >&2; return 1; fi; }
apt_get() { as_root env MMAD_APT_LOCK_TIMEOUT="${MMAD_APT_LOCK_TIMEOUT:-600}" bash scripts/apt-get-wait.sh "$@"; }

force="${MMAD_SETUP_FORCE:-0}"
apt_packages=(python3 python3-venv python3-pip git curl mesa-vulkan-drivers libvulkan1)
# chromium + its driver: the dashboard's test drives the page in headless Chromium; docker.io and
# debootstrap: the image test builds and runs the cpu image (from a debootstrap base offline)
[ "$dev" = 1 ] && apt_packages+=(docker-compose chromium chromium-driver docker.io debootstrap)

apt_done() {
  [ "$force" != 1 ] || return 1
  local pkg
  for pkg in "${apt_packages[@]}"; do
    [ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" = "install ok installed" ] || return 1
  done
  # lavapipe with cooperative matrices needs backports' Mesa, not bookworm's 22.x
  dpkg --compare-versions "$(dpkg-query -W -f='${Version}' mesa-vulkan-drivers)" ge 25
}

if [ "${MMAD_SKIP_APT:-0}" != 1 ] && command -v apt-get >/dev/null && apt_done; then
  echo "setup: system packages already installed"
elif [ "${MMAD_SKIP_APT:-0}" != 1 ] && command -v apt-get >/dev/null; then
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
  apt_get update -qq
  apt_get install -y -qq python3 python3-venv python3-pip git curl >/dev/null
  apt_get install -y -qq -t bookworm-backports mesa-vulkan-drivers libvulkan1 >/dev/null
  if [ "$dev" = 1 ]; then
    # the compose file is validated by the docker client alone (no engine needed)
    apt_get install -y -qq --no-install-recommends docker-compose chromium chromium-driver docker.io \
      debootstrap >/dev/null
  fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
# the extra for the NVIDIA driver's CUDA major, or none; the reason goes to stderr
cuda_extra=$(.venv/bin/python -m mmad.install extra)
extras="vulkan,wgpu${cuda_extra:+,$cuda_extra}"
torch_index="${MMAD_TORCH_INDEX:-}"
# what the pip step installs follows from these files, the venv's Python, the CUDA extra and the torch index
key=$(cat pyproject.toml client/pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)-$(.venv/bin/python -c 'import sys; print(sys.version.split()[0])')-${cuda_extra:-no-cuda}-$(printf %s "$torch_index" | sha256sum | cut -c1-8)
stamp=.venv/.mmad-setup
if [ "$force" != 1 ] && [ -f "$stamp" ] && [ -x .venv/bin/mmad ] \
   && { grep -qx "dev $key" "$stamp" || { [ "$dev" = 0 ] && grep -qx "runtime $key" "$stamp"; }; }; then
  echo "setup: Python packages already installed ($stamp)"
else
  rm -f "$stamp"
  .venv/bin/python -m pip install -q -c constraints.txt --upgrade pip "setuptools>=77" wheel
  if [ "$dev" = 1 ]; then
    if [ -n "$torch_index" ]; then
      # torch alone from that index, at the pinned version (2.13.0+cpu matches ==2.13.0): the
      # install below finds it installed and takes its dependencies from the default index
      .venv/bin/python -m pip install -q --no-deps --index-url "$torch_index" "$(grep -m1 '^torch==' constraints.txt)"
    fi
    .venv/bin/python -m pip install -q -c constraints.txt -e ".[$extras,export,dev]" -e ./client
    echo "dev $key" > "$stamp"
  else
    .venv/bin/python -m pip install -q -c constraints.txt -e ".[$extras]"
    echo "runtime $key" > "$stamp"
  fi
fi
echo "setup: done ($(.venv/bin/python --version), $(.venv/bin/mmad --version))"
