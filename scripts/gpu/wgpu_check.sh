#!/usr/bin/env bash
# wgpu backend on an NVIDIA GPU host (wgpu-native over the NVIDIA Vulkan driver):
#   1. the probe row, 2. tests/test_webgpu.py, 3. forward and training throughput for S/M/L/W at
#   batch 2^20 against PyTorch fp16 in the same run (CUDA-graph forward; autocast + fused Adam),
#   through `python3 -m mmad.bench --backend wgpu` (BENCH_ARGS: more of its options, e.g. '--models M').
# Run from the repository root through the device tool with carry [".gl", ".whl"] (the Vulkan
# loader's debs and the wheels, scripts/gpu/site.sh); logs go to $OUT (or /tmp/wgpu_check), a short table is printed last.
set -uo pipefail
OUT=${OUT:-/tmp/wgpu_check}
mkdir -p "$OUT"

for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1  # the package is ./mmad (not installed there)

python3 -P -m mmad.cli probe --backend wgpu --json 2>&1 | tee "$OUT/probe.log"

start=$(date +%s)
python3 -P -m pytest -q -p no:cacheprovider tests/test_webgpu.py --durations=8 2>&1 | tee "$OUT/pytest.log"
echo "pytest wall: $(( $(date +%s) - start )) s" | tee -a "$OUT/pytest.log"

# wgpu's device arrays are float32: the forward is timed with fp32 in and out, 10 calls a sample
python3 -P -m mmad.bench --backend wgpu --json "$OUT/bench.json" --markdown "$OUT/bench.md" ${BENCH_ARGS:-} \
  2>&1 | tee "$OUT/bench.log" | tail -n 14
