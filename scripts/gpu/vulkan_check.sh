#!/usr/bin/env bash
# The vulkan backend on an offline NVIDIA host against the cuda backend on the same GPU, in one device
# call (carry .gl and .whl: the Vulkan loader + GL dispatch debs and the wheels, scripts/gpu/site.sh;
# .whl also holds slangpy's libslang-glslang-*.so, the coopmat2 kernels' compiler, see below).
#   OUT=<dir> bash scripts/gpu/vulkan_check.sh [phase ...]
# phases (default: env tests hashgrid bench ratios, about 5 minutes), each under `timeout`, logs and JSON under $OUT:
#   env       the GPU, `mmad probe --backend vulkan` (every variant's extension, shapes or reason; coopmat2's
#             VK_NV_cooperative_matrix2 features, properties and flexible-dimension shapes) and cuda's
#   tests     the vulkan tests on the NVIDIA driver: tests/test_vulkan.py, test_vulkan_grids.py and
#             test_vulkan_epochs.py on the variants of MMAD_TEST_VULKAN_VARIANTS (default coopmat2: lavapipe
#             in CI runs simt), TEST_SELECT a -k expression, MMAD_TEST_VULKAN_LARGE=1 adds the 2^20-row cases
#   bench     `mmad bench` forward + training, 2^20 rows, fp16 I/O, on VULKAN_BACKENDS (default
#             vulkan:coopmat2,vulkan:coopmat) and $CUDA_BACKEND (default cuda: the variant its dispatcher
#             chooses, measured once per model and kept in the kernel cache: cold, it takes minutes a model)
#             in one process per model of MODELS (default "S M L W"), within BENCH_TIMEOUT seconds in all; the
#             rows are merged into $OUT/vulkan-h200.json (BENCH_ARGS: more options, e.g. '--profile')
#   hashgrid  `mmad bench --hashgrid` (tcnn's hash-grid image config, tables 2^15 and 2^19, fp16) on vulkan
#             (its own choice: coopmat2 where offered) and $CUDA_BACKEND; JSON to $OUT/hashgrid-h200.json
#   ratios    the vulkan ÷ cuda table of both JSONs, a row per vulkan variant (the issue's bar: 0.8), printed last
#   profile   PROFILE_BACKEND (default vulkan:coopmat2) alone on PROFILE_MODELS (default L,W) with GPU timestamps
#             per dispatch and the driver's pipeline statistics; for vulkan:coopmat with the default tiling and
#             with MMAD_VULKAN_COOPMAT_SUBGROUPS=4: a summary to $OUT/profile.txt
#   tiles     vulkan:coopmat2 on TILE_MODELS (default M,L) with each tile of TILES (default "128x256 64x256
#             64x128 128x128": MMAD_VULKAN_COOPMAT2_TILE, rows x invocations) within TILES_TIMEOUT seconds:
#             forward and training M samples/s a line, to $OUT/tiles.txt
#   serve     the daemon on the vulkan backend end to end (client -> HTTP -> kernels)
# Every measurement runs through `python3 -m mmad.bench` (= `mmad bench`, docs/benchmarks.md).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/vulkan-check-out}
mkdir -p "$OUT"
PHASES=${*:-"env tests hashgrid bench ratios"}
CUDA_BACKEND=${CUDA_BACKEND:-cuda}
VULKAN_BACKENDS=${VULKAN_BACKENDS:-vulkan:coopmat2,vulkan:coopmat}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
. scripts/gpu/site.sh
export PYTHONPATH=/tmp/site:$PWD:$PWD/client  # the packages are ./mmad and ./client/mmad_client (not installed there)
export LD_LIBRARY_PATH=/tmp/site/cmeel.prefix/lib:${LD_LIBRARY_PATH:-} PATH=/tmp/site/cmeel.prefix/bin:$PATH
export MMAD_CACHE_DIR=/tmp/mmad-kernels MMAD_TEST_VULKAN_LARGE=${MMAD_TEST_VULKAN_LARGE:-0}
# the coopmat2 kernels' compiler: the slangpy wheel (92 MB) exceeds what a call carries, so .whl holds its
# glslang library alone (cp .venv/lib/python3*/site-packages/slangpy/libslang-glslang-*.so .whlvk/)
slang=$(ls "$PWD"/.whl/libslang-glslang*.so "$PWD"/.whlvk/libslang-glslang*.so 2>/dev/null | tail -n 1)
[ -n "$slang" ] && export MMAD_SLANG_GLSLANG=${MMAD_SLANG_GLSLANG:-$slang}
export MMAD_TEST_VULKAN_VARIANTS=${MMAD_TEST_VULKAN_VARIANTS:-coopmat2}

