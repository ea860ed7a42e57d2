"""``mmad bench``: kernel throughput of the S/M/L/W models (docs/benchmarks.md).

For each chosen backend and model: check the output against the cpu oracle first (float64 on
a subset of rows), then time forward (input already on the device, output left there) and one
full training step (forward, L2 loss, backward, Adam) as the median of ``--repeats`` runs after
warm-up, on fresh random data. The PyTorch peer runs in the same process and the same run
(fp16 with a CUDA graph / autocast + fused Adam on a GPU; fp32 on the CPU). The hardware floor
is max(bytes / copy bandwidth, FLOPs / GEMM rate), both measured in the same run.
Results: ``<out>/<host>-<backend>.json`` and a markdown table next to it.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from tqdm import tqdm

from mmad.bench.torch_peer import forward_fn, torch_mlp, train_step_fn
from mmad.spec import MLPSpec, bench_spec

FP16_TOLERANCE = 3e-3
CHECK_ROWS = 4096


def median_seconds(fn: Callable[[], Any], sync: Callable[[], None], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- hardware floor ------------------------------------------------------------------------
def measure_floor(on_gpu: bool) -> dict[str, Any]:
    """Copy bandwidth (bytes read + written per second) and GEMM rate, measured now."""
    if on_gpu:
        import torch

        a = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        copy_s = median_seconds(lambda: b.copy_(a), torch.cuda.synchronize, 10)
        n = 8192
        x = torch.randn(n, n, dtype=torch.float16, device="cuda")
        y = torch.randn(n, n, dtype=torch.float16, device="cuda")
        gemm_s = median_seconds(lambda: x @ y, torch.cuda.synchronize, 10)
        return {"copy_bytes_per_s": 2 * a.numel() / copy_s, "gemm_flops_per_s": 2 * n**3 / gemm_s,
                "gemm_type": "fp16 (torch, cuBLAS)", "device": torch.cuda.get_device_name()}
    a = np.random.default_rng(0).random(1 << 25, dtype=np.float32)  # 128 MiB: past every cache
    b = np.empty_like(a)
    copy_s = median_seconds(lambda: np.copyto(b, a), lambda: None, 5)
    n = 2048
    x = np.random.default_rng(1).random((n, n), dtype=np.float32)
    gemm_s = median_seconds(lambda: x @ x, lambda: None, 5)
    return {"copy_bytes_per_s": 2 * a.nbytes / copy_s, "gemm_flops_per_s": 2 * n**3 / gemm_s,
            "gemm_type": "fp32 (NumPy BLAS)", "device": platform.processor() or platform.machine()}


def floor_seconds(spec: MLPSpec, batch: int, floor: dict[str, Any], training: bool, io_bytes: int) -> float:
    per_sample_bytes = io_bytes * (spec.n_input_dims + spec.n_output_dims * (2 if training else 1))
    flops = spec.flops_per_sample() * (3 if training else 1) * batch
    return max(per_sample_bytes * batch / floor["copy_bytes_per_s"], flops / floor["gemm_flops_per_s"])


# -- measurements --------------------------------------------------------------------------
def check_against_oracle(model: Any, spec: MLPSpec, x: np.ndarray) -> float:
    from mmad.backends.cpu import CpuBackend

    oracle = CpuBackend("float64").compile(spec)
    oracle.set_params(model.get_params())
    ref = oracle.forward(x[:CHECK_ROWS]).astype(np.float64)
    out = np.asarray(model.forward(x[:CHECK_ROWS]), dtype=np.float64)
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def bench_mmad(backend_arg: str, names: list[str], batch: int, repeats: int, training: bool,
               bar: tqdm) -> list[dict[str, Any]]:
    from mmad.backends import select

    backend, row = select(backend_arg)
    results = []
    rng = np.random.default_rng(2026)
    for name in names:
        spec = bench_spec(name)
        model = backend.compile(spec, variant=row.variant)
        x = rng.standard_normal((batch, spec.n_input_dims), dtype=np.float32)
        y = rng.standard_normal((batch, spec.n_output_dims), dtype=np.float32)
        rel_err = check_against_oracle(model, spec, x)
        entry: dict[str, Any] = {"model": name, "backend": f"{row.backend}:{row.variant}",
                                 "device": row.device, "rel_err_vs_float64": rel_err}
        if not rel_err <= FP16_TOLERANCE:
            entry["error"] = f"output differs from the oracle by {rel_err:.2e} (> {FP16_TOLERANCE}); not timed"
            results.append(entry)
            bar.update(2 if training else 1)
            continue
        dx, dy = model.upload(x), model.upload(y)
        entry["forward_s"] = median_seconds(lambda: model.forward(dx), model.synchronize, repeats)
        bar.update(1)
        if training:
            entry["train_s"] = median_seconds(lambda: model.train_step(dx, dy), model.synchronize, repeats)
            bar.update(1)
        model.close()
        results.append(entry)
    backend.close()
    return results


def bench_torch(names: list[str], batch: int, repeats: int, training: bool, bar: tqdm) -> list[dict[str, Any]]:
    import torch

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    dtype = torch.float16 if on_gpu else torch.float32
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    results = []
    for name in names:
        spec = bench_spec(name)
        net = torch_mlp(spec, device)
        gen = torch.Generator(device=device).manual_seed(7)
        x = torch.randn(batch, spec.n_input_dims, device=device, generator=gen)
        y = torch.randn(batch, spec.n_output_dims, device=device, generator=gen)
        entry: dict[str, Any] = {"model": name, "backend": f"torch-{torch.__version__}-{device}",
                                 "dtype": str(dtype).replace("torch.", "")}
        entry["forward_s"] = median_seconds(forward_fn(net, x), sync, repeats)
        bar.update(1)
        if training:
            entry["train_s"] = median_seconds(train_step_fn(net, x, y), sync, repeats)
            bar.update(1)
        results.append(entry)
    return results


# -- reporting -----------------------------------------------------------------------------
def summarise(mmad_rows: list[dict[str, Any]], peer_rows: list[dict[str, Any]], batch: int,
              floor: dict[str, Any], io_bytes: int) -> list[dict[str, Any]]:
    peers = {r["model"]: r for r in peer_rows}
    for row in mmad_rows:
        spec = bench_spec(row["model"])
        peer = peers.get(row["model"], {})
        for kind, training in (("forward", False), ("train", True)):
            seconds = row.get(f"{kind}_s")
            if seconds is None:
                continue
            row[f"{kind}_msamples_per_s"] = batch / seconds / 1e6
            row[f"{kind}_pct_floor"] = 100 * floor_seconds(spec, batch, floor, training, io_bytes) / seconds
            if peer.get(f"{kind}_s"):
                row[f"{kind}_vs_peer"] = peer[f"{kind}_s"] / seconds
                peer[f"{kind}_msamples_per_s"] = batch / peer[f"{kind}_s"] / 1e6
    return mmad_rows


def markdown_table(rows: list[dict[str, Any]], peer_name: str) -> str:
    lines = ["| model | backend | forward M samples/s | vs peer | % floor | training M samples/s | vs peer | % floor | rel. err |",
             "|---|---|---|---|---|---|---|---|---|"]

    def fmt(value: Any, pattern: str) -> str:
        return pattern.format(value) if isinstance(value, (int, float)) else "–"

    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['backend']} | {r['error']} | | | | | | |")
            continue
        lines.append(
            f"| {r['model']} | {r['backend']} | {fmt(r.get('forward_msamples_per_s'), '{:.2f}')} | "
            f"{fmt(r.get('forward_vs_peer'), '{:.2f}×')} | {fmt(r.get('forward_pct_floor'), '{:.1f}%')} | "
            f"{fmt(r.get('train_msamples_per_s'), '{:.2f}')} | {fmt(r.get('train_vs_peer'), '{:.2f}×')} | "
            f"{fmt(r.get('train_pct_floor'), '{:.1f}%')} | {r['rel_err_vs_float64']:.1e} |")
    lines.append(f"\nPeer: {peer_name}.")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    names = [n.strip().upper() for n in args.models.split(",") if n.strip()]
    for n in names:
        bench_spec(n)  # validates the names
    training = not args.no_training
    backends = args.backend or [""]
    try:
        import torch  # noqa: F401

        have_torch = not args.no_peer
    except ImportError:
        have_torch = False
    on_gpu = have_torch and __import__("torch").cuda.is_available()
    steps = len(names) * (2 if training else 1) * (len(backends) + (1 if have_torch else 0))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname().split(".")[0]
    with tqdm(total=steps, desc="mmad bench", unit="figure") as bar:
        floor = measure_floor(on_gpu)
        # peer and mmad are timed model by model, back to back, so that a change in the
        # machine's load during the run shifts both sides of each ratio alike
        peer_rows: list[dict[str, Any]] = []
        by_backend: dict[str, list[dict[str, Any]]] = {b: [] for b in backends}
        for name in names:
            if have_torch:
                peer_rows += bench_torch([name], args.batch, args.repeats, training, bar)
            for backend_arg in backends:
                by_backend[backend_arg] += bench_mmad(backend_arg, [name], args.batch, args.repeats, training, bar)
        peer_name = peer_rows[0]["backend"] + f" ({peer_rows[0]['dtype']})" if peer_rows else "none (PyTorch not importable)"
        for backend_arg in backends:
            rows = by_backend[backend_arg]
            io_bytes = 2  # fp16 activations in and out (docs/benchmarks.md)
            summarise(rows, peer_rows, args.batch, floor, io_bytes)
            label = rows[0]["backend"].replace(":", "-") if rows else backend_arg or "auto"
            doc = {"host": host, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "batch": args.batch, "repeats": args.repeats, "floor": floor,
                   "peer": peer_rows, "results": rows}
            (out_dir / f"{host}-{label}.json").write_text(json.dumps(doc, indent=2))
            table = markdown_table(rows, peer_name)
            (out_dir / f"{host}-{label}.md").write_text(
                f"# {host}: {label}, batch {args.batch}, median of {args.repeats}\n\n{table}\n\n"
                f"Floor: copy {floor['copy_bytes_per_s'] / 1e9:.1f} GB/s, GEMM {floor['gemm_flops_per_s'] / 1e12:.2f} TFLOP/s "
                f"({floor['gemm_type']}), measured in the same run.\n")
            tqdm.write(table)
    return 0
