"""Throughput of the vulkan backend (simt and coopmat) vs PyTorch fp16 on the same GPU, same run.

docs/benchmarks.md's method: models S/M/L/W at batch 2^20 (``--rows``), input already on the
device and output left there; forward = one fused-kernel submission re-submitted ``--reps``
times per timing, training = ``train_step(steps=reps)`` on device arrays (forward, L2 loss,
backward, weight gradients, Adam); median of ``--repeats`` timings after a warm-up; outputs
checked against the cpu oracle (float64) on the first 4096 rows before timing; GPU timestamps
around every dispatch (in programs recorded again for that, after the wall-clock timings) give
the kernels' own time (``forward_gpu_s``, ``train_gpu_s`` and its split by kernel), so host and
submission costs show as the difference to the wall-clock figures;
with ``MMAD_VULKAN_PIPELINE_STATS=1`` the driver's compiler statistics (registers, spills) of
each kernel are recorded too. PyTorch peers:
``nn.Sequential`` fp16 forward through a CUDA graph, training with autocast + fused Adam.
Floor: max(bytes / measured copy bandwidth, FLOPs / measured fp16 GEMM rate), both measured
here. Writes JSON to ``--json`` and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from mmad.backends.cpu import CpuBackend
from mmad.backends.vulkan import VulkanBackend
from mmad.errors import InvalidInput
from mmad.spec import bench_spec


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_peers(spec, rows: int, reps: int, repeats: int) -> dict:
    import torch
    dims = [spec.n_input_dims] + [spec.n_neurons] * spec.n_hidden_layers + [spec.n_output_dims]
    layers = []
    for i in range(len(dims) - 1):
        layers.append(torch.nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            layers.append(torch.nn.ReLU())
    net = torch.nn.Sequential(*layers).cuda()
    x = torch.rand(rows, spec.n_input_dims, device="cuda")
    y = torch.rand(rows, spec.n_output_dims, device="cuda")
    half = torch.nn.Sequential(*layers).cuda().half()
    xh = x.half()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(3):
            half(xh)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        half(xh)

    def fwd():
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()

    net = net.float()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, fused=True)

    def step():
        for _ in range(reps):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(net(x).float(), y)
            loss.backward()
            opt.step()
        torch.cuda.synchronize()

    return {"forward_s": median_time(fwd, repeats) / reps, "train_s": median_time(step, repeats) / reps}


def hardware_floor() -> dict:
    import torch
    a = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    copy = median_time(lambda: (b.copy_(a), torch.cuda.synchronize()), 10)
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    gemm = median_time(lambda: (m @ m, torch.cuda.synchronize()), 10)
    return {"copy_bytes_per_s": 2 * a.numel() / copy, "fp16_flops_per_s": 2 * 8192 ** 3 / gemm}


def floor_s(spec, rows: int, floor: dict, training: bool) -> float:
    io = spec.n_input_dims + spec.n_output_dims * (2 if training else 1)
    flops = spec.flops_per_sample() * (3 if training else 1)
    return max(rows * io * 2 / floor["copy_bytes_per_s"], rows * flops / floor["fp16_flops_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1 << 20)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--models", default="SMLW")
    parser.add_argument("--json", default="vulkan_bench.json")
    args = parser.parse_args()

    backend = VulkanBackend()
    rows_by_variant = {r.variant: r for r in backend.probe()}
    for r in rows_by_variant.values():
        print(f"probe vulkan/{r.variant}: available={r.available} device={r.device!r} "
              f"shapes={[str(s) for s in r.mma_shapes]} reason={r.reason!r} details={r.details}", flush=True)
    floor = hardware_floor()
    print(f"floor: copy {floor['copy_bytes_per_s'] / 1e12:.2f} TB/s, fp16 GEMM {floor['fp16_flops_per_s'] / 1e12:.0f} TFLOP/s",
          flush=True)
    results = []
    rng = np.random.default_rng(0)
    for name in args.models:
        spec = bench_spec(name)
        x = rng.uniform(-1, 1, (args.rows, spec.n_input_dims)).astype(np.float32)
        y = rng.uniform(-1, 1, (args.rows, spec.n_output_dims)).astype(np.float32)
        ref = CpuBackend("float64").compile(spec).forward(x[:4096])
        entry = {"model": name, "rows": args.rows, "floor_forward_s": floor_s(spec, args.rows, floor, False),
                 "floor_train_s": floor_s(spec, args.rows, floor, True)}
        try:
            entry["torch"] = torch_peers(spec, args.rows, args.reps, args.repeats)
        except Exception as exc:  # noqa: BLE001 - report and go on
            entry["torch"] = {"error": f"{type(exc).__name__}: {exc}"}
        for variant in ("simt", "coopmat"):
            if not rows_by_variant[variant].available:
                entry[variant] = {"error": rows_by_variant[variant].reason}
                continue
            result: dict = {}
            try:
                start = time.perf_counter()
                model = backend.compile(spec, variant)
                result["compile_s"] = time.perf_counter() - start
                stats = model.pipeline_statistics()
                if any(stats.values()):
                    result["pipeline_stats"] = stats
                result["geometry"] = {"rows_per_tile": model.geo.rows_per_tile, "threads": model.geo.threads,
                                      "shape": model.geo.coopmat}
                dx = model.upload(x)
                out = model.forward(dx)
                got = model.download(out)[:4096]
                result["rel_err_vs_float64"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                program = model.forward_into(dx, out, run=False)
                result["forward_s"] = median_time(lambda: program.run(times=args.reps), args.repeats) / args.reps
                train_rows = args.rows
                while True:
                    try:
                        tx = dx if train_rows == args.rows else model.upload(x[:train_rows])
                        dy = model.upload_target(y[:train_rows])
                        model.train_step(tx, dy, steps=1)
                        train = median_time(lambda: model.train_step(tx, dy, steps=args.reps),
                                            max(3, args.repeats // 4))
                        # per-sample time scaled to the full batch, so the table compares rates
                        result["train_s"] = train / args.reps * args.rows / train_rows
                        result["train_rows"] = train_rows
                        # GPU time per kernel, in programs re-recorded with timestamps
                        model.set_gpu_timestamps(True)
                        model.forward_into(dx, out).run(times=args.reps)
                        result["forward_gpu_s"] = sum(t for _, t in model.gpu_times("forward"))
                        model.train_step(tx, dy, steps=args.reps)
                        split: dict[str, float] = {}
                        for kernel, t in model.gpu_times("train"):  # the last step's dispatches
                            split[kernel] = split.get(kernel, 0.0) + t * args.rows / train_rows
                        result["train_gpu_s"] = sum(split.values())
                        result["train_gpu_split_s"] = split
                        model.set_gpu_timestamps(False)
                        break
                    except InvalidInput as exc:  # a buffer over maxStorageBufferRange: halve the batch
                        result["train_note"] = str(exc)
                        train_rows //= 2
                        if train_rows < 65536:
                            break
                model.close()
            except Exception as exc:  # noqa: BLE001
                result["error"] = f"{type(exc).__name__}: {exc}"
            entry[variant] = result
            print(name, variant, json.dumps(result), flush=True)
        results.append(entry)
        print(name, "torch", json.dumps(entry["torch"]), flush=True)
    backend.close()
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump({"floor": floor, "results": results}, f, indent=2)

    def msps(seconds):
        return f"{args.rows / seconds / 1e6:8.1f}" if seconds else "       -"

    def gpu_ms(v):
        return f"{v * 1e3:7.3f}" if v else "      -"

    print(f"\nbatch {args.rows} rows, million samples/s (x = ratio to PyTorch, % = of hardware floor; "
          "gpu = ms of GPU time per call from timestamps, wall-clock rates include submission)")
    print(f"{'model':5} {'pass':8} {'torch':>8} {'simt':>8} {'x':>5} {'%':>5} {'gpu':>7} "
          f"{'coopmat':>8} {'x':>5} {'%':>5} {'gpu':>7} {'cm/simt':>7}")
    for e in results:
        for kind, key in (("fwd", "forward_s"), ("train", "train_s")):
            t = e["torch"].get(key)
            s = e.get("simt", {}).get(key)
            c = e.get("coopmat", {}).get(key)
            fl = e["floor_forward_s" if kind == "fwd" else "floor_train_s"]
            ratio = lambda v: f"{t / v:5.2f}" if (t and v) else "    -"  # noqa: E731
            pct = lambda v: f"{100 * fl / v:5.1f}" if v else "    -"  # noqa: E731
            cm_simt = f"{s / c:7.2f}" if (s and c) else "      -"
            gkey = "forward_gpu_s" if kind == "fwd" else "train_gpu_s"
            sg, cg = e.get("simt", {}).get(gkey), e.get("coopmat", {}).get(gkey)
            print(f"{e['model']:5} {kind:8} {msps(t)} {msps(s)} {ratio(s)} {pct(s)} {gpu_ms(sg)} "
                  f"{msps(c)} {ratio(c)} {pct(c)} {gpu_ms(cg)} {cm_simt}")


if __name__ == "__main__":
    main()
