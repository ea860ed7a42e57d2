#!/usr/bin/env bash
# Vulkan backend on an offline NVIDIA host (the host: docs/gpu-notes-vulkan.md): unpack the Vulkan loader + GL
# dispatch debs and the wheels carried in .gl/ and .whl/, map the mmad package, run the vulkan
# tests on the NVIDIA driver (simt + coopmat, plus the 2^20-row cases), then the throughput
# benchmark vs PyTorch fp16, then (SERVE=1, the default) the daemon on the vulkan backend end to
# end (client -> HTTP -> coopmat kernels). Logs and JSON go to $OUT (default ./vulkan-check-out).
# TEST_SELECT: a pytest -k expression; BENCH_ARGS: more `mmad bench` options (e.g. '--models M');
# SERVE=0 skips the daemon; PYTEST=0 and BENCH=0 skip the tests and the throughput benchmark;
# JOBS=<models> also runs `mmad bench --jobs` (training jobs through the daemon against in-process
# and PyTorch, docs/benchmarks.md) on vulkan:coopmat, its JSON to $OUT/jobs.json.
# The benchmark and the daemon check run through `python3 -m mmad.bench`.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/vulkan-check-out}
mkdir -p "$OUT"
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/client  # the packages are ./mmad and ./client/mmad_client (not installed there)
export LD_LIBRARY_PATH=/tmp/site/cmeel.prefix/lib:${LD_LIBRARY_PATH:-} PATH=/tmp/site/cmeel.prefix/bin:$PATH
export MMAD_CACHE_DIR=/tmp/mmad-kernels MMAD_TEST_VULKAN_LARGE=${MMAD_TEST_VULKAN_LARGE:-1}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${PYTEST:-1}" = 1 ]; then
  python3 -P -m pytest -q -p no:cacheprovider tests/test_vulkan.py tests/test_vulkan_coopmat.py tests/test_vulkan_epochs.py \
      ${TEST_SELECT:+-k "$TEST_SELECT"} --durations=10 >"$OUT/pytest.log" 2>&1
  echo "pytest exit $?" >>"$OUT/pytest.log"
  tail -n 40 "$OUT/pytest.log"
fi
python3 -P -m mmad.cli probe --backend vulkan 2>&1 | tee "$OUT/probe.log"
# both variants against PyTorch fp16 in the same run; --profile: GPU timestamps per dispatch and the
# driver's pipeline statistics (registers, spills) as well
if [ "${BENCH:-1}" = 1 ]; then
  python3 -P -m mmad.bench --backend vulkan:simt,vulkan:coopmat --profile --json "$OUT/vulkan_bench.json" \
      ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -n 24
fi
if [ -n "${JOBS:-}" ]; then
  timeout ${JOBS_TIMEOUT:-300} python3 -P -m mmad.bench --jobs --backend vulkan:coopmat --models "$JOBS" \
      --repeats ${JOBS_REPEATS:-2} --seconds ${JOBS_SECONDS:-0.6} ${JOBS_EXTRA:-} --json "$OUT/jobs.json" \
      > "$OUT/jobs.log" 2>&1
  echo "jobs bench rc=$?"; tail -n 8 "$OUT/jobs.log"
fi
if [ "${SERVE:-1}" = 1 ]; then
  echo "--- daemon on MMAD_BACKEND=vulkan, end to end"
  timeout 240 python3 -m mmad.bench --daemon-check --backend vulkan 2>&1 | tee "$OUT/serve.log" | tail -n 6
fi
