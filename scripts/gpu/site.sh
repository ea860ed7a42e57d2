# Sourced by the scripts/gpu/*_check.sh scripts on the GPU host: the repository is not installed
# there (python runs from its root, where ./mmad is the package), so the wheels carried in .whl
# (nvmath-python and the daemon's dependencies: what the image lacks), .whltc (tritonclient with
# its HTTP stack and cuda-bindings) and .whlvk (the Vulkan and wgpu stacks, and slangpy's glslang
# library for coopmat2), the last two carried only by the runs that need them (a call carries at
# most 64 MiB), go to /tmp/site, and PYTHONPATH points at them and at the client SDK. Each folder
# is installed once per listing of its wheels: a later call on the same (warm) machine that
# carries another folder, or other wheels, installs those too.
slang=$(ls "$PWD"/.whlvk/libslang-glslang*.so 2>/dev/null | tail -n 1)
[ -n "$slang" ] && export MMAD_SLANG_GLSLANG=${MMAD_SLANG_GLSLANG:-$slang}
for folder in .whl .whltc .whlvk; do
  ls "$folder"/*.whl > /dev/null 2>&1 || continue
  marker="/tmp/site/.installed$folder-$(ls "$folder"/*.whl | md5sum | cut -c1-12)"
  [ -e "$marker" ] && continue
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$folder"/*.whl > /tmp/pip.log 2>&1; then
    touch "$marker"
  else
    echo "wheel install ($folder) failed:"; tail -n 5 /tmp/pip.log
  fi
done
export PYTHONPATH=/tmp/site:$PWD/client PYTHONUNBUFFERED=1 MMAD_CACHE_DIR=${MMAD_CACHE_DIR:-/tmp/mmad-cache}
