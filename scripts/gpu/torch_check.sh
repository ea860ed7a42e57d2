#!/usr/bin/env bash
# mmad.torch and the backward from an outside gradient on a CUDA GPU host (docs/torch.md), in one
# device call of at most ~5 minutes:
#   1. env: the GPU, CuPy and torch (torch must be a CUDA build), the cuda probe;
#   2. tests: tests/test_torch_cuda.py (device encodings against numerics, the cuda backward of the
#      mma / wgmma / device-encoded models against the cpu oracles, mmad.torch on CUDA tensors against
#      CPU tensors, a tcnn checkpoint, 200 Adam steps, side streams without synchronisation) and the
#      grid tests whose paths the device encodings changed (tests/test_cuda_grids.py: the composites
#      with parameter-free parts, datasets; TEST_SELECT="not nothing" runs all of both files);
#   3. bench: `mmad bench --torch` at batch 2^18, fp16: the image config and the instant-NGP-like
#      composite, forward + backward from an outside dL/dy, params only / with input grads, against
#      mmad.export.to_torch in the same run; the JSON to $OUT/torch-h200.json.
#   4. profile (not in the default): scripts/gpu/torch_profile.py, where each step's time goes.
#   scripts/gpu/torch_check.sh [phase ...]     phases: env tests bench profile (default: env tests bench)
# Run from the repository root with .whl carried (scripts/gpu/site.sh); logs go under $OUT (or
# /tmp/out), the short table is printed last.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PHASES=${*:-"env tests bench"}
. scripts/gpu/site.sh
SUMMARY="$OUT/torch-summary.txt"
: > "$SUMMARY"

for phase in $PHASES; do
  case $phase in
    env)
      { nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv;
        python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())";
        timeout 120 python3 -m mmad.cli probe --backend cuda; } 2>&1 | tee "$OUT/torch-env.log" | tee -a "$SUMMARY" ;;
    tests)
      start=$(date +%s)
      timeout ${TEST_TIMEOUT:-170} python3 -m pytest -p no:cacheprovider -o addopts="" -n ${TEST_WORKERS:-6} \
        tests/test_torch_cuda.py tests/test_cuda_grids.py \
        -k "${TEST_SELECT:-not test_cuda_grids or instant_ngp or two_grids or train_epochs}" \
        --timeout 160 -v --tb=short -rfEs > "$OUT/torch-pytest.log" 2>&1
      echo "pytest rc=$? in $(( $(date +%s) - start )) s: $(tail -n 1 "$OUT/torch-pytest.log")" | tee -a "$SUMMARY"
      grep -E "(FAILED|ERROR) " "$OUT/torch-pytest.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort -u | head -30 | tee -a "$SUMMARY"
      grep -cE " PASSED" "$OUT/torch-pytest.log" | sed 's/^/passed: /' | tee -a "$SUMMARY" ;;
    bench)
      timeout ${BENCH_TIMEOUT:-150} python3 -m mmad.cli bench --torch --device cuda --rows ${BENCH_ROWS:-262144} \
        --repeats ${BENCH_REPEATS:-20} ${BENCH_ARGS:-} --json "$OUT/torch-h200.json" --markdown "$OUT/torch-h200.md" \
        > "$OUT/torch-bench.log" 2>&1
      echo "torch bench rc=$?" | tee -a "$SUMMARY"; tail -n 8 "$OUT/torch-bench.log" | tee -a "$SUMMARY" ;;
    profile)
      # where a forward + backward's time goes: wall vs GPU busy, the kernels, the host's calls
      PYTHONPATH=$PWD:$PYTHONPATH timeout ${PROFILE_TIMEOUT:-120} python3 scripts/gpu/torch_profile.py > "$OUT/torch-profile.log" 2>&1
      echo "torch profile rc=$?" | tee -a "$SUMMARY"; grep -E "^== " "$OUT/torch-profile.log" | tee -a "$SUMMARY" ;;
    *)
      echo "unknown phase $phase (env tests bench profile)" | tee -a "$SUMMARY" ;;
  esac
done
echo "=== summary"
cat "$SUMMARY"
