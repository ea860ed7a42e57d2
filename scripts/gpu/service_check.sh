#!/usr/bin/env bash
# Serving on a GPU host in one device call (<= 9 minutes): the transport tests, then the GPU
# serving report (docs/benchmarks.md, "Serving on a GPU").
#   [BACKEND=cuda:mma] [VULKAN=vulkan:coopmat] [WORKERS=8] [SHM_CLIENTS=8,16,32] scripts/gpu/service_check.sh [phase ...]
#   phases: env tests shm service vulkan grpc grpc-native (default: env tests service vulkan; shm: the shared-memory
#   attacks of scripts/attack_shm_store.py against page-locked regions)
#   grpc: the gRPC front end's tests (tritonclient.grpc, CUDA shared memory on the GPU) and a short
#   report of gRPC raw contents beside HTTP in one run ($OUT/service-grpc.json): 65,536-row FP16
#   requests at 8 clients against HTTP binary, small requests at 64 clients (bars: HTTP's figure;
#   15,000 req/s with p99 <= 20 ms); grpc-native: that report with the C++ load generator (carry
#   .grpcgen, built by scripts/gpu/grpc_loadgen.sh)
# Expects the repository root on the GPU host with .whl carried (the daemon's dependencies and
# tritonclient with cuda-bindings, py3.12 wheels: scripts/gpu/site.sh); logs go under $OUT (or
# /tmp/out), $OUT/service.json (cuda) and $OUT/service-vulkan.json are the results, the short
# table is printed last. Each phase runs under `timeout`; one that fails does not stop the others.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PHASES=${*:-"env tests service vulkan"}
BACKEND=${BACKEND:-cuda:mma}
VULKAN=${VULKAN:-vulkan:coopmat}
# the daemon's inference workers (mmad serve --workers; docs/service.md, "Several processes")
WORKERS=${WORKERS:-8}
. scripts/gpu/site.sh
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

# the small-request sweep: short points, so that the whole report fits the call
SWEEP="--concurrency 1,8,64,256 --duration-s ${SWEEP_S:-2} --warmup-s 0.5 --large-duration-s ${LARGE_S:-3}"
SWEEP="$SWEEP --large-requests 40 --in-process-repeats 7 --shm-clients ${SHM_CLIENTS:-8,16,32}"