for phase in $PHASES; do
  start=$(date +%s)
  case $phase in
    env)
      { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
        timeout 60 python3 -P -m mmad.cli probe --backend vulkan
        timeout 60 python3 -P -m mmad.cli probe --backend vulkan --json > "$OUT/probe-vulkan.json"
        timeout 60 python3 -P -m mmad.cli probe --backend cuda; } 2>&1 | tee "$OUT/probe.log" | tee -a "$SUMMARY" ;;
    tests)
      workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${TEST_WORKERS:-4}")
      timeout ${TEST_TIMEOUT:-90} python3 -P -m pytest -q -p no:cacheprovider -o addopts="" $workers \
          tests/test_vulkan.py tests/test_vulkan_grids.py tests/test_vulkan_epochs.py ${TEST_SELECT:+-k "$TEST_SELECT"} \
          -rfEs --tb=short --durations=10 > "$OUT/pytest.log" 2>&1
      echo "pytest rc=$? in $(( $(date +%s) - start )) s: $(tail -n 1 "$OUT/pytest.log")" | tee -a "$SUMMARY"
      grep -E "^(FAILED|ERROR) " "$OUT/pytest.log" | sort -u | head -30 | tee -a "$SUMMARY" ;;
    bench)
      : > "$OUT/bench.log"
      for model in ${MODELS:-S M L W}; do  # a model a process: what finished survives the time limit
        left=$(( ${BENCH_TIMEOUT:-120} - ($(date +%s) - start) ))
        [ "$left" -gt 5 ] || { echo "bench: no time left for $model" | tee -a "$SUMMARY"; break; }
        timeout $left python3 -P -m mmad.bench --backend "$VULKAN_BACKENDS,$CUDA_BACKEND" --models $model --io fp16 \
            --mode both --peer none --repeats ${REPEATS:-10} ${BENCH_ARGS:-} --json "$OUT/bench-$model.json" \
            >> "$OUT/bench.log" 2>&1
        echo "bench $model rc=$? at $(( $(date +%s) - start )) s" | tee -a "$SUMMARY"
      done
      # the models' rows into one document (a later call's rows of a model replace an earlier call's)
      python3 -P - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
merged = out / "vulkan-h200.json"
doc = json.loads(merged.read_text()) if merged.exists() else {"results": [], "errors": []}
for part in sorted(out.glob("bench-*.json")):
    one = json.loads(part.read_text())
    models = {r["model"] for r in one["results"]}
    doc = {**one, "results": [r for r in doc["results"] if r["model"] not in models] + one["results"],
           "errors": doc.get("errors", []) + one["errors"]}
    part.unlink()
merged.write_text(json.dumps(doc, indent=2))
EOF
      grep -E "^\| [SMLW] |^Not timed|^Dispatcher" "$OUT/bench.log" | tee -a "$SUMMARY" ;;
    hashgrid)
      timeout ${HASHGRID_TIMEOUT:-80} python3 -P -m mmad.cli bench --hashgrid --backend "vulkan,$CUDA_BACKEND" \
          --precision fp16 --peer none --repeats ${HASHGRID_REPEATS:-5} ${HASHGRID_ARGS:-} \
          --json "$OUT/hashgrid-h200.json" > "$OUT/hashgrid.log" 2>&1
      echo "hashgrid bench rc=$? in $(( $(date +%s) - start )) s" | tee -a "$SUMMARY"
      tail -n 12 "$OUT/hashgrid.log" | tee -a "$SUMMARY" ;;
    profile)
      profiled=${PROFILE_BACKEND:-vulkan:coopmat2}
      caps=16; [ "$profiled" = vulkan:coopmat ] && caps="16 4"  # the KHR kernels' subgroup cap
      for cap in $caps; do
        MMAD_VULKAN_COOPMAT_SUBGROUPS=$cap timeout ${PROFILE_TIMEOUT:-60} python3 -P -m mmad.bench \
            --backend "$profiled" --models ${PROFILE_MODELS:-L,W} --io fp16 --mode both --peer none --repeats 5 \
            --profile --json "$OUT/profile-$cap.json" > /dev/null 2>&1
        echo "profile $profiled (at most $cap subgroups) rc=$?" | tee -a "$SUMMARY"
      done
      python3 -P - "$OUT" <<'EOF' 2>&1 | tee "$OUT/profile.txt" | tee -a "$SUMMARY"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
