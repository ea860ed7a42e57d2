# Sourced on the GPU host (see ../shared/GPU-HOST.md): Vulkan loader + GL dispatch libraries
# from .gl/, wheels from .whl/ into /tmp/site, and the repo importable as `mmad.*` without
# installing it (the folders are mapped like pyproject.toml maps them).
set -u
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [ -d "$repo/.gl" ]; then
  for f in "$repo"/.gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
if [ -d "$repo/.whl" ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$repo"/.whl/*.whl
fi
mkdir -p /tmp/devsrc/mmad
cp -r "$repo"/mmad/* /tmp/devsrc/mmad/
for pkg in backends server shaders bench; do ln -sfn "$repo/$pkg" "/tmp/devsrc/mmad/$pkg"; done
export PYTHONPATH=/tmp/site:/tmp/devsrc:$repo/client${PYTHONPATH:+:$PYTHONPATH}
export LD_LIBRARY_PATH=/tmp/site/cmeel.prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PATH=/tmp/site/cmeel.prefix/bin:$PATH
export PYTHONUNBUFFERED=1 MMAD_CACHE_DIR=/tmp/mmad-cache
