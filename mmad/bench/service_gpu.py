"""``mmad bench --service --backend cuda:mma`` (or vulkan:coopmat, ...): the GPU serving report,
in one run, against the same run's in-process and hardware figures.

* transport ceiling: host->device and device->host bandwidth of page-locked copies (CuPy, 256 MiB);
* in-process: ``forward_to_host`` of ``--gpu-rows`` FP16 rows (65,536 and 2^20) on a thread
  pool of one thread per CPU, against the PCIe-bound rate (bytes in + out over the mean of the
  two bandwidths), from and into page-locked host arrays (as the daemon's request and response
  bodies and shared-memory regions are: ``Backend.page_locked_allocator``) and from and into
  ordinary NumPy arrays (staged); the kernel on device arrays at ``--large-rows`` rows (cuda);
* HTTP binary FP16, ``--large-rows`` rows (default 65,536, the rows the bars are set for), 1 and 8
  clients (tensor GB/s and M samples/s);
* system shared memory through ``tritonclient.utils.shared_memory`` (ratio to the page-locked
  in-process rate, the larger of the two) and, on cuda, CUDA shared memory through
  ``tritonclient.utils.cuda_shared_memory`` (ratio to the kernel's device-array rate), 1 and 8
  clients (a process each, timing the same window), FP16 in and out;
* gRPC (Triton's ModelInfer, raw contents, :mod:`mmad.bench.grpc_load`): ``--large-rows`` FP16 rows and
  small requests (1-16 rows FP32), at the two ``--grpc-clients`` counts (default 8 and 64), the
  clients spread over ``--grpc-processes`` generator processes;
* small requests (1-16 rows, binary FP32 and JSON, ``--concurrency`` clients, batching on).

Every measurement runs in a fresh load-generator process (:mod:`mmad.bench.load`), timings with
:func:`mmad.backends.timing.median_seconds`. A phase that fails is recorded under ``errors`` and
the others still run. Results: ``--json PATH`` (default ``<out>/service-<backend>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from mmad.bench.grpc_load import grpc_clients
from mmad.bench.load import (
    FP16_TOLERANCE, MODEL, Bench, BenchError, batching_config, grpc_line, progress, scenario_http,
)
from mmad.backends.timing import median_seconds

BANDWIDTH_BYTES = 256 << 20


def pinned_bandwidth() -> dict[str, float]:
    """GB/s of page-locked host<->device copies of 256 MiB on the current GPU (CuPy)."""
    import cupy as cp

    host = np.frombuffer(cp.cuda.alloc_pinned_memory(BANDWIDTH_BYTES), np.uint8, BANDWIDTH_BYTES)
    host[:] = 1
    dev = cp.empty(BANDWIDTH_BYTES, dtype=cp.uint8)
    stream = cp.cuda.get_current_stream()
    up = median_seconds(lambda: dev.data.copy_from_host_async(host.ctypes.data, BANDWIDTH_BYTES, stream), 7,
                        clock="cupy")
    down = median_seconds(lambda: dev.data.copy_to_host_async(host.ctypes.data, BANDWIDTH_BYTES, stream), 7,
                          clock="cupy")
    return {"h2d_GBps": BANDWIDTH_BYTES / up / 1e9, "d2h_GBps": BANDWIDTH_BYTES / down / 1e9}


def in_process(opts: argparse.Namespace, spec, bandwidth: dict[str, float] | None) -> dict[str, Any]:
    """forward_to_host of FP16 rows as the daemon runs it, and the kernel on device arrays."""
    from mmad.backends import select
    from mmad.backends.cpu import CpuBackend

    backend, row = select(opts.backend)
    model = backend.compile(spec, variant=row.variant)
    alloc = backend.page_locked_allocator()
    n_in, n_out = spec.n_input_dims, spec.n_output_dims
    rng = np.random.default_rng()
    doc: dict[str, Any] = {"backend": f"{row.backend}:{row.variant}", "device": row.device, "forward_to_host": []}

    def host_rows(rows: int, cols: int, page_locked: bool) -> np.ndarray:
        if not page_locked:
            return np.empty((rows, cols), np.float16)
        return alloc(rows * cols * 2).view(np.float16).reshape(rows, cols)

    try:
        with ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="in-process-forward") as pool:
            for rows, page_locked in [(r, p) for r in opts.gpu_rows for p in ([True] if alloc else []) + [False]]:
                x = host_rows(rows, n_in, page_locked)
                x[...] = rng.uniform(-1, 1, (rows, n_in))
                out = host_rows(rows, n_out, page_locked)
                seconds = median_seconds(lambda: model.forward_to_host(x, out, pool, check_finite=True),
                                         opts.in_process_repeats, warmup=2)
                point = {"rows": rows, "host_memory": "page-locked" if page_locked else "pageable",
                         "seconds": seconds, "M_samples_per_s": rows / seconds / 1e6,
                         "GBps_tensor": rows * (n_in + n_out) * 2 / seconds / 1e9}
                if bandwidth:
                    bound = rows * (n_in + n_out) * 2 / ((bandwidth["h2d_GBps"] + bandwidth["d2h_GBps"]) / 2 * 1e9)
                    point.update(pcie_bound_M_samples_per_s=rows / bound / 1e6, of_pcie_bound=bound / seconds)
                if rows == opts.large_rows:  # the numbers are worth something only if the rows are right
                    with CpuBackend("float64").compile(spec) as oracle:
                        oracle.set_params(model.get_params())
                        ref = oracle.forward(x.astype(np.float32))
                    point["rel_err_vs_float64"] = float(np.linalg.norm(out.astype(np.float64) - ref)
                                                        / np.linalg.norm(ref))
                    if not point["rel_err_vs_float64"] <= FP16_TOLERANCE:
                        raise BenchError(f"forward_to_host is {point['rel_err_vs_float64']:.3g} from the oracle")
                doc["forward_to_host"].append(point)
                progress(f"in-process forward_to_host {rows} FP16 rows, {point['host_memory']}: "
                         f"{point['M_samples_per_s']:,.1f} M samples/s"
                         + (f", {point['of_pcie_bound']:.0%} of the PCIe bound" if bandwidth else ""))
        if row.backend == "cuda":
            import cupy as cp

            large = opts.large_rows
            dx = cp.asarray(rng.uniform(-1, 1, (large, n_in)).astype(np.float16))
            seconds = median_seconds(lambda: model.forward(dx, out_dtype=np.float16), 30, clock="cupy")
            doc["kernel_device_arrays"] = {"rows": large, "seconds": seconds, "M_samples_per_s": large / seconds / 1e6}
            progress(f"kernel on device arrays, {large} rows: {large / seconds / 1e6:,.0f} M samples/s")
    finally:
        model.close()
        backend.close()
    return doc


def run(opts: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from mmad.spec import bench_spec

    spec = bench_spec(MODEL)
    n_in, n_out = spec.n_input_dims, spec.n_output_dims
    doc: dict[str, Any] = {
        "benchmark": "service-gpu", "model": MODEL, "backend": opts.backend, "errors": {},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["mmad bench --service", *opts.argv]),
        "workers": daemon_workers(opts.server_args),
    }

    def phase(name: str, fn) -> Any:
        try:
            return fn()
        except Exception as exc:  # one failed phase is reported; the others still run
            doc["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
            progress(f"{name} failed: {doc['errors'][name]}\n{traceback.format_exc(limit=5)}")
            return None

    bandwidth = phase("bandwidth", pinned_bandwidth)
    doc["bandwidth"] = bandwidth
    if bandwidth:
        progress(f"page-locked copies: H2D {bandwidth['h2d_GBps']:.1f} GB/s, D2H {bandwidth['d2h_GBps']:.1f} GB/s")
    ip = doc["in_process"] = phase("in_process", lambda: in_process(opts, spec, bandwidth)) or {}
    ip_rate: dict[int, float] = {}  # the faster of page-locked and pageable: the stricter reference
    for p in ip.get("forward_to_host", []):
        ip_rate[p["rows"]] = max(ip_rate.get(p["rows"], 0.0), p["M_samples_per_s"])
    kernel = ip.get("kernel_device_arrays", {}).get("M_samples_per_s")

    with tempfile.TemporaryDirectory(prefix="mmad-load-gpu-") as tmp:
        bench = Bench(opts, Path(tmp))
        try:
            daemon = phase("daemon", lambda: bench.start_daemon(opts.server_args))
            if daemon is None:
                return doc
            phase("put_model", lambda: bench.put_model(daemon, batching_config(opts, True)))
            doc["devices"] = phase("devices", lambda: httpx.get(f"{daemon.url}/v2/devices", timeout=30).json())
            infer_path = f"/v2/models/{MODEL}/infer"

            doc["http_binary16"] = []
            for clients in (1, 8):
                res = phase(f"http_binary16_{clients}", lambda: bench.generate(scenario_http(
                    daemon.port, infer_path, "binary16", (opts.large_rows, opts.large_rows), clients,
                    opts.large_requests * clients, opts.large_duration_s, 0.0, pool=3, warmup_requests=1), daemon))
                if res:
                    res.update(clients=clients, rows=opts.large_rows, M_samples_per_s=res["samples_per_s"] / 1e6,
                               GBps_tensor=res["samples_per_s"] * (n_in + n_out) * 2 / 1e9)
                    if opts.large_rows in ip_rate:
                        res["of_in_process"] = res["M_samples_per_s"] / ip_rate[opts.large_rows]
                    doc["http_binary16"].append(res)
                    progress(f"HTTP binary FP16 {opts.large_rows} rows, {clients} clients: "
                             f"{res['GBps_tensor']:.2f} GB/s, "
                             f"{res['M_samples_per_s']:.2f} M samples/s, errors {res['errors']}")

            doc["grpc"] = []
            if opts.grpc_clients:  # Triton's gRPC with raw contents, beside HTTP: the large row, then the small
                large_clients, small_clients = opts.grpc_clients
                for key, rows, datatype, clients, requests, duration_s, warmup_s, pool in (
                        ("large", (opts.large_rows,) * 2, "FP16", large_clients, opts.large_requests * large_clients,
                         opts.large_duration_s, 0.0, 3),
                        ("small", (1, 16), "FP32", small_clients, opts.max_requests, opts.duration_s,
                         opts.warmup_s, 256)):
                    res = phase(f"grpc_{key}_{clients}", lambda: grpc_clients(
                        bench, daemon, rows, datatype, clients, opts.grpc_processes, requests, duration_s, warmup_s,
                        pool))
                    if res:
                        res.update(size=key, rows=list(rows), M_samples_per_s=res["samples_per_s"] / 1e6,
                                   GBps_tensor=res["samples_per_s"] * (n_in + n_out) * 2 / 1e9)
                        doc["grpc"].append(res)
                        progress(grpc_line(res))

            kinds = [("system_shm", "tritonclient-shm", ip_rate.get(opts.large_rows))]
            if opts.backend.split(":")[0] == "cuda":
                kinds.append(("cuda_shm", "tritonclient-cudashm", kernel))
            for key, kind, reference in kinds:
                doc[key] = []
                for clients in opts.shm_clients:
                    res = phase(f"{key}_{clients}", lambda: shm_clients(bench, daemon, kind, clients, opts))
                    if res:
                        res.update(rows=opts.large_rows, clients=clients, M_samples_per_s=res["samples_per_s"] / 1e6)
                        if reference:
                            res["ratio_to_reference"] = res["M_samples_per_s"] / reference
                            res["reference"] = "in-process forward_to_host" if key == "system_shm" else \
                                "the kernel on device arrays"
                        doc[key].append(res)
                        progress(f"{key} through tritonclient, {clients} clients: {res['M_samples_per_s']:.2f} M "
                                 f"samples/s ({res.get('ratio_to_reference', float('nan')):.2f}x the reference), "
                                 f"p50 {res['p50_ms']:.2f} ms")

            doc["small"] = []
            for wire in ("binary32", "json"):
                for clients in opts.concurrency:
                    res = phase(f"small_{wire}_{clients}", lambda: bench.generate(scenario_http(
                        daemon.port, infer_path, wire, (1, 16), clients, opts.max_requests, opts.duration_s,
                        opts.warmup_s, pool=256), daemon))
                    if res:
                        res.update(wire=wire, clients=clients)
                        doc["small"].append(res)
                        progress(f"small {wire} {clients} clients: {res['requests_per_s']:,.0f} req/s, "
                                 f"p50 {res['p50_ms']:.2f} ms, p99 {res['p99_ms']:.2f} ms, errors {res['errors']}")
            doc["answered_by_process"] = phase("answered_by_process", lambda: answered_by_process(daemon.url))
        finally:
            bench.close()
    return doc


def answered_by_process(url: str) -> dict[str, int]:
    """Infer requests each serving process answered (0: the primary; with --workers, how the
    kernel spread the connections over the workers)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {s.labels["process"]: int(s.value) for family in text_string_to_metric_families(text)
            if family.name == "mmad_process_infer_requests" for s in family.samples if s.name.endswith("_total")}


