# Sourced by the scripts/gpu/*_check.sh scripts on the GPU host: the repository is not installed
# there (python runs from its root, where ./mmad is the package), so the wheels carried in .whl
# (nvmath-python, the daemon's dependencies, tritonclient, grpcio: what the image lacks) and in
# .whlvk (the Vulkan and wgpu stacks, carried only by the runs that need them: a call carries at
# most 64 MiB) go to /tmp/site once, and PYTHONPATH points at them and at the client SDK.
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl $(ls .whlvk/*.whl 2>/dev/null) \
    > /tmp/pip.log 2>&1 || { echo "wheel install (.whl) failed:"; tail -n 5 /tmp/pip.log; }
fi
export PYTHONPATH=/tmp/site:$PWD/client PYTHONUNBUFFERED=1 MMAD_CACHE_DIR=${MMAD_CACHE_DIR:-/tmp/mmad-cache}