for phase in $PHASES; do
  case $phase in
    env)
      { nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv;
        python3 -c "import cupy; print('cupy', cupy.__version__)";
        python3 -c "import tritonclient.utils.cuda_shared_memory as c; print('tritonclient cuda_shared_memory ok')";
        python3 -c "import grpc, google.protobuf as p; print('grpcio', grpc.__version__, 'protobuf', p.__version__)";
        python3 -m mmad.cli probe --backend cuda; } 2>&1 | tee "$OUT/env.log" | tee -a "$SUMMARY" ;;
    tests)
      start=$(date +%s)
      timeout ${TEST_TIMEOUT:-150} python3 -m pytest -p no:cacheprovider -o addopts="" -n ${TEST_WORKERS:-4} \
        tests/test_cuda_transport.py tests/test_server_cudashm.py tests/test_server_shm.py \
        tests/test_workers.py::test_workers_serve_a_cuda_model_with_system_and_cuda_regions \
        --timeout 120 -v --tb=short -rfEs > "$OUT/pytest.log" 2>&1
      echo "pytest rc=$? in $(( $(date +%s) - start )) s: $(tail -n 1 "$OUT/pytest.log")" | tee -a "$SUMMARY"
      grep -E "(FAILED|ERROR) " "$OUT/pytest.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort -u | head -30 | tee -a "$SUMMARY" ;;
    service)
      timeout ${SERVICE_TIMEOUT:-240} python3 -m mmad.bench --service --backend "$BACKEND" $SWEEP \
        --server-arg=--workers=$WORKERS --json "$OUT/service.json" > "$OUT/service.log" 2>&1
      echo "service bench ($BACKEND, $WORKERS inference workers) rc=$?" | tee -a "$SUMMARY"
      grep -E "^\|" "$OUT/service.log" | tee -a "$SUMMARY" ;;
    vulkan)
      # the same report on the Vulkan backend, shorter: no small-request sweep beyond 64 clients
      timeout ${VULKAN_TIMEOUT:-200} python3 -m mmad.bench --service --backend "$VULKAN" --concurrency 64 \
        --server-arg=--workers=$WORKERS \
        --duration-s 2 --warmup-s 0.5 --large-duration-s 2 --large-requests 20 --in-process-repeats 5 \
        --json "$OUT/service-vulkan.json" > "$OUT/service-vulkan.log" 2>&1
      echo "service bench ($VULKAN) rc=$?" | tee -a "$SUMMARY"
      grep -E "^\|" "$OUT/service-vulkan.log" | tee -a "$SUMMARY" ;;
    grpc)
      start=$(date +%s)
      timeout ${GRPC_TEST_TIMEOUT:-120} python3 -m pytest -p no:cacheprovider -o addopts="" tests/test_grpc.py \
        --timeout 100 -v --tb=short -rfEs > "$OUT/pytest-grpc.log" 2>&1
      echo "gRPC tests rc=$? in $(( $(date +%s) - start )) s: $(tail -n 1 "$OUT/pytest-grpc.log")" | tee -a "$SUMMARY"
      grep -E "(FAILED|ERROR|SKIPPED) " "$OUT/pytest-grpc.log" | head -20 | tee -a "$SUMMARY"
      timeout ${GRPC_TIMEOUT:-200} python3 -m mmad.bench --service --backend "$BACKEND" --concurrency 64 \
        --duration-s ${SWEEP_S:-3} --warmup-s 0.5 --large-duration-s ${LARGE_S:-3} --large-requests 40 \
        --in-process-repeats 3 --gpu-rows 65536 --shm-clients "" --grpc-clients ${GRPC_CLIENTS:-8,64} --grpc-processes ${GRPC_PROCESSES:-4} \
        --server-arg=--workers=$WORKERS --json "$OUT/service-grpc.json" > "$OUT/service-grpc.log" 2>&1
      echo "gRPC beside HTTP ($BACKEND, $WORKERS inference workers) rc=$?" | tee -a "$SUMMARY"
      grep -E "^\||gRPC raw" "$OUT/service-grpc.log" | tee -a "$SUMMARY" ;;
    grpc-native)
      # the same report with the C++ load generator (scripts/gpu/grpc_loadgen.sh built .grpcgen,
      # carried): a gRPC call costs it a fraction of a Python client's CPU, so the generators
      # take fewer of the cores the daemon's workers share
      timeout ${GRPC_TIMEOUT:-200} python3 -m mmad.bench --service --backend "$BACKEND" --concurrency 64 \
        --duration-s ${SWEEP_S:-3} --warmup-s 0.5 --large-duration-s ${LARGE_S:-3} --large-requests 40 \
        --in-process-repeats 3 --gpu-rows 65536 --shm-clients "" --grpc-clients ${GRPC_CLIENTS:-8,64} \
        --grpc-processes ${GRPC_NATIVE_PROCESSES:-2} --grpc-generator "$PWD/.grpcgen/loadgen" \
        --server-arg=--workers=$WORKERS --json "$OUT/service-grpc-native.json" > "$OUT/service-grpc-native.log" 2>&1
      echo "gRPC (native generator) beside HTTP ($BACKEND, $WORKERS inference workers) rc=$?" | tee -a "$SUMMARY"
      grep -E "^\||gRPC raw" "$OUT/service-grpc-native.log" | tee -a "$SUMMARY" ;;
    shm)
      # shared memory under attack on the GPU backend (scripts/attack_shm_store.py): the object shrunk
      # under running infers and a sparse object on a 4 MiB /dev/shm, through the primary's region
      # forwards (--workers 2: page-locked regions, DMA) and in one process (pread/pwrite); one log
      : > "$OUT/shm_attack.log"
      for w in ${SHM_WORKERS:-2 0}; do
        for attack in "shrink-region --rounds ${SHM_ROUNDS:-1000}" "sparse-region --rounds ${SPARSE_ROUNDS:-100}"; do
          timeout ${SHM_TIMEOUT:-150} python3 scripts/attack_shm_store.py --backend "$BACKEND" --workers $w $attack \
            >> "$OUT/shm_attack.log" 2>&1
          echo "workers=$w ${attack%% *} rc=$?: $(tail -n 1 "$OUT/shm_attack.log")" | tee -a "$SUMMARY"
        done
      done ;;
    *) echo "unknown phase $phase (env tests shm service vulkan grpc grpc-native)" | tee -a "$SUMMARY" ;;
  esac
done
echo "==== summary ===="
cat "$SUMMARY"