def shm_clients(bench: Bench, daemon, kind: str, clients: int, opts: argparse.Namespace) -> dict[str, Any]:
    """``clients`` shared-memory load generators, a process each with its own regions, timing
    the same wall-clock window; their rates added up."""
    start_at = time.time() + 4.0 + clients * 0.5  # every process imported, registered and warm by then
    scenario = {"kind": kind, "port": daemon.port, "rows": [opts.large_rows, opts.large_rows], "clients": 1,
                "max_requests": 1_000_000, "duration_s": opts.large_duration_s, "warmup_s": 0.0,
                "warmup_requests": 3, "start_at": start_at}
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda k: bench.generate({**scenario, "seed": 1 + k}),
                                range(clients)))
    total = {"samples_per_s": sum(r["samples_per_s"] for r in results),
             "requests_per_s": sum(r["requests_per_s"] for r in results),
             "p50_ms": float(np.median([r["p50_ms"] for r in results])),
             "p99_ms": max(r["p99_ms"] for r in results), "completed": sum(r["completed"] for r in results)}
    return total


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The serving targets' rows: the figure, the bar, met or not (None: not measured)."""
    rows = []
    for p in doc.get("in_process", {}).get("forward_to_host", []):
        if "of_pcie_bound" in p:  # the bar is judged on page-locked host memory, the daemon's; pageable shown
            bar = 0.5 if p.get("host_memory") == "page-locked" else None
            rows.append({"what": f"in-process forward_to_host {p['rows']} FP16 rows, {p['host_memory']} host "
                                 "memory, of the PCIe bound",
                         "value": p["of_pcie_bound"], "bar": bar, "met": None if bar is None else p["of_pcie_bound"] >= bar})
    eight = next((r for r in doc.get("http_binary16", []) if r["clients"] == 8), None)
    if eight is not None:
        bar = min(3.0, 0.6 * eight["GBps_tensor"] / eight["of_in_process"]) if eight.get("of_in_process") else 3.0
        rows.append({"what": f"HTTP binary FP16 {eight['rows']:,} rows, 8 clients, GB/s of tensor bytes",
                     "value": eight["GBps_tensor"], "bar": bar, "met": eight["GBps_tensor"] >= bar})
    for key, bar in (("system_shm", 0.8), ("cuda_shm", 0.5)):
        for res in doc.get(key) or []:
            if "ratio_to_reference" in res:
                rows.append({"what": f"{key} through tritonclient, {res['clients']} client(s), ratio to "
                                     f"{res['reference']}",
                             "value": res["ratio_to_reference"], "bar": bar, "met": res["ratio_to_reference"] >= bar})
    large = next((r for r in doc.get("grpc", []) if r["size"] == "large"), None)
    http_large = next((r for r in doc.get("http_binary16", []) if r["clients"] == (large or {}).get("clients")), None)
    if large is not None and http_large is not None:  # the bar is the same run's HTTP figure
        rows.append({"what": f"gRPC raw FP16 {large['rows'][0]:,} rows, {large['clients']} clients, GB/s of tensor "
                             "bytes (bar: HTTP binary, same run)",
                     "value": large["GBps_tensor"], "bar": http_large["GBps_tensor"],
                     "met": large["GBps_tensor"] >= http_large["GBps_tensor"]})
    grpc_small = next((r for r in doc.get("grpc", []) if r["size"] == "small"), None)
    if grpc_small is not None:
        rows.append({"what": f"gRPC small requests (1-16 rows FP32), {grpc_small['clients']} clients: req/s "
                             "(p99 <= 20 ms)",
                     "value": grpc_small["requests_per_s"], "bar": 15000,
                     "met": grpc_small["requests_per_s"] >= 15000 and grpc_small["p99_ms"] <= 20})
        rows.append({"what": f"gRPC small requests, {grpc_small['clients']} clients: p99 ms",
                     "value": grpc_small["p99_ms"], "bar": None, "met": None})
    small = next((r for r in doc.get("small", []) if r["wire"] == "binary32" and r["clients"] == 64), None)
    if small is not None:
        rows.append({"what": "small binary requests, 64 clients: req/s (p99 <= 20 ms)",
                     "value": small["requests_per_s"], "bar": 5000,
                     "met": small["requests_per_s"] >= 5000 and small["p99_ms"] <= 20})
    return rows


