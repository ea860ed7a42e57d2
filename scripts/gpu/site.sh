# Sourced by the scripts/gpu/*_check.sh scripts on the GPU host: the repository is not installed
# there (python runs from its root, where ./mmad is the package), so the wheels carried in .whl
# (nvmath-python and the daemon's dependencies: what the image lacks), .whltc (tritonclient, grpcio,
# protobuf) and .whlvk (the Vulkan and wgpu stacks, and slangpy's glslang library for coopmat2), the
# last two carried only by the runs that need them (a call carries at most 64 MiB), go to /tmp/site
# once, and PYTHONPATH points at them and at the client SDK.
slang=$(ls "$PWD"/.whlvk/libslang-glslang*.so 2>/dev/null | tail -n 1)
[ -n "$slang" ] && export MMAD_SLANG_GLSLANG=${MMAD_SLANG_GLSLANG:-$slang}
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl $(ls .whltc/*.whl .whlvk/*.whl 2>/dev/null) \
    > /tmp/pip.log 2>&1 || { echo "wheel install (.whl) failed:"; tail -n 5 /tmp/pip.log; }
fi
export PYTHONPATH=/tmp/site:$PWD/client PYTHONUNBUFFERED=1 MMAD_CACHE_DIR=${MMAD_CACHE_DIR:-/tmp/mmad-cache}
