#!/usr/bin/env bash
# Several GPUs of one host in one device call (docs/multi-gpu.md):
#   [PHASES="env tests bench"] [BENCH_ARGS=...] scripts/gpu/multi_gpu_check.sh
# env: nvidia-smi topology and the probe; tests: tests/test_cuda_multi.py (device 1, NCCL
# data-parallel against one device), tests/test_placement.py, and the single-device training
# tests the data-parallel refactor touched; bench: `mmad bench --multi-gpu` (replicas serving,
# data-parallel jobs, the loss-curve check), JSON to $OUT/multi-gpu.json. Carry .whl (the
# daemon's wheels). Logs under $OUT; the short summary is printed last.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off (docs/multi-gpu.md)
. scripts/gpu/site.sh
SUMMARY="$OUT/multi-summary.txt"
: > "$SUMMARY"
for phase in ${PHASES:-env tests bench}; do
  case $phase in
    env)
      { nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; nvidia-smi topo -m | head -4;
        python3 -m mmad.cli probe --backend cuda; } 2>&1 | tee "$OUT/multi-env.log" | tail -n 8 >> "$SUMMARY" ;;
    tests)
      start=$(date +%s)
      timeout ${TEST_TIMEOUT:-240} python3 -m pytest -p no:cacheprovider -o addopts="" -n ${TEST_WORKERS:-4} \
        tests/test_cuda_multi.py tests/test_placement.py tests/test_cuda_epochs.py \
        ${TEST_SELECT:+-k "$TEST_SELECT"} --timeout 200 -v --tb=short -rfEs > "$OUT/multi-pytest.log" 2>&1
      echo "pytest rc=$? in $(( $(date +%s) - start )) s: $(tail -n 1 "$OUT/multi-pytest.log")" | tee -a "$SUMMARY"
      grep -E "(FAILED|ERROR) " "$OUT/multi-pytest.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort -u | head -20 \
        | tee -a "$SUMMARY" ;;
    bench)
      start=$(date +%s)
      timeout ${BENCH_TIMEOUT:-330} python3 -m mmad.bench --multi-gpu --json "$OUT/multi-gpu.json" ${BENCH_ARGS:-} \
        > "$OUT/multi-bench.log" 2>&1
      echo "bench rc=$? in $(( $(date +%s) - start )) s" | tee -a "$SUMMARY"
      tail -n 14 "$OUT/multi-bench.log" | tee -a "$SUMMARY" ;;
  esac
done
echo "=== summary"; cat "$SUMMARY"