def daemon_workers(server_args: list[str]) -> int:
    """The daemon's ``--workers`` among ``--server-arg``s (0 when not given)."""
    workers = 0
    for i, arg in enumerate(server_args):
        if arg.startswith("--workers="):
            workers = int(arg.split("=", 1)[1])
        elif arg == "--workers" and i + 1 < len(server_args):
            workers = int(server_args[i + 1])
    return workers


def table(doc: dict[str, Any]) -> str:
    workers = doc.get("workers", 0)
    label = doc["backend"] + (f", {workers} inference workers" if workers else "")
    lines = [f"| {label} | value | bar | met |", "|---|---|---|---|"]
    for t in doc["targets"]:
        met = "(shown)" if t["met"] is None else "yes" if t["met"] else "NO"
        bar = "" if t["bar"] is None else f"{t['bar']:,.2f}"
        lines.append(f"| {t['what']} | {t['value']:,.2f} | {bar} | {met} |")
    for name, error in doc["errors"].items():
        lines.append(f"| {name} failed: {error[:160]} | | | NO |")
    return "\n".join(lines)


def main(opts: argparse.Namespace) -> int:
    opts.gpu_rows = [int(r) for r in opts.gpu_rows.split(",") if r.strip()]
    opts.shm_clients = [int(c) for c in opts.shm_clients.split(",") if c.strip()]
    started = time.time()
    doc = run(opts)  # returns early when the daemon cannot start: the table then says so
    doc["elapsed_s"] = round(time.time() - started, 1)
    doc["targets"] = targets(doc)
    path = Path(opts.json_path or Path(opts.out) / f"service-{opts.backend.replace(':', '-')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(doc))
    print(f"wrote {path}")
    return 1 if doc["errors"] else 0

