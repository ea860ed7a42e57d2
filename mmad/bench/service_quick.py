"""Quick loopback measurement: binary infer through the daemon vs the same backend in-process.

Starts ``python -m mmad.server.main`` (``--backend``, default cpu; empty temp store) on a free
loopback port, creates bench model M (docs/benchmarks.md), and in the same run times

* ``server``: one client sending 65,536-row binary infer requests (``--datatype`` FP32 or
  FP16 both ways) back to back, and
* ``in-process``: ``backend.compile(spec).forward`` on the same host array (host in, host out),

after checking that both give the same outputs and that they match the float64 cpu oracle.
Prints samples/s (median of the timed repetitions) and writes a JSON record with ``--out``.

    python -m mmad.bench.service_quick [--backend cpu] [--datatype FP32] [--rows 65536] [--reps 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import orjson

from mmad.backends import select
from mmad.backends.cpu import CpuBackend
from mmad.backends.timing import median_seconds
from mmad.spec import bench_spec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(store: Path, backend: str, flags: list[str] | tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "MMAD_BACKEND": backend, "MMAD_PROBE": backend.split(":")[0], "MMAD_LOG_LEVEL": "warning"}
    proc = subprocess.Popen([sys.executable, "-m", "mmad.server.main", "--port", str(port), "--store", str(store),
                             "--no-demo", "--grpc-port", "0", *flags], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the daemon did not become ready")


WIRE = {"FP32": "<f4", "FP16": "<f2"}


def binary_request(x: np.ndarray, datatype: str) -> tuple[bytes, dict[str, str]]:
    blob = x.astype(WIRE[datatype]).tobytes()
    header = orjson.dumps({"inputs": [{"name": "INPUT", "datatype": datatype, "shape": list(x.shape),
                                       "parameters": {"binary_data_size": len(blob)}}],
                           "outputs": [{"name": "OUTPUT", "parameters": {"binary_data": True,
                                                                         "output_datatype": datatype}}]})
    return header + blob, {"Inference-Header-Content-Length": str(len(header)),
                           "Content-Type": "application/octet-stream"}


def decode(r: httpx.Response, shape: tuple[int, int], datatype: str) -> np.ndarray:
    r.raise_for_status()
    n = int(r.headers["Inference-Header-Content-Length"])
    return np.frombuffer(r.content, WIRE[datatype], offset=n).reshape(shape).astype(np.float32)


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    assert np.isfinite(out).all(), "NaN or Inf in the output"
    return float(np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--backend", default="cpu", help="cuda|vulkan|wgpu|cpu[:variant], for both sides")
    p.add_argument("--datatype", choices=tuple(WIRE), default="FP32")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    spec = bench_spec("M")
    x = np.random.default_rng(0).uniform(-1, 1, (args.rows, spec.n_input_dims)).astype(np.float32)
    x = x.astype(WIRE[args.datatype]).astype(np.float32)  # what the wire carries, for every side
    body, headers = binary_request(x, args.datatype)
    backend, row = select(args.backend)
    local = backend.compile(spec, variant=row.variant)  # same seed -> same initial weights as served
    with CpuBackend("float64").compile(spec) as oracle:
        reference64 = oracle.forward(x)
    # fp32 numerics on the cpu backend; fp16 kernels elsewhere; FP16 on the wire rounds the output
    tolerance = 1e-5 if (row.backend == "cpu" and args.datatype == "FP32") else 3e-3

    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_daemon(Path(tmp) / "store", args.backend)
        try:
            # identity: the timings are of inference, not of gzip (httpx asks for it by default)
            with httpx.Client(base_url=url, timeout=120, headers={"Accept-Encoding": "identity"}) as client:
                r = client.put("/v2/models/M", json={"spec": spec.to_json()})
                r.raise_for_status()
                shape = (args.rows, spec.n_output_dims)
                served = decode(client.post("/v2/models/M/infer", content=body, headers=headers), shape,
                                args.datatype)
                in_process = local.forward(x).astype(WIRE[args.datatype]).astype(np.float32)
                err = rel_err(served, in_process.astype(np.float64))
                assert err <= 1e-6, f"server and in-process outputs differ ({err})"
                oracle_err = rel_err(served, reference64)
                assert oracle_err <= tolerance, f"served output is {oracle_err} from the float64 oracle"
                # the requests above warmed the server; the in-process forward gets one warm-up call
                server_s = median_seconds(lambda: decode(client.post("/v2/models/M/infer", content=body,
                                                                     headers=headers), shape, args.datatype),
                                          args.reps, warmup=0)
                local_s = median_seconds(lambda: local.forward(x), args.reps, warmup=1)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
            local.close()
            backend.close()
    server_sps = args.rows / server_s
    local_sps = args.rows / local_s
    record = {
        "what": f"binary {args.datatype} infer, model M, loopback, one client, sequential requests",
        "backend": f"{row.backend}:{row.variant}", "device": row.device, "datatype": args.datatype,
        "rows_per_request": args.rows, "reps": args.reps, "request_bytes": len(body),
        "server_samples_per_s": server_sps, "in_process_samples_per_s": local_sps,
        "server_over_in_process": server_sps / local_sps,
        "server_MB_per_s": (len(body) + args.rows * spec.n_output_dims * np.dtype(WIRE[args.datatype]).itemsize)
        / server_s / 1e6,
        "server_vs_in_process_rel_err": err, "server_vs_float64_oracle_rel_err": oracle_err, "machine": f"{platform.machine()} {os.cpu_count()} threads",
        "python": platform.python_version(), "numpy": np.__version__,
    }
    print(f"{record['backend']} on {row.device}, {args.datatype}; served output vs float64 oracle: "
          f"{oracle_err:.2e}, vs in-process: {err:.2e}")
    print(f"server     {server_sps:12,.0f} samples/s  (median of {args.reps} x {args.rows} rows, "
          f"{record['server_MB_per_s']:.0f} MB/s in+out)")
    print(f"in-process {local_sps:12,.0f} samples/s")
    print(f"server / in-process = {record['server_over_in_process']:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
