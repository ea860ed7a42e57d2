#!/usr/bin/env bash
# Build, test and benchmark everything CUDA-side in one device call (docs/cuda.md, docs/benchmarks.md).
#   [TEST_SELECT=<pytest -k expr>] [PROFILE="M:mma W:cublaslt"] [BENCH_MODELS=S,M] scripts/gpu/cuda_check.sh [phase ...]    phases: env wgmma tests grids epochs jobs sass nvmath serve bench dispatch cublaslt profile ncu
#   (`epochs`: training on the device (graph replay, device gather) against launching each step and
#   host batches, plus test_cuda's training tests; `jobs`: `mmad bench --jobs`, training jobs through
#   the daemon against in-process and PyTorch, JOBS_MODELS / JOBS_EXTRA, the JSON to $OUT/jobs.json)
#   (default: env wgmma sass serve bench cublaslt tests; `wgmma`: probe, SASS, all its tests (forward
#   and training), the fp16 forward bench against mma and mma-f16acc, compute-sanitizer on the forwards
#   and the training kernels; alone it needs most of one device call; `dispatch`: the kernel
#   benchmark of docs/benchmarks.md, every variant measured per model, the JSON to $OUT/dispatch-h100.json and -bench.json)
# Expects to run in the repository root on the GPU host, with .whl carried (nvmath-python and the
# daemon's dependencies, py3.12 wheels: scripts/gpu/site.sh);
# logs go under $OUT (or /tmp/out; at most 8 files, the device tool's limit), the short summary
# is printed last. Every measurement and check runs through `python3 -m mmad.bench` (= `mmad bench`,
# docs/benchmarks.md): the benchmark rows, --profile, --sass, --nvmath-check, --daemon-check, --run-forward.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PHASES=${*:-"env wgmma sass serve bench cublaslt tests"}
. scripts/gpu/site.sh
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

