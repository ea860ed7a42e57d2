#!/usr/bin/env bash
# Build, test and benchmark everything CUDA-side in one device call (docs/gpu-notes-cuda.md).
#   scripts/gpu/cuda_check.sh [phase ...]    phases: env tests sass nvmath serve bench (default: all)
# Expects to run in the repository root on the GPU host, with .whl carried (nvmath-python);
# logs go under $OUT (or /tmp/out; at most 8 files, the device tool's limit), the short summary
# is printed last.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PHASES=${*:-"env sass serve bench tests"}
export PYTHONUNBUFFERED=1 MMAD_CACHE_DIR=/tmp/mmad-cache

# the repo is not installed there: map the namespaced import names (mmad.backends -> backends/)
# (python puts the current directory first on sys.path, so ./mmad must carry the links itself;
# this edits the device's copy of the tree only)
for d in backends server shaders bench; do [ -e "mmad/$d" ] || ln -s "$PWD/$d" "mmad/$d"; done
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/nvmath_python-*.whl \
    > /tmp/pip.log 2>&1 || { echo "nvmath wheel install failed:"; tail -n 5 /tmp/pip.log; }
fi
export PYTHONPATH=/tmp/site
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

for phase in $PHASES; do
  case $phase in
    env)
      { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv;
        python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)";
        python3 -m pip show cuda-bindings cuda-core cuda-pathfinder 2>/dev/null | grep -E '^(Name|Version)';
        python3 -c "from mmad.backends.cuda import CudaBackend
for r in CudaBackend().probe(): print(r.variant, r.available, r.device, r.api_version, '|', r.reason, r.details)"; } \
        2>&1 | tee "$OUT/env.log" | tee -a "$SUMMARY" ;;
    tests)
      start=$(date +%s)
      # several workers: NVRTC compiles (one per distinct spec) and oracle runs overlap
      timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -o addopts="" -n ${TEST_WORKERS:-6} \
        tests/test_cuda_layouts.py tests/test_cuda.py --timeout 240 -v --tb=short -rfEs --durations=15 > "$OUT/pytest.log" 2>&1
      echo "pytest rc=$? in $(( $(date +%s) - start )) s: $(tail -n 1 "$OUT/pytest.log")" | tee -a "$SUMMARY"
      # -v prints every result as it lands, so even a run cut off by the timeout says what failed
      grep -E "(FAILED|ERROR) " "$OUT/pytest.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort -u | head -40 | tee -a "$SUMMARY"
      grep -cE " PASSED" "$OUT/pytest.log" | sed 's/^/passed: /' | tee -a "$SUMMARY" ;;
    sass)
      mkdir -p "$OUT/sass"; python3 -m mmad.bench.cuda_bench --out "$OUT/sass" --sass --no-bench > "$OUT/sass/sass.log" 2>&1
      python3 - "$OUT/sass/cuda_bench.json" <<'PY' | tee -a "$SUMMARY"
import json, sys
mix = json.load(open(sys.argv[1]))["sass"]
for model, counts in mix.items():
    print(model, " ".join(f"{k}={v}" for k, v in sorted(counts.items()) if not k.startswith("mlp_optimize")))
PY
      rm -f "$OUT"/sass/*.sass.txt.gz; tar czf "$OUT/sass.tgz" -C "$OUT" sass && rm -rf "$OUT/sass" ;;
    nvmath)
      python3 -m mmad.bench.cuda_bench --out /tmp/nvm --nvmath-check --no-bench 2>&1 | tail -n 12 | tee -a "$SUMMARY" ;;
    serve)
      timeout 240 python3 -m mmad.bench.cuda_bench --out /tmp/serve --serve-check --no-bench 2>&1 | tee "$OUT/serve.log" | tail -n 6 | tee -a "$SUMMARY" ;;
    bench)
      timeout ${BENCH_TIMEOUT:-300} python3 -m mmad.bench.cuda_bench --out "$OUT" --repeats 30 > "$OUT/bench.log" 2>&1
      echo "bench rc=$?" | tee -a "$SUMMARY"; tail -n 8 "$OUT/bench.log" | tee -a "$SUMMARY"
      # the cuBLASLt variant on the wide model and on M, same rules (its own peers and ceilings)
      mkdir -p /tmp/lt; timeout ${BENCH_TIMEOUT:-300} python3 -m mmad.bench.cuda_bench --out /tmp/lt --models W,M \
        --variant cublaslt --repeats 20 > "$OUT/bench_cublaslt.log" 2>&1
      echo "bench cublaslt rc=$?" | tee -a "$SUMMARY"; tail -n 5 "$OUT/bench_cublaslt.log" | tee -a "$SUMMARY" ;;
  esac
done
echo "================ summary"; cat "$SUMMARY"