for cap in (16, 4):
    path = out / f"profile-{cap}.json"
    if not path.exists():
        continue
    for r in json.loads(path.read_text())["results"]:
        geo = r.get("geometry", {})
        split = ", ".join(f"{k.split('/')[-1]} {1e3 * v:.3f}" for k, v in r.get("gpu_split_s", {}).items())
        regs = {name: max((v for ex in stats.values() for key, v in ex.items() if "egister" in key), default=None)
                for name, stats in r.get("pipeline_stats", {}).items()}
        print(f"{r['backend']} {r['model']} {r['mode']} <= {cap} subgroups: R {geo.get('rows_per_tile')}, "
              f"{geo.get('threads')} threads, wgrad tile {geo.get('weight_gradient_tile', '64x64')}, "
              f"{r['samples_per_s'] / 1e6:,.0f} M samples/s, GPU {1e3 * r.get('gpu_seconds', 0):.3f} ms"
              + (f" ({split})" if split else "") + (f"; registers {regs}" if r["mode"] == "forward" else ""))
    path.unlink()
EOF
      ;;
    serve)
      timeout 120 python3 -m mmad.bench --daemon-check --backend vulkan 2>&1 | tee "$OUT/serve.log" | tail -n 6 ;;
    tiles)
      : > "$OUT/tiles.txt"
      for tile in ${TILES:-128x256 64x256 64x128 128x128}; do
        left=$(( ${TILES_TIMEOUT:-120} - ($(date +%s) - start) ))
        [ "$left" -gt 5 ] || { echo "tiles: no time left for $tile" | tee -a "$SUMMARY"; break; }
        MMAD_VULKAN_COOPMAT2_TILE=$tile timeout $left python3 -P -m mmad.bench --backend vulkan:coopmat2 \
            --models ${TILE_MODELS:-M,L} --io fp16 --mode both --peer none --repeats 5 --json "$OUT/tile-$tile.json" \
            > "$OUT/tile-$tile.log" 2>&1
        python3 -P - "$OUT/tile-$tile.json" "$tile" <<'EOF' 2>&1 | tee -a "$OUT/tiles.txt" | tee -a "$SUMMARY"
import json, sys
from pathlib import Path

path, tile = Path(sys.argv[1]), sys.argv[2]
rows = json.loads(path.read_text())["results"] if path.exists() else []
print(f"tile {tile}: " + ("; ".join(f"{r['model']} {r['mode']} {r['samples_per_s'] / 1e6:,.0f}" for r in rows
                                    if r.get("samples_per_s")) or "no figures (see the log)"))
EOF
      done ;;
    ratios)
      python3 -P - "$OUT/vulkan-h200.json" "$OUT/hashgrid-h200.json" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
from pathlib import Path

bench, grid = (Path(p) for p in sys.argv[1:3])
lines = ["| model | pass | vulkan | M samples/s | cuda | M samples/s | vulkan ÷ cuda |", "|---|---|---|---|---|---|---|"]
if bench.exists():
    rows = [r for r in json.loads(bench.read_text())["results"] if r.get("seconds")]
    for model in ("S", "M", "L", "W"):
        for mode in ("forward", "train"):
            here = [r for r in rows if r["model"] == model and r["mode"] == mode]
            cuda = next((r for r in here if r["backend"].startswith("cuda")), None)
            for v in (r for r in here if r["backend"].startswith("vulkan")):  # a row per vulkan variant
                if cuda is not None:
                    lines.append(f"| {model} | {mode} ({v['io']}) | {v['backend']} | {v['samples_per_s'] / 1e6:,.0f} | "
                                 f"{cuda['backend']} | {cuda['samples_per_s'] / 1e6:,.0f} | "
                                 f"{cuda['seconds'] / v['seconds']:.2f} |")
if grid.exists():
    rows = [r for r in json.loads(grid.read_text())["results"] if r["status"] == "measured"]
    for size in sorted({r["log2_hashmap_size"] for r in rows}):
        got = {r["backend"].partition(":")[0]: r for r in rows if r["log2_hashmap_size"] == size}
        for mode, key in (("forward", "infer_msps"), ("train", "train_msps")):
            if "vulkan" in got and "cuda" in got:
                v, c = got["vulkan"], got["cuda"]
                lines.append(f"| hash 2^{size} | {mode} | {v['backend']} | {v[key]:,.0f} | {c['backend']} | "
                             f"{c[key]:,.0f} | {v[key] / c[key]:.2f} |")
print("\n".join(lines) if len(lines) > 2 else "no vulkan and cuda figures to compare")
EOF
      ;;
    *) echo "unknown phase $phase (env tests hashgrid bench ratios profile tiles serve)" | tee -a "$SUMMARY" ;;
  esac
done
