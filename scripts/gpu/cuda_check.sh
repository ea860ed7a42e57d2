#!/usr/bin/env bash
# Build, test and benchmark everything CUDA-side in one device call (docs/gpu-notes-cuda.md).
#   [TEST_SELECT=<pytest -k expr>] [PROFILE="M:mma W:cublaslt"] [BENCH_MODELS=S,M] scripts/gpu/cuda_check.sh [phase ...]    phases: env wgmma wgmma-stages tests sass nvmath serve bench cublaslt profile sweep ncu
#   (default: env wgmma sass serve bench cublaslt tests; `wgmma` is issue 7's never-yet-run forward kernel:
#   probe, SASS, quick tests, bench against mma, compute-sanitizer, all its tests, under
#   MMAD_CUDA_WGMMA=1; alone it needs the whole 600 s of one device call)
# Expects to run in the repository root on the GPU host, with .whl carried (nvmath-python and the
# daemon's dependencies, py3.12 wheels: docs/gpu-notes-cuda.md);
# logs go under $OUT (or /tmp/out; at most 8 files, the device tool's limit), the short summary
# is printed last.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PHASES=${*:-"env wgmma sass serve bench cublaslt tests"}
export PYTHONUNBUFFERED=1 MMAD_CACHE_DIR=/tmp/mmad-cache