for phase in $PHASES; do
  case $phase in
    env)
      { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv;
        python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)";
        python3 -m pip show cuda-bindings cuda-core cuda-pathfinder 2>/dev/null | grep -E '^(Name|Version)';
        python3 -m mmad.cli probe --backend cuda; } \
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
    epochs)
      start=$(date +%s)
      timeout ${EPOCHS_TIMEOUT:-240} python3 -m pytest -p no:cacheprovider -o addopts="" -n ${TEST_WORKERS:-6} \
        tests/test_cuda_epochs.py tests/test_cuda.py -k "${EPOCHS_SELECT:-epochs or graph or 200_steps or deterministic or round_trip or gradients_match}" \
        --timeout 200 -v --tb=short -rfEs > "$OUT/pytest_epochs.log" 2>&1
      echo "epochs pytest rc=$? in $(( $(date +%s) - start )) s: $(tail -n 1 "$OUT/pytest_epochs.log")" | tee -a "$SUMMARY"
      grep -E "(FAILED|ERROR) " "$OUT/pytest_epochs.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort -u | head -30 | tee -a "$SUMMARY" ;;
    grids)
      # the grid encodings on cuda (tests/test_cuda_grids.py), then the hash-grid image benchmark
      start=$(date +%s)
      timeout ${GRIDS_TIMEOUT:-240} python3 -m pytest -p no:cacheprovider -o addopts="" -n ${TEST_WORKERS:-6} \
        tests/test_cuda_grids.py ${GRIDS_SELECT:+-k "$GRIDS_SELECT"} --timeout 200 -v --tb=short -rfEs > "$OUT/pytest_grids.log" 2>&1
      echo "grids pytest rc=$? in $(( $(date +%s) - start )) s: $(tail -n 1 "$OUT/pytest_grids.log")" | tee -a "$SUMMARY"
      grep -E "(FAILED|ERROR) " "$OUT/pytest_grids.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort -u | head -30 | tee -a "$SUMMARY"
      timeout ${HASHGRID_TIMEOUT:-240} python3 -m mmad.cli bench --hashgrid --backend ${HASHGRID_BACKENDS:-cuda,vulkan:coopmat} \
        ${HASHGRID_ARGS:-} --json "$OUT/hashgrid.json" --markdown "$OUT/hashgrid.md" > "$OUT/hashgrid.log" 2>&1
      echo "hashgrid bench rc=$?" | tee -a "$SUMMARY"; tail -n 12 "$OUT/hashgrid.log" | tee -a "$SUMMARY" ;;
    jobs)
      timeout ${JOBS_TIMEOUT:-360} python3 -m mmad.bench --jobs --backend cuda:mma --models ${JOBS_MODELS:-M} \
        --repeats ${JOBS_REPEATS:-2} --seconds ${JOBS_SECONDS:-0.6} ${JOBS_EXTRA:-} --json "$OUT/jobs.json" > "$OUT/jobs.log" 2>&1
      echo "jobs bench rc=$?" | tee -a "$SUMMARY"; tail -n 16 "$OUT/jobs.log" | tee -a "$SUMMARY" ;;
    sass)
      # one line per model (S, M, L): the mma kernels' instruction mix; cubins and SASS text in sass.tgz
      mkdir -p "$OUT/sass"; python3 -m mmad.bench --sass "$OUT/sass" > "$OUT/sass/sass.log" 2>&1
      tail -n 3 "$OUT/sass/sass.log" | tee -a "$SUMMARY"
      rm -f "$OUT"/sass/*.sass.txt.gz; tar czf "$OUT/sass.tgz" -C "$OUT" sass && rm -rf "$OUT/sass" ;;
    wgmma)
      # logs build up outside $OUT and are re-tarred into $OUT/wgmma.tgz after every step, so a
      # call cut off by its time limit still returns what ran (the device tool returns few files);
      # steps in order of what decides most: probe, SASS, tests, bench, sanitizer
      W=/tmp/wgmma-check; rm -rf "$W"; mkdir -p "$W"
      pack() { tar czf "$OUT/wgmma.tgz" -C /tmp --exclude='*.cubin' wgmma-check; }
      ( SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
        echo "--- wgmma probe (nvcc: $(command -v nvcc || echo /usr/local/cuda/bin/nvcc))"
        python3 -m mmad.cli probe --backend cuda 2>&1 | tee "$W/probe.log"
        echo "--- wgmma SASS (per model and kernel: HGMMA, local memory LDL/STL, warpgroup syncs)"
        timeout 180 python3 -m mmad.bench --sass "$W" --backend cuda:wgmma 2>&1 | tee "$W/sass.log"
        pack
        echo "--- wgmma tests, the forward's and the training's files"
        timeout ${WGMMA_TEST_TIMEOUT:-420} python3 -m pytest -p no:cacheprovider -o addopts="" -n ${TEST_WORKERS:-14} \
          tests/test_cuda_wgmma.py tests/test_cuda_wgmma_train.py -k "${WGMMA_K:-not nothing}" --timeout 300 -q --tb=short -rfEs > "$W/pytest.log" 2>&1
        echo "tests rc=$?: $(tail -n 1 "$W/pytest.log")"
        grep -E "^(FAILED|ERROR) " "$W/pytest.log" | sort -u | head -30
        pack
        echo "--- bench at 2^20, fp16 I/O forward: wgmma, mma, mma-f16acc, same call"
        for v in ${WGMMA_BENCH_VARIANTS:-wgmma mma mma-f16acc}; do
          timeout ${BENCH_TIMEOUT:-150} python3 -m mmad.bench --backend cuda:$v --mode forward --io fp16 --repeats 30 \
            --peer none --json "$W/bench_$v.json" > "$W/bench_$v.log" 2>&1
          echo "bench $v rc=$?"; grep -E "^\| [SMLW] " "$W/bench_$v.log"
          pack
        done
        echo "--- compute-sanitizer (memcheck, racecheck, synccheck): fp16 forwards of S, M, L, W's fp32 (streamed), 1000 rows"
        for tool in memcheck racecheck synccheck; do
          for mi in S:fp16 M:fp16 L:fp16 W:fp32; do
            timeout ${SANITIZER_TIMEOUT:-90} "$SANITIZER" --tool $tool --error-exitcode 3 \
              python3 -m mmad.bench --run-forward ${mi%:*}:wgmma --io ${mi#*:} --rows 1000 > "$W/sanitizer_${tool}_${mi%:*}.log" 2>&1
            echo "$tool $mi rc=$? $(grep -iE 'ERROR SUMMARY|RACECHECK SUMMARY|finite' "$W/sanitizer_${tool}_${mi%:*}.log" | tr '\n' ' ')"
          done
          pack
        done
        echo "--- compute-sanitizer (memcheck, racecheck, synccheck): wgmma training of S, M, L, 40,000 rows (train_step and a device dataset)"
        for tool in memcheck racecheck synccheck; do
          for m in S M L; do
            timeout ${SANITIZER_TIMEOUT:-120} "$SANITIZER" --tool $tool --error-exitcode 3 \
              python3 -m mmad.bench --run-train $m:wgmma --rows 40000 > "$W/sanitizer_train_${tool}_$m.log" 2>&1
            echo "$tool train $m rc=$? $(grep -iE 'ERROR SUMMARY|RACECHECK SUMMARY|finite' "$W/sanitizer_train_${tool}_$m.log" | cut -c1-160 | tr '\n' ' ')"
          done
          pack
        done
      ) 2>&1 | tee -a "$SUMMARY"
      pack ;;
    dispatch)
      # docs/benchmarks.md's H100 kernel table: every usable variant measured per model at 2^20 rows, fp16 I/O, PyTorch in the same run
      timeout ${DISPATCH_TIMEOUT:-420} python3 -m mmad.bench --backend cuda --models ${BENCH_MODELS:-S,M,L,W} --rows 1048576 \
        --io fp16 --mode both --peer torch --repeats 20 --dispatch bench/results/dispatch-h100.json \
        --json bench/results/dispatch-h100-bench.json > "$OUT/dispatch.log" 2>&1
      echo "dispatch bench rc=$?" | tee -a "$SUMMARY"; tail -n 24 "$OUT/dispatch.log" | tee -a "$SUMMARY"
      cp bench/results/dispatch-h100.json bench/results/dispatch-h100-bench.json "$OUT"/ ;;
    profile)
      # where the time goes, op by op (CUDA events per kernel): PROFILE="MODEL:VARIANT ..."; each item's
      # rows are timed too (no peer, 5 samples), its per-op lines printed after them
      : > "$OUT/profile.log"
      for item in ${PROFILE:-M:mma W:cublaslt}; do
        timeout 200 python3 -m mmad.bench --backend cuda:${item#*:} --models ${item%%:*} --profile --peer none \
          --repeats 5 >> "$OUT/profile.log" 2>&1
        echo "profile $item rc=$?" >> "$OUT/profile.log"
      done
      tail -n 80 "$OUT/profile.log" | tee -a "$SUMMARY" ;;
    ncu)
      # Nsight Compute on one forward launch per NCU="MODEL:VARIANT ..." (what limits each kernel:
      # speed of light, memory, warp stalls, occupancy); one text report per item, tarred into $OUT/ncu.tgz
      mkdir -p /tmp/ncu
      NCU_BIN=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
      for item in ${NCU:-S:wgmma S:mma M:wgmma M:mma}; do
        timeout ${NCU_TIMEOUT:-150} "$NCU_BIN" --clock-control none \
          -k regex:'^(wgmma_forward|wgmma_forward_half|mlp_forward|mlp_forward_half)$' --launch-skip 2 --launch-count 1 \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
          --section Occupancy --section SchedulerStats --section LaunchStats \
          --metrics regex:'smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
          python3 -m mmad.bench --run-forward "$item" > "/tmp/ncu/${item/:/_}.txt" 2>&1
        echo "ncu $item rc=$?" | tee -a "$SUMMARY"
        grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issued Warp Per|No Eligible|Theoretical Occupancy" \
          "/tmp/ncu/${item/:/_}.txt" | sed 's/^ */  /' | tee -a "$SUMMARY"
        # the five largest stall reasons (warps stalled per issued instruction)
        grep -E "smsp__average_warps_issue_stalled_" "/tmp/ncu/${item/:/_}.txt" | awk '{print $NF, $1}' | sort -gr | head -5 \
          | sed 's/^/  stall /' | tee -a "$SUMMARY"
      done
      tar czf "$OUT/ncu.tgz" -C /tmp ncu ;;
    nvmath)
      python3 -m mmad.bench --nvmath-check 2>&1 | tail -n 12 | tee -a "$SUMMARY" ;;
    serve)
      timeout 240 python3 -m mmad.bench --daemon-check --backend cuda 2>&1 | tee "$OUT/serve.log" | tail -n 6 | tee -a "$SUMMARY" ;;
    bench)
      # the backend's own variant per model, fp16 in and out (BENCH_IO=fp32 for the float32 forward)
      timeout ${BENCH_TIMEOUT:-300} python3 -m mmad.bench --backend cuda --models ${BENCH_MODELS:-S,M,L,W} \
        --io ${BENCH_IO:-fp16} --repeats 30 --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
      echo "bench rc=$?" | tee -a "$SUMMARY"; tail -n 14 "$OUT/bench.log" | tee -a "$SUMMARY" ;;
    cublaslt)
      # the cuBLASLt variant on the wide model and on M, same rules (its own peers and ceilings)
      timeout ${BENCH_TIMEOUT:-300} python3 -m mmad.bench --backend cuda:cublaslt --models W,M --io ${BENCH_IO:-fp16} \
        --repeats 20 > "$OUT/bench_cublaslt.log" 2>&1
      echo "bench cublaslt rc=$?" | tee -a "$SUMMARY"; tail -n 8 "$OUT/bench_cublaslt.log" | tee -a "$SUMMARY" ;;
  esac
done
echo "================ summary"; cat "$SUMMARY"
