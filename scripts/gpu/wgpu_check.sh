#!/usr/bin/env bash
# wgpu backend on an NVIDIA GPU host (wgpu-native over the NVIDIA Vulkan driver):
#   1. the probe row, 2. tests/test_webgpu.py, 3. forward and training throughput for S/M/L/W at
#   batch 2^20 against PyTorch fp16 in the same run (CUDA-graph forward; autocast + fused Adam);
#   with MMAD_BENCH=1 also `mmad bench --backend wgpu` (its JSON and markdown under $OUT/mmad-bench).
# Run from the repository root through the device tool with carry [".gl", ".whl"] (see
# docs/gpu-notes.md, "GPU host set-up"); logs go to $OUT (or /tmp/wgpu_check), a short table is printed last.
set -uo pipefail
OUT=${OUT:-/tmp/wgpu_check}
mkdir -p "$OUT"

for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# the import names are namespaced (mmad.backends -> backends/): map them without installing
rm -rf .devsrc && mkdir -p .devsrc/mmad && cp -r mmad/* .devsrc/mmad/
for d in backends server shaders bench; do [ -d "$d" ] && ln -s "$PWD/$d" ".devsrc/mmad/$d"; done
export PYTHONPATH=/tmp/site:$PWD/.devsrc PYTHONUNBUFFERED=1

python3 -P - <<'EOF' 2>&1 | tee "$OUT/probe.log"
import json
from mmad.backends.webgpu import WgpuBackend
print(json.dumps(WgpuBackend().probe()[0].to_json(), indent=1))
EOF

start=$(date +%s)
python3 -P -m pytest -q -p no:cacheprovider tests/test_webgpu.py --durations=8 2>&1 | tee "$OUT/pytest.log"
echo "pytest wall: $(( $(date +%s) - start )) s" | tee -a "$OUT/pytest.log"

python3 -P - <<'EOF' 2>&1 | tee "$OUT/bench.log"
"""Throughput at batch 2^20: wgpu vs PyTorch fp16 (same process, same GPU)."""
import statistics, time
import numpy as np
import torch
from mmad.backends.cpu import CpuBackend
from mmad.backends.webgpu import WgpuBackend
from mmad.bench.torch_peer import forward_fn, torch_mlp, train_step_fn
from mmad.spec import bench_spec

ROWS = 1 << 20
REPS = 20
rows_out = []


def timed(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPS):
        start.record(); fn(); end.record(); end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def torch_peer(spec, x_np, y_np):
    net = torch_mlp(spec, "cuda")
    x, y = torch.from_numpy(x_np).cuda(), torch.from_numpy(y_np).cuda()
    fwd, train = timed(forward_fn(net, x)), timed(train_step_fn(net, x, y))
    del net, x, y
    torch.cuda.empty_cache()
    return fwd, train


backend = WgpuBackend()
print("adapter:", backend.probe()[0].device)
for name in ("S", "M", "L", "W"):
    spec = bench_spec(name)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, spec.n_input_dims), dtype=np.float32)
    y = rng.standard_normal((ROWS, spec.n_output_dims), dtype=np.float32)
    t_fwd, t_train = torch_peer(spec, x, y)
    m = backend.compile(spec)
    xd, yd = m.upload(x), m.upload(y)
    out = m.download(m.forward(xd))
    check = 65536
    ref = CpuBackend("fp32").compile(spec).forward(x[:check])
    err = float(np.linalg.norm(out[:check] - ref) / np.linalg.norm(ref))
    assert np.isfinite(out).all() and err <= 3e-3, f"{name}: forward differs from the cpu oracle by {err}"
    for _ in range(3):
        m.forward(xd)
    m.synchronize()
    # a read-back sync costs about a millisecond: time 10 back-to-back launches per sample
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
            m.forward(xd)
        m.synchronize()
        times.append((time.perf_counter() - t0) / 10)
    w_fwd = statistics.median(times)
    losses = m.train_step(xd, yd, steps=2)
    assert np.isfinite(losses).all(), f"{name}: training produced {losses}"
    times = []
    for _ in range(3):  # train_step(steps=10) is one submission and one read-back of the losses
        t0 = time.perf_counter(); m.train_step(xd, yd, steps=10); times.append((time.perf_counter() - t0) / 10)
    w_train = statistics.median(times)
    flops = spec.flops_per_sample() * ROWS
    print(f"{name}: plan rows/workgroup={m.plan.rows} fwd stages={[(s.k, s.n, s.kc) for s in m.plan.fwd]}"
          f" chunk={m.plan.chunk_rows} storage={m.storage} fwd err={err:.2e}"
          f" wgpu fwd {w_fwd*1e3:.2f} ms ({flops / w_fwd / 1e12:.2f} TFLOP/s) train {w_train*1e3:.2f} ms"
          f" ({3 * flops / w_train / 1e12:.2f} TFLOP/s); torch fwd {t_fwd*1e3:.2f} ms train {t_train*1e3:.2f} ms")
    rows_out.append((name, ROWS / w_fwd / 1e6, ROWS / t_fwd / 1e6, ROWS / w_train / 1e6, ROWS / t_train / 1e6))
    m.close()

print("\n| model | wgpu fwd Ms/s | torch fp16 fwd Ms/s | ratio | wgpu train Ms/s | torch train Ms/s | ratio |")
print("|---|---|---|---|---|---|---|")
for name, wf, tf, wt, tt in rows_out:
    print(f"| {name} | {wf:.1f} | {tf:.1f} | {wf / tf:.3f} | {wt:.1f} | {tt:.1f} | {wt / tt:.3f} |")
EOF

# the same comparison through `mmad bench` (its own timing: one synchronize per sample, which costs
# wgpu about a millisecond of read-back, so this table understates the small models)
if [ -n "${MMAD_BENCH:-}" ]; then
  python3 -P -m mmad.cli bench --backend wgpu --models ${MMAD_BENCH_MODELS:-S,M,L,W} --repeats ${MMAD_BENCH_REPEATS:-5} \
    --out "$OUT/mmad-bench" 2>&1 | tail -n 12 | tee "$OUT/mmad-bench.log"
fi