# the repo is not installed there: map the namespaced import names (mmad.backends -> backends/)
# (python puts the current directory first on sys.path, so ./mmad must carry the links itself;
# this edits the device's copy of the tree only)
for d in backends server shaders bench; do [ -e "mmad/$d" ] || ln -s "$PWD/$d" "mmad/$d"; done
# nvmath-python, and the daemon's own dependencies (pydantic, FastAPI, uvicorn, ...) that the image lacks
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > /tmp/pip.log 2>&1 || { echo "wheel install (.whl) failed:"; tail -n 5 /tmp/pip.log; }
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
      timeout ${TEST_TIMEOUT:-300} python3 -m pytest -p no:cacheprovider -o addopts="" -n ${TEST_WORKERS:-6} \
        tests/test_cuda_layouts.py tests/test_cuda.py ${TEST_SELECT:+-k "$TEST_SELECT"} --timeout 240 -v --tb=short -rfEs --durations=15 > "$OUT/pytest.log" 2>&1
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
    wgmma)
      # logs build up outside $OUT and are re-tarred into $OUT/wgmma.tgz after every step, so a
      # call cut off by its time limit still returns what ran (the device tool returns few files);
      # steps in order of what decides most: probe, SASS, quick tests, bench, sanitizer, all tests
      W=/tmp/wgmma-check; rm -rf "$W"; mkdir -p "$W"
      pack() { tar czf "$OUT/wgmma.tgz" -C /tmp --exclude='*.cubin' wgmma-check; }
      ( export MMAD_CUDA_WGMMA=1
        CUOBJDUMP=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
        SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
        echo "--- wgmma probe (nvcc: $(command -v nvcc || echo /usr/local/cuda/bin/nvcc))"
        python3 -c "from mmad.backends.cuda import CudaBackend
for r in CudaBackend().probe(): print(r.variant, r.available, '|', r.reason, r.details)" 2>&1 | tee "$W/probe.log"
        echo "--- wgmma SASS (per model: wgmma_forward's HGMMA, local memory LDL/STL, warpgroup syncs)"
        timeout 180 python3 - "$W" "$CUOBJDUMP" <<'PY' 2>&1 | tee "$W/sass.log"
import collections, re, subprocess, sys
from pathlib import Path
from mmad.backends import cuda
from mmad.spec import bench_spec
out, cuobjdump = Path(sys.argv[1]), sys.argv[2]
for name in "SMLW":
    plan = cuda.WgmmaPlan(bench_spec(name))
    cubin = out / f"wgmma_{name}.cubin"
    cubin.write_bytes(cuda.nvcc_compile(plan.source, cuda.WGMMA_NVCC_OPTIONS, name))
    dump = subprocess.run([cuobjdump, "--dump-sass", str(cubin)], capture_output=True, text=True)
    (out / f"wgmma_{name}.sass.txt").write_text(dump.stdout + dump.stderr)
    ops, fn = collections.Counter(), "?"
    for line in dump.stdout.splitlines():
        m = re.search(r"Function : (\w+)", line)
        if m:
            fn = m.group(1)
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m and fn == "wgmma_forward":
            op = m.group(1)
            ops[op if op.startswith("WARPGROUP") else op.split(".")[0]] += 1
    keys = ("HGMMA", "HMMA", "LDL", "STL", "WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR", "BAR", "LDGSTS", "STS", "LDS", "STG")
    # one HGMMA per wgmma in the source: layer 0, the (not unrolled) hidden loop, the output layer
    expected = plan.kin_p // 16 + (plan.wp // 16 if plan.n_hidden > 1 else 0) + plan.wp // 16
    print(name, f"resident={plan.w_resident} warpgroups={plan.warpgroups} staged={plan.input_staged} "
          f"smem={plan.smem_bytes} HGMMA expected={expected}",
          " ".join(f"{k}={ops[k]}" for k in keys), f"total={sum(ops.values())}",
          "" if dump.stdout else f"cuobjdump rc={dump.returncode}: {dump.stderr.strip()[:200]}")
PY
        pack
        echo "--- wgmma tests, quick slice (S/M/L/W ReLU at 1000 rows, odd shapes, training, gate, warpgroups)"
        timeout ${WGMMA_QUICK_TIMEOUT:-150} python3 -m pytest -p no:cacheprovider -o addopts="" tests/test_cuda_wgmma.py \
          -k "rows1000 and ReLU or odd or training or gate or forced" --timeout 120 -v --tb=short -rfEs > "$W/pytest_quick.log" 2>&1
        echo "quick rc=$?: $(tail -n 1 "$W/pytest_quick.log")"
        grep -E "(FAILED|ERROR) " "$W/pytest_quick.log" | sort -u | head -20
        pack
        echo "--- bench at 2^20: wgmma forward (its training is the mma kernels'), then mma, same call"
        for v in wgmma mma; do
          timeout ${BENCH_TIMEOUT:-200} python3 -m mmad.bench.cuda_bench --out "$W/bench_$v" --variant $v --repeats 30 > "$W/bench_$v.log" 2>&1
          echo "bench $v rc=$?"; tail -n 7 "$W/bench_$v.log"
          pack
        done
        # L: two warpgroups without input prefetch (the default) against one with it
        MMAD_CUDA_WGMMA_WARPGROUPS=1 timeout ${BENCH_TIMEOUT:-200} python3 -m mmad.bench.cuda_bench --out "$W/bench_L1" \
          --models L --variant wgmma --repeats 30 > "$W/bench_L1.log" 2>&1
        echo "bench wgmma L, 1 warpgroup, rc=$?"; tail -n 1 "$W/bench_L1.log"
        pack
        echo "--- compute-sanitizer (memcheck, racecheck) on S (resident, 2 warpgroups) and W (streamed), 1000 rows"
        for tool in memcheck racecheck; do
          timeout ${SANITIZER_TIMEOUT:-90} "$SANITIZER" --tool $tool --error-exitcode 3 python3 -c "
import numpy as np
from mmad.backends.cuda import CudaBackend
from mmad.spec import bench_spec
b = CudaBackend()
for name in 'SW':
    m = b.compile(bench_spec(name), variant='wgmma')
    out = m.forward(np.random.default_rng(0).standard_normal((1000, m.spec.n_input_dims), dtype=np.float32))
    print(name, 'finite' if np.isfinite(out).all() else 'NOT FINITE')" > "$W/sanitizer_$tool.log" 2>&1
          echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|finite' "$W/sanitizer_$tool.log" | tr '\n' ' ')"
          pack
        done
        echo "--- wgmma tests, the whole file"
        timeout ${WGMMA_TEST_TIMEOUT:-240} python3 -m pytest -p no:cacheprovider -o addopts="" -n ${TEST_WORKERS:-6} \
          tests/test_cuda_wgmma.py --timeout 200 -v --tb=short -rfEs > "$W/pytest.log" 2>&1
        echo "full rc=$?: $(tail -n 1 "$W/pytest.log")"
        grep -E "(FAILED|ERROR) " "$W/pytest.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort -u | head -30
        grep -cE " PASSED" "$W/pytest.log" | sed 's/^/passed: /'
      ) 2>&1 | tee -a "$SUMMARY"
      pack ;;
    wgmma-stages)
      # the wgmma forward's input prefetch depth (MMAD_CUDA_WGMMA_STAGES 2 against 1) and mma, same
      # call: quick correctness slice, bench of WGMMA_MODELS, racecheck on S with the default plan
      W=/tmp/wgmma-stages; mkdir -p "$W"
      ( export MMAD_CUDA_WGMMA=1
        timeout ${WGMMA_QUICK_TIMEOUT:-150} python3 -m pytest -p no:cacheprovider -o addopts="" -n 6 tests/test_cuda_wgmma.py \
          -k "${WGMMA_QUICK_K:-rows1000 or odd or forced or stages}" --timeout 120 -q --tb=short -rfE > "$W/pytest_quick.log" 2>&1
        echo "quick rc=$?: $(tail -n 1 "$W/pytest_quick.log")"; grep -E "^(FAILED|ERROR) " "$W/pytest_quick.log" | head -10
        # WGMMA_SETTINGS: "variant/stages/min-blocks ..." ("-": the plan's choice)
        for setting in ${WGMMA_SETTINGS:-wgmma/2/- wgmma/1/- mma/-/-}; do
          IFS=/ read -r v st mb <<< "$setting"
          MMAD_CUDA_WGMMA_STAGES=${st#-} MMAD_CUDA_WGMMA_MIN_BLOCKS=${mb#-} timeout ${BENCH_TIMEOUT:-150} \
            python3 -m mmad.bench.cuda_bench --out "$W/bench_${v}_${st}_${mb}" --variant $v --models ${WGMMA_MODELS:-S,M,L} \
            --repeats 30 > "$W/bench_${v}_${st}_${mb}.log" 2>&1
          echo "bench $v stages=$st min_blocks=$mb rc=$?"; grep -E "^\| [SMLW] " "$W/bench_${v}_${st}_${mb}.log"
        done
        SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
        timeout ${SANITIZER_TIMEOUT:-90} "$SANITIZER" --tool racecheck --error-exitcode 3 python3 -c "
import numpy as np
from mmad.backends.cuda import CudaBackend
from mmad.spec import bench_spec
m = CudaBackend().compile(bench_spec('S'), variant='wgmma')
out = m.forward(np.random.default_rng(0).standard_normal((5000, 32), dtype=np.float32))
print('S stages', m.wg.x_stages, 'finite' if np.isfinite(out).all() else 'NOT FINITE')" > "$W/racecheck.log" 2>&1
        echo "racecheck rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|finite' "$W/racecheck.log" | tr '\n' ' ')"
      ) 2>&1 | tee -a "$SUMMARY"
      tar czf "$OUT/wgmma-stages.tgz" -C /tmp wgmma-stages ;;
    sweep)
      # mma kernel geometry: SWEEP="4/1,8/1,..." (warps per block / 16-row tiles per warp in training)
      timeout ${SWEEP_TIMEOUT:-240} python3 -m mmad.bench.cuda_bench --out /tmp/sweep --models ${SWEEP_MODELS:-S,M,L} \
        --sweep-mma ${SWEEP:-4/1,8/1,16/1,4/2,8/2} --repeats 10 --no-bench 2>&1 | tee "$OUT/sweep.log" | tail -n 40 | tee -a "$SUMMARY" ;;
    profile)
      # where the time goes, op by op (CUDA events): PROFILE="M:mma W:cublaslt ..." (run 7: W cublaslt)
      args=""; for item in ${PROFILE:-M:mma W:cublaslt}; do args="$args --profile $item"; done
      timeout 200 python3 -m mmad.bench.cuda_bench --out /tmp/prof $args --no-bench 2>&1 | tee "$OUT/profile.log" | tail -n 80 | tee -a "$SUMMARY" ;;
    ncu)
      # Nsight Compute on one forward launch per NCU="MODEL:VARIANT ..." (what limits each kernel:
      # speed of light, memory, warp stalls, occupancy); one text report per item, tarred into $OUT/ncu.tgz
      mkdir -p /tmp/ncu
      NCU_BIN=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
      for item in ${NCU:-S:wgmma S:mma M:wgmma M:mma}; do
        MMAD_CUDA_WGMMA=1 timeout ${NCU_TIMEOUT:-150} "$NCU_BIN" --clock-control none \
          -k regex:'^(wgmma_forward|mlp_forward)$' --launch-skip 2 --launch-count 1 \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
          --section Occupancy --section SchedulerStats --section LaunchStats \
          --metrics regex:'smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
          python3 -m mmad.bench.cuda_bench --out /tmp/ncu --run-forward "$item" > "/tmp/ncu/${item/:/_}.txt" 2>&1
        echo "ncu $item rc=$?" | tee -a "$SUMMARY"
        grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issued Warp Per|No Eligible|Theoretical Occupancy" \
          "/tmp/ncu/${item/:/_}.txt" | sed 's/^ */  /' | tee -a "$SUMMARY"
        # the five largest stall reasons (warps stalled per issued instruction)
        grep -E "smsp__average_warps_issue_stalled_" "/tmp/ncu/${item/:/_}.txt" | awk '{print $NF, $1}' | sort -gr | head -5 \
          | sed 's/^/  stall /' | tee -a "$SUMMARY"
      done
      tar czf "$OUT/ncu.tgz" -C /tmp ncu ;;
    nvmath)
      python3 -m mmad.bench.cuda_bench --out /tmp/nvm --nvmath-check --no-bench 2>&1 | tail -n 12 | tee -a "$SUMMARY" ;;
    serve)
      timeout 240 python3 -m mmad.bench.cuda_bench --out /tmp/serve --serve-check --no-bench 2>&1 | tee "$OUT/serve.log" | tail -n 6 | tee -a "$SUMMARY" ;;
    bench)
      timeout ${BENCH_TIMEOUT:-300} python3 -m mmad.bench.cuda_bench --out "$OUT" --models ${BENCH_MODELS:-S,M,L,W} --repeats 30 > "$OUT/bench.log" 2>&1
      echo "bench rc=$?" | tee -a "$SUMMARY"; tail -n 8 "$OUT/bench.log" | tee -a "$SUMMARY" ;;
    cublaslt)
      # the cuBLASLt variant on the wide model and on M, same rules (its own peers and ceilings)
      mkdir -p /tmp/lt; timeout ${BENCH_TIMEOUT:-300} python3 -m mmad.bench.cuda_bench --out /tmp/lt --models W,M \
        --variant cublaslt --repeats 20 > "$OUT/bench_cublaslt.log" 2>&1
      echo "bench cublaslt rc=$?" | tee -a "$SUMMARY"; tail -n 5 "$OUT/bench_cublaslt.log" | tee -a "$SUMMARY" ;;
  esac
done
echo "================ summary"; cat "$SUMMARY"
