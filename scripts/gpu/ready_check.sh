#!/usr/bin/env bash
# Time to READY on a GPU host in one device call (about 5 minutes): `mmad bench --ready` on cuda and
# vulkan with empty kernel caches for S/M/L/W, the hash-grid image config, the OneBlob config
# oneblob32 (512 encoded columns) and the tiny-cuda-nn configs the tests use (tests/configs,
# in fp16: the precision both backends run), each model's background measurement (compile and
# timing seconds, the variant chosen), the warm-cache PUT and the daemon's restart; then what a
# warmed image saves (`mmad cache warm`: its seconds and the cache's size, then the cold PUTs of a
# daemon started on that cache).
#   [VULKAN=vulkan] [CUDA=cuda] scripts/gpu/ready_check.sh [phase ...]   (CUDA= or VULKAN= leaves that backend out)
#   phases: env ready warm tests (default: env ready warm; `tests`, tests/test_cuda_dispatch.py and
#   tests/test_cuda_ema.py, takes about 3 minutes more)
#   `breakdown` (scripts/gpu/compile_breakdown.py): each compiler call of a cold compile and its seconds
# Expects the repository root on the GPU host with .whl and .gl carried (nvmath-python, glslang and
# the daemon's dependencies as py3.12 wheels, the Vulkan loader's debs: scripts/gpu/site.sh); logs
# and JSON under $OUT (or /tmp/out), the short table printed last. Each phase runs under `timeout`; one that fails does not stop the others.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PHASES=${*:-"env ready warm"}
CUDA=${CUDA-cuda}
VULKAN=${VULKAN-vulkan}
. scripts/gpu/site.sh
# the Vulkan loader (the debs carried in .gl) and glslang (the cmeel wheel in .whl), as
# scripts/gpu/vulkan_check.sh sets them up
if [ -d .gl ]; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
export LD_LIBRARY_PATH=/tmp/site/cmeel.prefix/lib:${LD_LIBRARY_PATH:-} PATH=/tmp/site/cmeel.prefix/bin:$PATH
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
CONFIGS="--config tests/configs/tcnn_composite.json --config tests/configs/tcnn_config_hash.json"
CONFIGS="$CONFIGS --config tests/configs/tcnn_frequency.json --config tests/configs/tcnn_oneblob.json"

for phase in $PHASES; do
  case $phase in
    env)
      { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc;
        python3 -m mmad.cli probe --backend cuda --backend vulkan; } 2>&1 | tee "$OUT/env.log" | tail -n 20 | tee -a "$SUMMARY" ;;
    ready)
      for backend in $CUDA $VULKAN; do
        name=${backend//:/-}
        limit=${READY_TIMEOUT:-200}
        [ "$backend" = "$VULKAN" ] && limit=${VULKAN_READY_TIMEOUT:-80}
        start=$(date +%s)
        timeout $limit python3 -m mmad.bench --ready --backend "$backend" \
          --models S,M,L,W,hashgrid,oneblob32 $CONFIGS --precision fp16 --decision-timeout 90 \
          --json "$OUT/ready-$name.json" --markdown "$OUT/ready-$name.md" > "$OUT/ready-$name.log" 2>&1
        echo "bench --ready $backend rc=$? in $(( $(date +%s) - start )) s" | tee -a "$SUMMARY"
      done ;;
    warm)
      # what an image built with WARM_CACHE holds: the cache `mmad cache warm` leaves, its size, and
      # the PUTs of a daemon started on it (nothing measured in the background)
      rm -rf /tmp/mmad-warmed
      start=$(date +%s)
      MMAD_CACHE_DIR=/tmp/mmad-warmed timeout ${WARM_TIMEOUT:-100} python3 -m mmad.cli cache warm --backend "$CUDA" \
        --bench-models --demo > "$OUT/warm.log" 2>&1
      echo "mmad cache warm --bench-models --demo ($CUDA) rc=$? in $(( $(date +%s) - start )) s; the cache: $(du -sh /tmp/mmad-warmed | cut -f1)" \
        | tee -a "$SUMMARY"
      tail -n 1 "$OUT/warm.log" | tee -a "$SUMMARY"
      timeout ${WARMED_TIMEOUT:-40} python3 -m mmad.bench --ready --backend "$CUDA" --models S,M,L,W --no-restart \
        --cache-from /tmp/mmad-warmed --json "$OUT/ready-warmed.json" --markdown "$OUT/ready-warmed.md" \
        > "$OUT/ready-warmed.log" 2>&1
      echo "bench --ready on the warmed cache rc=$?" | tee -a "$SUMMARY" ;;
    tests)
      start=$(date +%s)
      timeout ${TEST_TIMEOUT:-240} python3 -m pytest -p no:cacheprovider -o addopts="" -n ${TEST_WORKERS:-2} \
        tests/test_cuda_dispatch.py tests/test_cuda_ema.py --timeout 230 -v -s --tb=short -rfEs > "$OUT/pytest.log" 2>&1
      echo "pytest rc=$? in $(( $(date +%s) - start )) s: $(tail -n 1 "$OUT/pytest.log")" | tee -a "$SUMMARY"
      grep -E "(FAILED|ERROR) |served .*, chose" "$OUT/pytest.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort -u | head -30 \
        | tee -a "$SUMMARY" ;;
    breakdown)
      # each compiler call of a cold compile (NVRTC modules, glslang, driver pipelines) and its seconds
      PYTHONPATH=$PWD:$PYTHONPATH timeout ${BREAKDOWN_TIMEOUT:-150} python3 scripts/gpu/compile_breakdown.py > "$OUT/breakdown.log" 2>&1
      echo "compile breakdown rc=$?" | tee -a "$SUMMARY"; grep -E "^== " "$OUT/breakdown.log" | tee -a "$SUMMARY" ;;
    *) echo "unknown phase $phase (env ready warm tests breakdown)" | tee -a "$SUMMARY" ;;
  esac
done
echo "==== summary ===="
cat "$SUMMARY"
for table in "$OUT"/ready-*.md; do
  [ -f "$table" ] && { echo; echo "== ${table##*/}"; tail -n +3 "$table"; }
done
