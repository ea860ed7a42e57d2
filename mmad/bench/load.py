"""Service load benchmark (docs/benchmarks.md, "Service throughput and latency").

One command reproduces the figures of docs/service-performance.md:

    .venv/bin/python -m mmad.bench.load            # or: mmad bench --service

It starts, as separate processes on 127.0.0.1 (free ports), the mmad daemon (cpu backend,
model M of ``bench_spec("M")``) and the peer (:mod:`mmad.bench.peer_app`: plain FastAPI + NumPy
per request, serving the weights exported from the daemon), checks every server's output
against the float64 cpu oracle, and then runs each measurement in a fresh load-generator
process (``--generator``), bounded in requests and in time:

* in-process: the cpu backend's forward on 65,536 rows in this process, float32 in and out with
  the BLAS library's threads, with one BLAS thread, and as the daemon runs it (one BLAS thread,
  row chunks spread over one thread per CPU), and the daemon's way on FP16 in and out; each
  wire is compared with the run on its own tensors and with the fastest float32 run;
* large batches: one client streams 65,536-row requests, binary FP16 and FP32 in/out and JSON FP32
  -> samples/s, MB/s (request + response bytes), latency;
* concurrency sweep: 1, 8, 64, 256 clients, each with its own keep-alive connection, sending
  requests of 1-16 rows (uniformly drawn) back to back, to mmad with dynamic batching on and off
  and to the peer -> requests/s, p50/p90/p99 latency, errors, and executions per request
  (the daemon's ``/v2/models/M/stats``: execution_count / successful requests);
* interleaved pairs: the targets' comparisons repeated back to back (in-process vs a large
  binary stream; mmad vs the peer at 64 clients), so both sides meet the same outside load;
* tritonclient: ``tritonclient.http.InferenceServerClient(concurrency=N).async_infer`` with N
  requests in flight, and ``tritonclient.http.aio`` with N tasks, against the daemon;
* gRPC (:mod:`mmad.bench.grpc_load`): Triton's ModelInfer with raw contents on the daemon's gRPC
  port, 65,536-row FP16 requests and small requests, at the two ``--grpc-clients`` counts;
* uvicorn settings: a daemon per loop/http pair (uvloop|asyncio x httptools|h11) at 64 clients.

Request bodies are encoded before the clock starts (a load generator's job is to drive the
server); responses are decoded to NumPy and their shape checked inside the clock. Every point
also records how much CPU other processes on the machine used meanwhile ("foreign cores"),
since the 2-core machine is shared, and the server process's CPU time per request.

Results: ``<out>/service-cpu.json``, a markdown table written between the markers of
``--docs`` (docs/service-performance.md) and a PNG plot next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from mmad.errors import MMADError

HOST = "127.0.0.1"
MODEL = "M"
FP16_TOLERANCE = 3e-3
FP32_TOLERANCE = 1e-5
MARK_BEGIN = "<!-- service-bench:begin (written by python -m mmad.bench.load) -->"
MARK_END = "<!-- service-bench:end -->"


class BenchError(MMADError):
    """The benchmark could not run or a server answered wrongly."""


# == wire formats ===========================================================================
def mmad_binary_body(x: np.ndarray, wire_dtype: str) -> tuple[bytes, dict[str, str]]:
    """Binary tensor extension request: JSON header + raw little-endian tensor."""
    data = np.ascontiguousarray(x, dtype="<f2" if wire_dtype == "FP16" else "<f4")
    header = orjson.dumps({
        "inputs": [{"name": "INPUT", "datatype": wire_dtype, "shape": list(data.shape),
                    "parameters": {"binary_data_size": data.nbytes}}],
        "outputs": [{"name": "OUTPUT", "parameters": {"binary_data": True, "output_datatype": wire_dtype}}],
    })
    return header + data.tobytes(), {"Inference-Header-Content-Length": str(len(header)),
                                     "Content-Type": "application/octet-stream"}


def mmad_json_body(x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    doc = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": list(x.shape),
                       "data": np.ascontiguousarray(x, dtype=np.float32).reshape(-1)}]}
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY), {"Content-Type": "application/json"}


def peer_body(x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    return (orjson.dumps({"inputs": np.asarray(x, dtype=np.float32)}, option=orjson.OPT_SERIALIZE_NUMPY),
            {"Content-Type": "application/json"})


def encode(wire: str, x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    if wire == "binary16":
        return mmad_binary_body(x, "FP16")
    if wire == "binary32":
        return mmad_binary_body(x, "FP32")
    if wire == "json":
        return mmad_json_body(x)
    if wire == "peer":
        return peer_body(x)
    raise BenchError(f"unknown wire format {wire!r}")


_EXPONENTS: dict[int, np.ndarray] = {}  # all_finite's scratch by size: a fresh one faulted in 8 MiB a response


def all_finite(values: np.ndarray) -> bool:
    """No NaN or Inf; FP16 checked on its exponent bits (NumPy's float16 isfinite is ~10x slower)."""
    if values.dtype == np.float16:
        bits = values.view(np.uint16).reshape(-1)
        exponents = _EXPONENTS.get(bits.size)
        if exponents is None:
            exponents = _EXPONENTS[bits.size] = np.empty(bits.size, np.uint16)
        np.bitwise_and(bits, np.uint16(0x7C00), out=exponents)
        return exponents.max(initial=0) != 0x7C00
    return bool(np.isfinite(values).all())


def decode(wire: str, headers: dict[bytes, bytes], body: bytes) -> np.ndarray:
    """The OUTPUT tensor of a response (flat)."""
    if wire in ("binary16", "binary32"):
        length = int(headers[b"inference-header-content-length"])
        dtype = "<f2" if wire == "binary16" else "<f4"
        return np.frombuffer(body, dtype=dtype, offset=length)
    doc = orjson.loads(body)
    if wire == "peer":
        return np.asarray(doc["outputs"], dtype=np.float32).reshape(-1)
    return np.asarray(doc["outputs"][0]["data"], dtype=np.float32)


# == a minimal keep-alive HTTP/1.1 client (cheap, so the generator steals little CPU) ========
class _ResponseReader(asyncio.BufferedProtocol):
    """One connection's responses; a body is read by the socket straight into its own buffer.

    The generator shares the machine's cores with the server, so its copies cost the server:
    asyncio's StreamReader held a 65,536-row response in a growing bytearray, paused the socket
    every 2 MiB and copied the body twice more on the way out. Bodies go into one buffer per
    connection (grown when needed), already faulted in after the first response: a body is
    valid until the connection's next response.
    """

    def __init__(self) -> None:
        self.scratch = memoryview(bytearray(1 << 16))
        self.pending = bytearray()  # received bytes of the status line and headers
        self.space = np.empty(0, dtype=np.uint8)  # where bodies go
        self.body: memoryview | None = None
        self.filled = 0
        self.status, self.headers = 0, {}
        self.waiter: asyncio.Future | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionResetError(f"the server closed the connection mid-response ({exc})"))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.body[self.filled:] if self.body is not None else self.scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self.body is not None:
            self.filled += nbytes
        else:
            self.pending += self.scratch[:nbytes]
            end = self.pending.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.pending[:end]).split(b"\r\n")
            self.status = int(lines[0].split(b" ", 2)[1])
            self.headers = {}
            for line in lines[1:]:
                key, _, value = line.partition(b":")
                self.headers[key.strip().lower()] = value.strip()
            if b"content-length" not in self.headers:
                self._fail(BenchError(f"response without Content-Length (the generator reads no other): {lines!r}"))
                return
            size = int(self.headers[b"content-length"])
            if self.space.size < size:
                self.space = np.empty(size, dtype=np.uint8)
            self.body = memoryview(self.space[:size])
            rest = self.pending[end + 4:]
            if len(rest) > len(self.body):
                self._fail(BenchError("the server sent more than one response"))
                return
            self.body[:len(rest)] = rest
            self.filled = len(rest)
            self.pending = bytearray()
        if self.filled == len(self.body):
            body, self.body = self.body, None
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result((self.status, self.headers, body))

    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()


class HttpConnection:
    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: _ResponseReader | None = None

    async def _connect(self) -> None:
        _, self.reader = await asyncio.get_running_loop().create_connection(_ResponseReader, self.host, self.port)

    def close(self) -> None:
        if self.reader is not None and self.reader.transport is not None:
            self.reader.transport.close()
        self.reader = None

    async def post(self, head: bytes, body: bytes) -> tuple[int, dict[bytes, bytes], memoryview]:
        """(status, headers, body); the body is valid until this connection's next post."""
        if self.reader is None or self.reader.transport is None:
            await self._connect()
        reader = self.reader
        reader.waiter = asyncio.get_running_loop().create_future()
        reader.transport.write(head)
        reader.transport.write(body)
        status, headers, data = await reader.waiter
        if headers.get(b"connection", b"").lower() == b"close":
            self.close()
        return status, headers, data


def request_head(path: str, headers: dict[str, str], body_len: int) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {HOST}", f"Content-Length: {body_len}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


# == load generator (runs in its own process: python -m mmad.bench.load --generator JSON) ====
def _rows_for(scenario: dict[str, Any], rng: np.random.Generator, count: int) -> list[int]:
    lo, hi = scenario["rows"]
    return [int(r) for r in rng.integers(lo, hi + 1, size=count)]


def build_pool(scenario: dict[str, Any]) -> list[tuple[bytes, bytes, int, int]]:
    """(head, body, rows, request bytes) for ``pool`` distinct requests of fresh random data."""
    rng = np.random.default_rng(scenario["seed"])
    pool = []
    for rows in _rows_for(scenario, rng, scenario["pool"]):
        x = rng.uniform(-1.0, 1.0, size=(rows, scenario["n_input_dims"])).astype(np.float32)
        body, headers = encode(scenario["wire"], x)
        head = request_head(scenario["path"], headers, len(body))
        pool.append((head, body, rows, len(head) + len(body)))
    return pool


def summarize(latencies_s: list[float], window_s: float, rows: int, nbytes: int) -> dict[str, Any]:
    done = len(latencies_s)
    lat_ms = np.asarray(latencies_s) * 1e3 if done else np.asarray([math.nan])
    window_s = max(window_s, 1e-9)
    return {
        "requests": done, "window_s": round(window_s, 3),
        "requests_per_s": done / window_s, "samples_per_s": rows / window_s, "mb_per_s": nbytes / window_s / 1e6,
        "p50_ms": float(np.percentile(lat_ms, 50)), "p90_ms": float(np.percentile(lat_ms, 90)),
        "p99_ms": float(np.percentile(lat_ms, 99)), "mean_ms": float(lat_ms.mean()),
    }


async def run_http_load(scenario: dict[str, Any]) -> dict[str, Any]:
    """``clients`` connections sending requests back to back, bounded in count and time."""
    pool = build_pool(scenario)
    n_out = scenario["n_output_dims"]
    clients, max_requests = scenario["clients"], scenario["max_requests"]
    start = time.perf_counter()
    t0 = start + scenario["warmup_s"]
    deadline = t0 + scenario["duration_s"]
    latencies: list[float] = []
    measured = {"rows": 0, "bytes": 0, "first_begin": math.inf, "last_end": t0}
    errors: dict[str, int] = {}
    first_error: list[str] = []
    totals = {"completed": 0}  # warm-up included: the server's CPU per request divides by this
    stop = asyncio.Event()

    def fail(kind: str, detail: str) -> None:
        errors[kind] = errors.get(kind, 0) + 1
        if not first_error:
            first_error.append(detail[:300])

    async def client(index: int) -> None:
        conn = HttpConnection(scenario["host"], scenario["port"])
        k = index * 7919  # each client walks the pool from its own place
        sent = 0
        try:
            while not stop.is_set():
                head, body, rows, req_bytes = pool[k % len(pool)]
                k += 1
                began = time.perf_counter()
                try:
                    status, headers, data = await conn.post(head, body)
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    conn.close()
                    fail("connection", f"{type(exc).__name__}: {exc}")
                    if time.perf_counter() >= deadline:
                        stop.set()
                    await asyncio.sleep(0.01)
                    continue
                ended = time.perf_counter()
                sent += 1
                totals["completed"] += 1
                if status != 200:
                    fail(f"http {status}", bytes(data).decode(errors="replace"))
                else:
                    out = decode(scenario["wire"], headers, data)
                    if out.size != rows * n_out or not all_finite(out):
                        fail("wrong output", f"{out.size} values for {rows} rows, finite={all_finite(out)}")
                    elif began >= t0 and sent > scenario["warmup_requests"]:
                        latencies.append(ended - began)
                        measured["rows"] += rows
                        measured["bytes"] += req_bytes + len(data)
                        measured["first_begin"] = min(measured["first_begin"], began)
                        measured["last_end"] = max(measured["last_end"], ended)
                if ended >= deadline or len(latencies) >= max_requests:
                    stop.set()
        finally:
            conn.close()

    await asyncio.gather(*(client(i) for i in range(clients)))
    # the window opens when the first measured request is sent (after any warm-up requests)
    window_s = measured["last_end"] - min(measured["first_begin"], measured["last_end"])
    result = summarize(latencies, window_s, measured["rows"], measured["bytes"])
    result.update(errors=errors, first_error=first_error[0] if first_error else None,
                  elapsed_s=round(time.perf_counter() - start, 3), completed=totals["completed"])
    return result


def run_tritonclient_load(scenario: dict[str, Any]) -> dict[str, Any]:
    """tritonclient.http with ``concurrency=N``: N async_infer requests kept in flight."""
    import collections

    import tritonclient.http as httpclient

    rng = np.random.default_rng(scenario["seed"])
    n_in, n_out = scenario["n_input_dims"], scenario["n_output_dims"]
    arrays = [rng.uniform(-1, 1, size=(r, n_in)).astype(np.float32) for r in _rows_for(scenario, rng, scenario["pool"])]
    in_flight = scenario["clients"]
    client = httpclient.InferenceServerClient(f"{scenario['host']}:{scenario['port']}", concurrency=in_flight,
                                              connection_timeout=30.0, network_timeout=30.0)
    outputs = [httpclient.InferRequestedOutput("OUTPUT", binary_data=True)]

    def submit(k: int):
        x = arrays[k % len(arrays)]
        inp = httpclient.InferInput("INPUT", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        return time.perf_counter(), x.shape[0], client.async_infer(MODEL, [inp], outputs=outputs)

    start = time.perf_counter()
    t0, latencies, rows_done, errors, first_error = start + scenario["warmup_s"], [], 0, {}, None
    deadline = t0 + scenario["duration_s"]
    pending = collections.deque(submit(k) for k in range(in_flight))
    k, last_end = in_flight, t0
    try:
        while pending:
            began, rows, handle = pending.popleft()
            try:
                out = handle.get_result().as_numpy("OUTPUT")
                ended = time.perf_counter()
                if out is None or out.shape != (rows, n_out) or not np.isfinite(out).all():
                    raise BenchError(f"OUTPUT {None if out is None else out.shape} for {rows} rows")
                if began >= t0:
                    latencies.append(ended - began)
                    rows_done += rows
                    last_end = ended
            except Exception as exc:  # tritonclient raises its own InferenceServerException
                ended = time.perf_counter()
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                first_error = first_error or f"{type(exc).__name__}: {exc}"[:300]
            if ended < deadline and len(latencies) < scenario["max_requests"]:
                pending.append(submit(k))
                k += 1
    finally:
        client.close()
    result = summarize(latencies, last_end - t0, rows_done, 0)
    result.pop("mb_per_s")
    result.update(errors=errors, first_error=first_error, elapsed_s=round(time.perf_counter() - start, 3))
    return result


async def run_tritonclient_aio_load(scenario: dict[str, Any]) -> dict[str, Any]:
    """tritonclient.http.aio: N asyncio tasks, each awaiting ``infer`` back to back."""
    import tritonclient.http.aio as aioclient

    rng = np.random.default_rng(scenario["seed"])
    n_in, n_out = scenario["n_input_dims"], scenario["n_output_dims"]
    arrays = [rng.uniform(-1, 1, size=(r, n_in)).astype(np.float32) for r in _rows_for(scenario, rng, scenario["pool"])]
    client = aioclient.InferenceServerClient(f"{scenario['host']}:{scenario['port']}", conn_limit=scenario["clients"])
    outputs = [aioclient.InferRequestedOutput("OUTPUT", binary_data=True)]
    start = time.perf_counter()
    t0 = start + scenario["warmup_s"]
    deadline = t0 + scenario["duration_s"]
    latencies: list[float] = []
    state = {"rows": 0, "last_end": t0, "first_error": None}
    errors: dict[str, int] = {}

    async def worker(index: int) -> None:
        k = index * 7919
        while time.perf_counter() < deadline and len(latencies) < scenario["max_requests"]:
            x = arrays[k % len(arrays)]
            k += 1
            inp = aioclient.InferInput("INPUT", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            began = time.perf_counter()
            try:
                out = (await client.infer(MODEL, [inp], outputs=outputs)).as_numpy("OUTPUT")
                if out is None or out.shape != x.shape[:1] + (n_out,) or not np.isfinite(out).all():
                    raise BenchError(f"OUTPUT {None if out is None else out.shape} for {x.shape[0]} rows")
            except Exception as exc:  # tritonclient raises its own InferenceServerException
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                state["first_error"] = state["first_error"] or f"{type(exc).__name__}: {exc}"[:300]
                continue
            ended = time.perf_counter()
            if began >= t0:
                latencies.append(ended - began)
                state["rows"] += x.shape[0]
                state["last_end"] = max(state["last_end"], ended)

    try:
        await asyncio.gather(*(worker(i) for i in range(scenario["clients"])))
    finally:
        await client.close()
    result = summarize(latencies, state["last_end"] - t0, state["rows"], 0)
    result.pop("mb_per_s")
    result.update(errors=errors, first_error=state["first_error"], elapsed_s=round(time.perf_counter() - start, 3))
    return result


def run_tritonclient_shm_load(scenario: dict[str, Any]) -> dict[str, Any]:
    """One tritonclient.http client, requests back to back, FP16 input and output both in shared
    memory: POSIX regions (``tritonclient.utils.shared_memory``, kind ``tritonclient-shm``) or
    device regions (``tritonclient.utils.cuda_shared_memory`` on GPU 0, ``tritonclient-cudashm``).
    The input is written once; each response's output is checked (shape, finite) on the first
    and last request only, so the clock holds the server's work. ``start_at`` (wall-clock
    seconds, optional): the timed window starts then, so that several generator processes
    started one after another time the same window."""
    import uuid

    import tritonclient.http as httpclient

    cuda = scenario["kind"] == "tritonclient-cudashm"
    if cuda:
        import tritonclient.utils.cuda_shared_memory as shmlib
    else:
        import tritonclient.utils.shared_memory as shmlib
    rows, n_in, n_out = scenario["rows"][0], scenario["n_input_dims"], scenario["n_output_dims"]
    x = np.random.default_rng(scenario["seed"]).uniform(-1, 1, (rows, n_in)).astype(np.float16)
    in_bytes, out_bytes = x.nbytes, rows * n_out * 2
    tag = uuid.uuid4().hex[:10]
    in_name, out_name = f"in-{tag}", f"out-{tag}"
    client = httpclient.InferenceServerClient(f"{scenario['host']}:{scenario['port']}", network_timeout=120.0)
    if cuda:
        regions = [shmlib.create_shared_memory_region(in_name, in_bytes, 0),
                   shmlib.create_shared_memory_region(out_name, out_bytes, 0)]
        for name, region, size in ((in_name, regions[0], in_bytes), (out_name, regions[1], out_bytes)):
            raw = shmlib.get_raw_handle(region)  # base64 bytes; the JSON body needs text
            client.register_cuda_shared_memory(name, raw.decode() if isinstance(raw, bytes) else raw, 0, size)
    else:
        regions = [shmlib.create_shared_memory_region(in_name, "/" + in_name, in_bytes),
                   shmlib.create_shared_memory_region(out_name, "/" + out_name, out_bytes)]
        client.register_system_shared_memory(in_name, "/" + in_name, in_bytes)
        client.register_system_shared_memory(out_name, "/" + out_name, out_bytes)
    shmlib.set_shared_memory_region(regions[0], [x])
    inp = httpclient.InferInput("INPUT", [rows, n_in], "FP16")
    inp.set_shared_memory(in_name, in_bytes)
    out = httpclient.InferRequestedOutput("OUTPUT")
    out.set_shared_memory(out_name, out_bytes)
    out._parameters["output_datatype"] = "FP16"  # mmad's extension: FP16 outputs

    def check() -> None:
        y = shmlib.get_contents_as_numpy(regions[1], np.float16, [rows, n_out])
        if y.shape != (rows, n_out) or not all_finite(y):
            raise BenchError(f"OUTPUT region holds {y.shape}, finite={all_finite(y)}")

    latencies: list[float] = []
    try:
        for _ in range(max(1, scenario["warmup_requests"])):
            client.infer(MODEL, [inp], outputs=[out])
        check()
        time.sleep(max(0.0, scenario.get("start_at", 0.0) - time.time()))
        start = time.perf_counter()
        deadline = start + scenario["duration_s"]
        while time.perf_counter() < deadline and len(latencies) < scenario["max_requests"]:
            began = time.perf_counter()
            client.infer(MODEL, [inp], outputs=[out])
            latencies.append(time.perf_counter() - began)
        window = time.perf_counter() - start
        check()
    finally:
        if cuda:
            client.unregister_cuda_shared_memory()
        else:
            client.unregister_system_shared_memory()
        client.close()
        for region in regions:
            shmlib.destroy_shared_memory_region(region)
    result = summarize(latencies, window, rows * len(latencies), (in_bytes + out_bytes) * len(latencies))
    result.update(errors={}, first_error=None, completed=len(latencies))
    return result


def generator_main(scenario_json: str) -> int:
    scenario = json.loads(scenario_json)
    if scenario["kind"] in ("tritonclient-shm", "tritonclient-cudashm"):
        result = run_tritonclient_shm_load(scenario)
    elif scenario["kind"] == "tritonclient":
        result = run_tritonclient_load(scenario)
    elif scenario["kind"] == "grpc":
        from mmad.bench.grpc_load import run_grpc_load

        result = asyncio.run(run_grpc_load(scenario))  # grpc.aio runs on asyncio's own loop
    else:
        try:
            import uvloop
            runner = uvloop.run
        except ImportError:
            runner = asyncio.run
        load = run_tritonclient_aio_load if scenario["kind"] == "tritonclient-aio" else run_http_load
        result = runner(load(scenario))
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


# == orchestration ==========================================================================
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def cpu_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot (/proc/stat), or NaN off Linux."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return math.nan
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class Service:
    """A server process of ours on loopback, its log, and its end."""

    def __init__(self, name: str, argv: list[str], port: int, ready_path: str, log_dir: Path):
        self.name, self.port, self.ready_path = name, port, ready_path
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log_tail(self, chars: int = 2000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name} exited with status {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise BenchError(f"{self.name} was not ready after {timeout_s} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


class Bench:
    """One run: services up, checks, measurements, results."""

    def __init__(self, opts: argparse.Namespace, workdir: Path):
        self.opts = opts
        self.workdir = workdir
        self.services: list[Service] = []
        from mmad.spec import bench_spec

        self.spec = bench_spec(MODEL)
        self.daemon: Service | None = None
        self.peer: Service | None = None

    # -- services ---------------------------------------------------------------------------
    def start_daemon(self, extra: list[str]) -> Service:
        port, grpc_port = free_port(), free_port()
        argv = [sys.executable, "-m", "mmad.server.main", "--host", HOST, "--port", str(port),
                "--grpc-port", str(grpc_port), "--store", str(self.workdir / f"store-{port}"),
                "--backend", self.opts.backend, "--probe", self.opts.backend.split(":")[0], "--no-demo",
                "--log-level", "warning", *extra]
        service = Service(f"daemon-{port}", argv, port, "/v2/health/ready", self.workdir)
        service.grpc_port = grpc_port
        self.services.append(service)
        service.wait_ready(self.opts.start_timeout_s)
        return service

    def start_peer(self, weights: Path, spec_path: Path) -> Service:
        port = free_port()
        argv = [sys.executable, "-m", "mmad.bench.peer_app", "--host", HOST, "--port", str(port),
                "--weights", str(weights), "--spec", str(spec_path)]
        service = Service("peer", argv, port, "/health", self.workdir)
        self.services.append(service)
        service.wait_ready(self.opts.start_timeout_s)
        return service

    def stop_service(self, service: Service) -> None:
        service.stop()
        self.services.remove(service)

    def close(self) -> None:
        for service in list(self.services):
            self.stop_service(service)

    def put_model(self, daemon: Service, config: dict[str, Any]) -> None:
        import httpx

        r = httpx.put(f"{daemon.url}/v2/models/{MODEL}", json={"spec": self.spec.to_json(), "config": config},
                      timeout=60.0)
        if r.status_code not in (200, 201):
            raise BenchError(f"PUT /v2/models/{MODEL} answered {r.status_code}: {r.text}")

    def stats(self, daemon: Service) -> dict[str, int]:
        import httpx

        doc = httpx.get(f"{daemon.url}/v2/models/{MODEL}/stats", timeout=10.0).json()["model_stats"][0]
        return {"executions": doc["execution_count"], "requests": doc["inference_stats"]["success"]["count"],
                "rows": doc["inference_count"]}

    # -- measurements ---------------------------------------------------------------------
    def generator_command(self, scenario: dict[str, Any]) -> list[str]:
        """A generator process's command: this module's, or for gRPC rows the native generator
        where ``--grpc-generator`` names one."""
        if scenario["kind"] == "grpc" and getattr(self.opts, "grpc_generator", None):
            from mmad.bench.grpc_load import native_command

            return native_command(self.opts.grpc_generator, scenario)
        return [sys.executable, "-m", "mmad.bench.load", "--generator", json.dumps(scenario)]

    def generate(self, scenario: dict[str, Any], target: Service | None = None) -> dict[str, Any]:
        """Run one scenario in a fresh generator process.

        Notes the foreign CPU load meanwhile and, for ``target``, the server process's CPU time
        per completed request (warm-up included): a figure that other processes' load disturbs
        far less than requests/s.
        """
        target_before = process_cpu_seconds(target.proc.pid) if target is not None else 0.0
        scenario = {"seed": 1, "pool": 64, "warmup_requests": 0, "host": HOST,
                    "n_input_dims": self.spec.n_input_dims, "n_output_dims": self.spec.n_output_dims, **scenario}
        ours = [s.proc.pid for s in self.services]
        before_busy, before_ours, before_children = cpu_busy_seconds(), sum(map(process_cpu_seconds, ours)), os.times()
        started = time.monotonic()
        limit = scenario["warmup_s"] + scenario["duration_s"] + self.opts.generator_slack_s
        try:
            done = subprocess.run(self.generator_command(scenario), capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired as exc:
            raise BenchError(f"the load generator ran past {limit:.0f} s on {scenario}") from exc
        wall = time.monotonic() - started
        if done.returncode != 0:
            raise BenchError(f"the load generator failed ({done.returncode}):\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        after_children = os.times()
        ours_s = (sum(map(process_cpu_seconds, ours)) - before_ours
                  + (after_children.children_user - before_children.children_user)
                  + (after_children.children_system - before_children.children_system)
                  + (after_children.user - before_children.user) + (after_children.system - before_children.system))
        busy = cpu_busy_seconds() - before_busy
        result["foreign_cores"] = round(max(0.0, busy - ours_s) / wall, 2)
        if target is not None and result.get("completed"):
            result["server_cpu_ms_per_request"] = (process_cpu_seconds(target.proc.pid) - target_before) \
                / result["completed"] * 1e3
        result["load_avg_1m"] = round(os.getloadavg()[0], 2)
        return result

    def in_process(self, repeats: int | None = None) -> dict[str, Any]:
        """The cpu backend's own forward on 65,536 rows, in this process: what HTTP is compared with.

        Float32 in and out three ways: ``forward`` with the BLAS library's default thread count;
        with one BLAS thread; and as the daemon runs it, ``forward_to_host`` with one BLAS thread
        and the row chunks spread over one thread per CPU. And the daemon's way on FP16 in and
        out (the casts fused per chunk), the same tensors as the binary FP16 requests carry.
        Each wire is compared with the in-process run on its own tensors (:func:`same_tensors`:
        FP16 with the FP16 way, FP32 and JSON with the fastest float32 way), and every wire with
        the fastest float32 way as well, the stricter reading for FP16 (it pays no casts).
        """
        from concurrent.futures import ThreadPoolExecutor

        from threadpoolctl import threadpool_info, threadpool_limits

        from mmad.backends import select

        backend, row = select("cpu")
        model = backend.compile(self.spec, variant=row.variant)
        x = np.random.default_rng(7).uniform(-1, 1, size=(self.opts.large_rows, self.spec.n_input_dims)
                                             ).astype(np.float32)
        out = np.empty((x.shape[0], self.spec.n_output_dims), dtype=np.float32)
        x16, out16 = x.astype(np.float16), np.empty(out.shape, dtype=np.float16)
        default_threads = max((i.get("num_threads", 1) for i in threadpool_info() if i.get("user_api") == "blas"),
                              default=1)
        cpus = os.cpu_count() or 1
        pool = ThreadPoolExecutor(cpus, thread_name_prefix="in-process-forward")
        fp16_way = f"{FP16_WAY}, 1 BLAS thread, chunks on {cpus} threads"
        ways = {f"forward, {default_threads} BLAS threads": (default_threads, lambda: model.forward(x)),
                "forward, 1 BLAS thread": (1, lambda: model.forward(x)),
                f"forward_to_host, 1 BLAS thread, chunks on {cpus} threads":
                    (1, lambda: model.forward_to_host(x, out, pool)),
                fp16_way: (1, lambda: model.forward_to_host(x16, out16, pool))}
        variants, cpu_ms = {}, {}
        try:
            for label, (threads, forward) in ways.items():
                with threadpool_limits(limits=threads, user_api="blas"):
                    for _ in range(2):
                        forward()
                    times, cpu = [], []
                    for _ in range(repeats or self.opts.in_process_repeats):
                        began, began_cpu = time.perf_counter(), time.process_time()
                        forward()
                        times.append(time.perf_counter() - began)
                        cpu.append(time.process_time() - began_cpu)
                variants[label] = self.opts.large_rows / statistics.median(times)
                cpu_ms[label] = statistics.median(cpu) * 1e3
        finally:
            pool.shutdown()
            model.close()
            backend.close()
        fastest = max((k for k in variants if k != fp16_way), key=variants.get)
        return {"backend": f"{row.backend}:{row.variant}", "rows": self.opts.large_rows,
                "samples_per_s_by_way": variants, "cpu_ms_by_way": cpu_ms, "fastest_float32": fastest,
                "reference_by_wire": {"binary16": fp16_way, "binary32": fastest, "json": fastest},
                "repeats": repeats or self.opts.in_process_repeats, "load_avg_1m": round(os.getloadavg()[0], 2)}

    def check_outputs(self, daemon: Service, peer: Service | None, weights: dict[str, np.ndarray]) -> dict[str, float]:
        """Relative error of each server path against the float64 oracle, on fresh random data."""
        import httpx

        from mmad.backends.cpu import CpuBackend

        oracle = CpuBackend("float64").compile(self.spec)
        oracle.set_params(weights)
        x = np.random.default_rng(int(time.time())).uniform(-1, 1, size=(257, self.spec.n_input_dims)).astype(np.float32)
        checks = {}
        paths = [("mmad binary16", daemon, "binary16", f"/v2/models/{MODEL}/infer", FP16_TOLERANCE),
                 ("mmad binary32", daemon, "binary32", f"/v2/models/{MODEL}/infer", FP32_TOLERANCE),
                 ("mmad json", daemon, "json", f"/v2/models/{MODEL}/infer", FP32_TOLERANCE)]
        if peer is not None:
            paths.append(("peer json", peer, "peer", "/infer", FP32_TOLERANCE))
        for name, service, wire, path, tolerance in paths:
            x_sent = x.astype(np.float16).astype(np.float32) if wire == "binary16" else x
            body, headers = encode(wire, x)
            r = httpx.post(service.url + path, content=body, headers=headers, timeout=30.0)
            if r.status_code != 200:
                raise BenchError(f"{name}: HTTP {r.status_code}: {r.text[:500]}")
            out = decode(wire, {k.encode(): v.encode() for k, v in r.headers.items()}, r.content)
            ref = oracle.forward(x_sent.astype(np.float64)).reshape(-1)
            err = float(np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref))
            if not err <= tolerance:  # NaN fails too
                raise BenchError(f"{name}: relative error {err:.3g} against the float64 oracle exceeds {tolerance}")
            checks[name] = err
        return checks


LARGE_LABELS = {"binary16": "binary FP16", "binary32": "binary FP32", "json": "JSON FP32"}
FP16_WAY = "forward_to_host FP16 in/out"


def same_tensors(ip: dict[str, Any], wire: str) -> float:
    """In-process samples/s on the tensors that ``wire``'s requests carry."""
    return ip["samples_per_s_by_way"][ip["reference_by_wire"][wire]]


def fastest_float32(ip: dict[str, Any]) -> float:
    """In-process samples/s of the fastest float32-in/out way."""
    return ip["samples_per_s_by_way"][ip["fastest_float32"]]


CLIENT_LABELS = {
    "tritonclient": "tritonclient.http InferenceServerClient(concurrency=N).async_infer",
    "tritonclient-aio": "tritonclient.http.aio InferenceServerClient, N tasks awaiting infer",
}


def scenario_http(port: int, path: str, wire: str, rows: tuple[int, int], clients: int,
                  max_requests: int, duration_s: float, warmup_s: float, **extra: Any) -> dict[str, Any]:
    return {"kind": "http", "port": port, "path": path, "wire": wire, "rows": list(rows), "clients": clients,
            "max_requests": max_requests, "duration_s": duration_s, "warmup_s": warmup_s, **extra}


def run(opts: argparse.Namespace) -> dict[str, Any]:
    import httpx
    from safetensors.numpy import load as load_safetensors

    started = time.time()
    doc: dict[str, Any] = {
        "benchmark": "service", "model": MODEL, "backend": "cpu",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_avg_at_start": [round(v, 2) for v in os.getloadavg()]},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "command": " ".join(["python -m mmad.bench.load", *opts.argv]),
        "settings": {"large_rows": opts.large_rows, "small_rows": [1, 16], "concurrency": opts.concurrency,
                     "duration_s": opts.duration_s, "warmup_s": opts.warmup_s, "max_requests": opts.max_requests,
                     "batching_on": batching_config(opts, True), "batching_off": batching_config(opts, False),
                     "server_args": opts.server_args, "uvicorn_matrix": ["/".join(p) for p in opts.uvicorn_matrix]},
    }
    with tempfile.TemporaryDirectory(prefix="mmad-load-") as tmp:
        bench = Bench(opts, Path(tmp))
        try:
            daemon = bench.start_daemon(opts.server_args)
            bench.put_model(daemon, batching_config(opts, True))
            weights_bytes = httpx.get(f"{daemon.url}/v2/models/{MODEL}/weights", timeout=30.0).content
            weights_path, spec_path = Path(tmp) / "M.safetensors", Path(tmp) / "M.json"
            weights_path.write_bytes(weights_bytes)
            spec_path.write_text(json.dumps(bench.spec.to_json()))
            peer = bench.start_peer(weights_path, spec_path) if opts.peer else None
            doc["oracle_relative_error"] = bench.check_outputs(daemon, peer, load_safetensors(weights_bytes))
            progress("outputs match the float64 oracle: " + ", ".join(
                f"{k} {v:.1e}" for k, v in doc["oracle_relative_error"].items()))

            doc["in_process"] = bench.in_process()
            progress("in-process cpu forward, samples/s: " + ", ".join(
                f"{k}: {v:,.0f}" for k, v in doc["in_process"]["samples_per_s_by_way"].items()))

            doc["large"] = []
            infer_path = f"/v2/models/{MODEL}/infer"
            for wire in ("binary16", "binary32", "json"):
                res = bench.generate(scenario_http(
                    daemon.port, infer_path, wire, (opts.large_rows, opts.large_rows), 1, opts.large_requests,
                    opts.large_duration_s, 0.0, pool=3, warmup_requests=1), daemon)
                res.update(wire=wire, rows=opts.large_rows)
                doc["large"].append(res)
                progress(f"large {wire}: {res['samples_per_s']:,.0f} samples/s, {res['mb_per_s']:.0f} MB/s "
                         f"({res['requests']} requests, foreign cores {res['foreign_cores']})")

            doc["sweep"] = []
            series = [("mmad", "on", w) for w in opts.sweep_wires] + [("mmad", "off", w) for w in opts.sweep_wires]
            for server, batching, wire in series:
                bench.put_model(daemon, batching_config(opts, batching == "on"))
                for clients in opts.concurrency:
                    before = bench.stats(daemon)
                    res = bench.generate(scenario_http(daemon.port, infer_path, wire, (1, 16), clients,
                                                       opts.max_requests, opts.duration_s, opts.warmup_s, pool=256),
                                         daemon)
                    after = bench.stats(daemon)
                    served = after["requests"] - before["requests"]
                    res.update(server=server, batching=batching, wire=wire, clients=clients,
                               executions_per_request=(after["executions"] - before["executions"]) / max(served, 1))
                    doc["sweep"].append(res)
                    progress(sweep_line(res))
            if peer is not None:
                for clients in opts.concurrency:
                    res = bench.generate(scenario_http(peer.port, "/infer", "peer", (1, 16), clients,
                                                       opts.max_requests, opts.duration_s, opts.warmup_s, pool=256),
                                         peer)
                    res.update(server="peer", batching="none", wire="json", clients=clients,
                               executions_per_request=1.0)
                    doc["sweep"].append(res)
                    progress(sweep_line(res))

            # the targets' comparisons, interleaved so that both sides of each ratio meet the same
            # load from other processes (the machine is shared); medians over the pairs
            doc["pairs"] = {"large": [], "small": []}
            bench.put_model(daemon, batching_config(opts, True))
            for rep in range(opts.pairs):
                ip = bench.in_process(repeats=3)
                res = bench.generate(scenario_http(
                    daemon.port, infer_path, "binary16", (opts.large_rows, opts.large_rows), 1, 4,
                    opts.large_duration_s, 0.0, pool=3, warmup_requests=1), daemon)
                doc["pairs"]["large"].append({
                    "in_process_fp16": same_tensors(ip, "binary16"), "in_process_float32": fastest_float32(ip),
                    "binary16": res["samples_per_s"], "ratio": res["samples_per_s"] / same_tensors(ip, "binary16"),
                    "ratio_float32": res["samples_per_s"] / fastest_float32(ip), "foreign_cores": res["foreign_cores"]})
                progress(f"pair {rep + 1}/{opts.pairs} large: in-process FP16 {same_tensors(ip, 'binary16'):,.0f}, "
                         f"float32 {fastest_float32(ip):,.0f}, binary FP16 {res['samples_per_s']:,.0f} samples/s")
                if peer is None:
                    continue
                pair = {}
                for server, wire in [("mmad", w) for w in opts.sweep_wires] + [("peer", "json")]:
                    target = daemon if server == "mmad" else peer
                    res = bench.generate(scenario_http(target.port, infer_path if server == "mmad" else "/infer",
                                                       wire if server == "mmad" else "peer", (1, 16), 64,
                                                       opts.max_requests, opts.pair_duration_s, opts.warmup_s,
                                                       pool=256), target)
                    pair[f"{server} {wire}"] = {k: res[k] for k in ("requests_per_s", "p99_ms", "foreign_cores")}
                doc["pairs"]["small"].append(pair)
                progress(f"pair {rep + 1}/{opts.pairs} 64 clients: " + ", ".join(
                    f"{k} {v['requests_per_s']:,.0f} req/s p99 {v['p99_ms']:.0f} ms" for k, v in pair.items()))

            doc["tritonclient"] = []
            if opts.tritonclient:
                bench.put_model(daemon, batching_config(opts, True))
                for kind in ("tritonclient", "tritonclient-aio"):
                    for clients in opts.tritonclient_concurrency:
                        before = bench.stats(daemon)
                        res = bench.generate({"kind": kind, "port": daemon.port, "rows": [1, 16],
                                              "clients": clients, "max_requests": opts.max_requests,
                                              "duration_s": opts.duration_s, "warmup_s": opts.warmup_s, "pool": 256})
                        after = bench.stats(daemon)
                        res.update(client=CLIENT_LABELS[kind], clients=clients,
                                   executions_per_request=(after["executions"] - before["executions"])
                                   / max(after["requests"] - before["requests"], 1))
                        doc["tritonclient"].append(res)
                        progress(f"{res['client']} N={clients}: {res['requests_per_s']:,.0f} req/s, "
                                 f"p99 {res['p99_ms']:.1f} ms, exec/req {res['executions_per_request']:.2f}, "
                                 f"errors {res['errors']}")
            doc["grpc"] = []
            if opts.grpc_clients:
                from mmad.bench.grpc_load import grpc_clients

                bench.put_model(daemon, batching_config(opts, True))
                large_clients, small_clients = opts.grpc_clients
                for rows, datatype, clients, requests, duration_s, warmup_s, pool in (
                        ((opts.large_rows,) * 2, "FP16", large_clients, opts.large_requests * large_clients,
                         opts.large_duration_s, 0.0, 3),
                        ((1, 16), "FP32", small_clients, opts.max_requests, opts.duration_s, opts.warmup_s, 256)):
                    res = grpc_clients(bench, daemon, rows, datatype, clients, opts.grpc_processes, requests,
                                       duration_s, warmup_s, pool)
                    res.update(rows=list(rows))
                    doc["grpc"].append(res)
                    progress(grpc_line(res))
            doc["uvicorn"] = []
            for loop, http in opts.uvicorn_matrix:
                variant = bench.start_daemon([*opts.server_args, f"--loop={loop}", f"--http={http}"])
                try:
                    bench.put_model(variant, batching_config(opts, True))
                    for wire in opts.sweep_wires:
                        res = bench.generate(scenario_http(variant.port, infer_path, wire, (1, 16), 64,
                                                           opts.max_requests, opts.duration_s, opts.warmup_s,
                                                           pool=256), variant)
                        res.update(loop=loop, http=http, wire=wire, clients=64)
                        doc["uvicorn"].append(res)
                        progress(f"uvicorn loop={loop} http={http} {wire} clients=64: "
                                 f"{res['requests_per_s']:,.0f} req/s, p99 {res['p99_ms']:.1f} ms, server CPU "
                                 f"{res.get('server_cpu_ms_per_request', math.nan):.3f} ms/req")
                finally:
                    bench.stop_service(variant)
        finally:
            bench.close()
    doc["machine"]["load_avg_at_end"] = [round(v, 2) for v in os.getloadavg()]
    doc["elapsed_s"] = round(time.time() - started, 1)
    doc["targets"] = targets(doc)
    return doc


def batching_config(opts: argparse.Namespace, on: bool) -> dict[str, int]:
    if on:
        return {"max_batch_rows": opts.max_batch_rows, "max_queue_delay_us": opts.max_queue_delay_us,
                "max_queue_requests": 1024}
    return {"max_batch_rows": 1, "max_queue_delay_us": 0, "max_queue_requests": 1024}  # every request alone


def progress(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def grpc_line(res: dict[str, Any]) -> str:
    rows = "-".join(map(str, sorted(set(res["rows"]))))
    return (f"gRPC raw {res['datatype']} {rows} rows, {res['clients']} clients ({res['processes']} processes): "
            f"{res['requests_per_s']:,.0f} req/s, {res['samples_per_s']:,.0f} samples/s, p50 {res['p50_ms']:.2f} "
            f"p99 {res['p99_ms']:.2f} ms, errors {res['errors']}")


def sweep_line(res: dict[str, Any]) -> str:
    return (f"{res['server']} batching={res['batching']} {res['wire']} clients={res['clients']}: "
            f"{res['requests_per_s']:,.0f} req/s p50 {res['p50_ms']:.1f} p99 {res['p99_ms']:.1f} ms, "
            f"exec/req {res['executions_per_request']:.2f}, server CPU {res.get('server_cpu_ms_per_request', math.nan):.2f} "
            f"ms/req, errors {res['errors']}, foreign cores {res['foreign_cores']}")


def _find(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


STRICTER = ">= 0.70 (a stricter reading: the in-process side pays no FP16 casts)"


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's 'done when' figures, each with its value and whether it is met.

    From the interleaved pairs (medians) when the run has them; the single sweep points are
    measured minutes apart, under whatever load other processes put on the machine then.
    """
    out = []
    pairs = doc.get("pairs") or {}
    if pairs.get("large"):
        n = len(pairs["large"])
        ratio = statistics.median(p["ratio"] for p in pairs["large"])
        out.append({"figure": f"PAIRED (median of {n}): large binary FP16 samples/s / in-process on the same FP16 "
                              "tensors", "value": ratio, "target": ">= 0.70", "met": ratio >= 0.70})
        ratio = statistics.median(p["ratio_float32"] for p in pairs["large"])
        out.append({"figure": f"PAIRED (median of {n}): large binary FP16 samples/s / fastest in-process, float32 "
                              "in and out (no casts)", "value": ratio, "target": STRICTER, "met": ratio >= 0.70})
    if pairs.get("small"):
        for key in [k for k in pairs["small"][0] if k.startswith("mmad")]:
            ratio = statistics.median(p[key]["requests_per_s"] / p["peer json"]["requests_per_s"]
                                      for p in pairs["small"])
            p99 = statistics.median(p[key]["p99_ms"] for p in pairs["small"])
            n = len(pairs["small"])
            out.append({"figure": f"PAIRED (median of {n}): 64 clients, {key} batching on req/s / peer req/s",
                        "value": ratio, "target": ">= 3", "met": ratio >= 3})
            out.append({"figure": f"PAIRED (median of {n}): 64 clients, {key} batching on p99 ms",
                        "value": p99, "target": "<= 100", "met": p99 <= 100})
    binary, js = _find(doc["large"], wire="binary16"), _find(doc["large"], wire="json")
    ip = doc["in_process"]
    if binary:
        ratio = binary["samples_per_s"] / same_tensors(ip, "binary16")
        out.append({"figure": "large binary FP16 samples/s / in-process cpu samples/s on the same FP16 tensors",
                    "value": ratio, "target": ">= 0.70", "met": ratio >= 0.70})
        ratio = binary["samples_per_s"] / fastest_float32(ip)
        out.append({"figure": "large binary FP16 samples/s / fastest in-process cpu samples/s, float32 in and out",
                    "value": ratio, "target": STRICTER, "met": ratio >= 0.70})
    if binary and js:
        ratio = binary["samples_per_s"] / max(js["samples_per_s"], 1e-9)
        out.append({"figure": "large binary FP16 samples/s / JSON FP32 samples/s", "value": ratio,
                    "target": ">= 5", "met": ratio >= 5})
    if binary and binary.get("server_cpu_ms_per_request"):
        ratio = ip["cpu_ms_by_way"][ip["reference_by_wire"]["binary16"]] / binary["server_cpu_ms_per_request"]
        out.append({"figure": "CPU-time estimate: in-process CPU per forward / daemon CPU per large binary request",
                    "value": ratio, "target": ">= 0.70 (same bar, other processes' load left out)",
                    "met": ratio >= 0.70})
    peer64 = _find(doc["sweep"], server="peer", clients=64)
    for wire in sorted({r["wire"] for r in doc["sweep"] if r["server"] == "mmad"}):
        on64 = _find(doc["sweep"], server="mmad", batching="on", wire=wire, clients=64)
        if on64 and peer64:
            ratio = on64["requests_per_s"] / max(peer64["requests_per_s"], 1e-9)
            out.append({"figure": f"64 clients, 1-16 rows: mmad batching on ({wire}) req/s / peer req/s",
                        "value": ratio, "target": ">= 3", "met": ratio >= 3})
        if on64 and peer64 and on64.get("server_cpu_ms_per_request") and peer64.get("server_cpu_ms_per_request"):
            ratio = peer64["server_cpu_ms_per_request"] / on64["server_cpu_ms_per_request"]
            out.append({"figure": f"CPU-time estimate: peer CPU per request / mmad batching on ({wire}) CPU per "
                                  "request, 64 clients", "value": ratio,
                        "target": ">= 3 (same bar, other processes' load left out)", "met": ratio >= 3})
        if on64:
            out.append({"figure": f"64 clients, 1-16 rows: mmad batching on ({wire}) p99 ms",
                        "value": on64["p99_ms"], "target": "<= 100", "met": on64["p99_ms"] <= 100})
    return out


# == report =================================================================================
def markdown(doc: dict[str, Any], png_name: str | None, before: dict[str, Any] | None = None) -> str:
    m = doc["machine"]
    lines = [f"Measured {doc['started']} on {m['cpus']} CPUs ({m['platform']}, Python {m['python']}); "
             f"load average {m['load_avg_at_start'][0]} at start, {m['load_avg_at_end'][0]} at end; "
             f"{doc['elapsed_s']} s. Command: `{doc['command']}`. "
             "'foreign cores': CPU used by other processes on the machine during that point.", ""]
    ip = doc["in_process"]
    lines += ["**Targets**", "", "| figure | value | target | met |", "|---|---|---|---|"]
    for t in doc["targets"]:
        lines.append(f"| {t['figure']} | {t['value']:.2f} | {t['target']} | {'yes' if t['met'] else '**no**'} |")
    by_way = "; ".join(f"{k}: {v:,.0f} samples/s, {ip['cpu_ms_by_way'][k]:.0f} ms CPU"
                       for k, v in ip["samples_per_s_by_way"].items())
    pairs = doc.get("pairs") or {}
    if pairs.get("large") or pairs.get("small"):
        lines += ["", "**Interleaved pairs** (behind the PAIRED targets: both sides of a ratio measured back to back, "
                  "so that they meet the same load from other processes)", "",
                  "| pair | in-process FP16 in/out samples/s | large binary FP16 samples/s | ratio | in-process float32 "
                  "samples/s | ratio | 64 clients, req/s (p99 ms) |",
                  "|---|---|---|---|---|---|---|"]
        for i in range(max(len(pairs.get("large", [])), len(pairs.get("small", [])))):
            large = pairs["large"][i] if i < len(pairs.get("large", [])) else None
            small = pairs["small"][i] if i < len(pairs.get("small", [])) else {}
            cells = "; ".join(f"{k}: {v['requests_per_s']:,.0f} ({v['p99_ms']:.0f})" for k, v in small.items())
            if large:
                lines.append(f"| {i + 1} | {large['in_process_fp16']:,.0f} | {large['binary16']:,.0f} | "
                             f"{large['ratio']:.2f} | {large['in_process_float32']:,.0f} | {large['ratio_float32']:.2f} "
                             f"| {cells} |")
            else:
                lines.append(f"| {i + 1} | | | | | | {cells} |")
    lines += ["", f"**Large batches** ({ip['rows']:,} rows per request, one client; in-process {ip['backend']}: "
              f"{by_way}; 'same tensors': the in-process run on the tensors the wire carries (FP16 in/out for "
              "binary FP16, else the fastest float32 way)", "",
              "| wire | requests | samples/s | MB/s | p50 ms | vs in-process, same tensors | vs fastest in-process "
              "(float32) | server CPU ms/req | foreign cores |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["large"]:
        label = LARGE_LABELS[r["wire"]] + " in/out"
        lines.append(f"| {label} | {r['requests']} | {r['samples_per_s']:,.0f} | {r['mb_per_s']:.1f} | "
                     f"{r['p50_ms']:.0f} | {r['samples_per_s'] / same_tensors(ip, r['wire']):.0%} | "
                     f"{r['samples_per_s'] / fastest_float32(ip):.0%} | "
                     f"{r.get('server_cpu_ms_per_request', math.nan):.0f} | {r['foreign_cores']} |")
    lines += ["", "**Concurrency sweep** (1-16 rows per request, each client one keep-alive connection)", "",
              "| server | batching | wire | clients | req/s | p50 ms | p90 ms | p99 ms | exec/req | server CPU ms/req "
              "| errors | foreign cores |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["sweep"]:
        errors = sum(r["errors"].values())
        lines.append(f"| {r['server']} | {r['batching']} | {r['wire']} | {r['clients']} | {r['requests_per_s']:,.0f} | "
                     f"{r['p50_ms']:.1f} | {r['p90_ms']:.1f} | {r['p99_ms']:.1f} | "
                     f"{r['executions_per_request']:.2f} | {r.get('server_cpu_ms_per_request', math.nan):.2f} | "
                     f"{errors} | {r['foreign_cores']} |")
    if doc["tritonclient"]:
        lines += ["", "**Triton's Python client** against the daemon (binary FP32, 1-16 rows, N requests in "
                  "flight, batching on)", "",
                  "| client | N | req/s | p50 ms | p99 ms | exec/req | errors |", "|---|---|---|---|---|---|---|"]
        for r in doc["tritonclient"]:
            lines.append(f"| {r['client']} | {r['clients']} | {r['requests_per_s']:,.0f} | {r['p50_ms']:.1f} | "
                         f"{r['p99_ms']:.1f} | {r['executions_per_request']:.2f} | {sum(r['errors'].values())} |")
    if doc.get("grpc"):
        lines += ["", "**gRPC** (Triton's ModelInfer with raw contents, a channel per client, batching on)", "",
                  "| datatype | rows | clients | req/s | samples/s | p50 ms | p99 ms | errors |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in doc["grpc"]:
            lines.append(f"| {r['datatype']} | {'-'.join(map(str, sorted(set(r['rows']))))} | {r['clients']} | "
                         f"{r['requests_per_s']:,.0f} | {r['samples_per_s']:,.0f} | {r['p50_ms']:.1f} | "
                         f"{r['p99_ms']:.1f} | {sum(r['errors'].values())} |")
    if doc.get("uvicorn"):
        lines += ["", "**uvicorn settings** (mmad, 64 clients, 1-16 rows, batching on; one daemon per setting)", "",
                  "| loop | http | wire | req/s | p50 ms | p99 ms | server CPU ms/req | foreign cores |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in doc["uvicorn"]:
            lines.append(f"| {r['loop']} | {r['http']} | {r['wire']} | {r['requests_per_s']:,.0f} | {r['p50_ms']:.1f} | "
                         f"{r['p99_ms']:.1f} | {r.get('server_cpu_ms_per_request', math.nan):.3f} | "
                         f"{r['foreign_cores']} |")
    if before is not None:
        lines += before_after(doc, before)
    if png_name:
        lines += ["", f"![service benchmark]({png_name})"]
    return "\n".join(lines) + "\n"


def before_after(doc: dict[str, Any], before: dict[str, Any]) -> list[str]:
    """The same points from an earlier result file (the daemon before the fast path)."""
    lines = ["", f"**Before and after** (before: the daemon as first written, measured {before['started']} "
             f"with this tool, load average {before['machine']['load_avg_at_start'][0]} at its start)", "",
             "| point | before | after |", "|---|---|---|"]
    for wire in ("binary16", "json"):
        b, a = _find(before["large"], wire=wire), _find(doc["large"], wire=wire)
        if a and b:  # CPU only: the first tool version counted the warm-up request's time in samples/s
            lines.append(f"| {doc['in_process']['rows']:,}-row {wire}: server CPU ms per request | "
                         f"{b.get('server_cpu_ms_per_request', math.nan):.0f} | "
                         f"{a.get('server_cpu_ms_per_request', math.nan):.0f} |")
    for r in doc["sweep"]:
        if r["server"] != "mmad" or r["batching"] != "on":
            continue
        b = _find(before["sweep"], server="mmad", batching="on", wire=r["wire"], clients=r["clients"])
        if b:
            def cell(x):
                return (f"{x['requests_per_s']:,.0f} req/s, p99 {x['p99_ms']:.0f} ms, "
                        f"{x.get('server_cpu_ms_per_request', math.nan):.2f} ms CPU/req")
            lines.append(f"| batching on, {r['wire']}, {r['clients']} clients | {cell(b)} | {cell(r)} |")
    return lines


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.8))
    ax_rps, ax_p99, ax_cpu, ax_large = axes
    keys = sorted({(r["server"], r["batching"], r["wire"]) for r in doc["sweep"]})
    for server, batching, wire in keys:
        rows = sorted((r for r in doc["sweep"] if (r["server"], r["batching"], r["wire"]) == (server, batching, wire)),
                      key=lambda r: r["clients"])
        label = "peer (FastAPI + NumPy, JSON)" if server == "peer" else f"mmad {wire}, batching {batching}"
        clients = [r["clients"] for r in rows]
        style = {"marker": "o", "label": label, "linestyle": "--" if batching == "off" else "-"}
        ax_rps.plot(clients, [r["requests_per_s"] for r in rows], **style)
        ax_p99.plot(clients, [r["p99_ms"] for r in rows], **style)
        ax_cpu.plot(clients, [r.get("server_cpu_ms_per_request", math.nan) for r in rows], **style)
    for ax, title, unit in ((ax_rps, "requests/s (1-16 rows each)", "requests/s"), (ax_p99, "p99 latency", "ms"),
                            (ax_cpu, "server CPU per request", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    ax_p99.set_yscale("log")
    ax_p99.axhline(100, color="grey", linestyle=":", linewidth=1)
    ax_cpu.set_ylim(bottom=0)
    ip = doc["in_process"]
    names = ["in-process\nfloat32", "in-process\nFP16"] + [LARGE_LABELS[r["wire"]].replace(" ", "\n")
                                                          for r in doc["large"]]
    values = [fastest_float32(ip), same_tensors(ip, "binary16")] + [r["samples_per_s"] for r in doc["large"]]
    ax_large.bar(names, values, color=["grey", "silver", "tab:blue", "tab:green", "tab:orange"][:len(values)])
    ax_large.set_title(f"{doc['in_process']['rows']:,}-row requests, model M (cpu)")
    ax_large.set_ylabel("samples/s")
    handles, labels = ax_rps.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    m = doc["machine"]
    fig.suptitle(f"mmad service benchmark, {doc['started']}, {m['cpus']} CPUs, load average "
                 f"{m['load_avg_at_start'][0]} at start (shared machine)", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_docs(doc: dict[str, Any], docs: Path, before: dict[str, Any] | None = None) -> Path:
    """Replace the results block of ``docs`` (or append one) and write the plot beside it."""
    png = docs.with_suffix(".png")
    plot(doc, png)
    block = f"{MARK_BEGIN}\n{markdown(doc, png.name, before)}{MARK_END}"
    text = docs.read_text(encoding="utf-8") if docs.exists() else "# Service performance\n\n"
    if MARK_BEGIN in text and MARK_END in text:
        head, rest = text.split(MARK_BEGIN, 1)
        text = head + block + rest.split(MARK_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    docs.write_text(text, encoding="utf-8")
    return png


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mmad.bench.load", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results", help="folder for service-cpu.json")
    p.add_argument("--docs", default="docs/service-performance.md",
                   help="markdown file whose results block is rewritten (PNG written beside it); '' for none")
    p.add_argument("--concurrency", default="1,8,64,256", help="clients of the sweep, comma-separated")
    p.add_argument("--sweep-wires", default="json,binary32",
                   help="mmad wire formats in the sweep: json (as the peer) and/or binary32")
    p.add_argument("--duration-s", type=float, default=4.0, help="measured seconds per sweep point")
    p.add_argument("--warmup-s", type=float, default=1.0, help="unmeasured seconds before each sweep point")
    p.add_argument("--max-requests", type=int, default=40000, help="measured requests per sweep point at most")
    p.add_argument("--large-rows", type=int, default=65536)
    p.add_argument("--large-requests", type=int, default=12, help="measured large requests per wire format at most")
    p.add_argument("--large-duration-s", type=float, default=10.0, help="measured seconds per wire format at most")
    p.add_argument("--in-process-repeats", type=int, default=7)
    p.add_argument("--max-batch-rows", type=int, default=65536, help="batching on: rows per launch")
    p.add_argument("--max-queue-delay-us", type=int, default=500, help="batching on: longest wait")
    p.add_argument("--tritonclient-concurrency", default="8,64", help="'' to skip the tritonclient check")
    p.add_argument("--grpc-clients", default="8,64",
                   help="gRPC raw contents: clients of the large-request row and of the small-request row ('' to skip)")
    p.add_argument("--grpc-generator", metavar="PATH",
                   help="gRPC rows: run this native load generator (bench/grpc_loadgen, built by "
                        "scripts/gpu/grpc_loadgen.sh) in each generator process instead of Python's grpc.aio")
    p.add_argument("--grpc-processes", type=int, default=4,
                   help="generator processes the gRPC clients are spread over (timing the same window)")
    p.add_argument("--uvicorn-matrix", default="uvloop/httptools,asyncio/httptools,uvloop/h11,asyncio/h11",
                   help="loop/http pairs measured at 64 clients with a daemon each; '' to skip")
    p.add_argument("--before", default="bench/results/service-cpu-before.json",
                   help="an earlier result file to compare with in the report (skipped when missing; '' for none)")
    p.add_argument("--pairs", type=int, default=3,
                   help="interleaved repetitions behind the target figures (in-process vs large binary; "
                        "mmad vs peer at 64 clients); 0 for none")
    p.add_argument("--pair-duration-s", type=float, default=3.0, help="measured seconds per paired point")
    p.add_argument("--no-peer", dest="peer", action="store_false")
    p.add_argument("--server-arg", dest="server_args", action="append", default=[],
                   help="extra argument for the daemon (repeatable), e.g. --server-arg=--http=h11")
    p.add_argument("--start-timeout-s", type=float, default=90.0)
    p.add_argument("--generator-slack-s", type=float, default=60.0,
                   help="a generator process is killed this long after its point should have ended")
    p.add_argument("--backend", default="cpu",
                   help="the daemon's backend (cuda:mma, vulkan:coopmat, ...): anything but cpu runs the GPU "
                        "serving report instead (transport ceilings, shared memory; see docs/benchmarks.md)")
    p.add_argument("--json", dest="json_path", help="GPU report: write the results here (default "
                                                    "<out>/service-<backend>.json)")
    p.add_argument("--gpu-rows", default="65536,1048576", help="GPU report: rows of the in-process forward_to_host")
    p.add_argument("--shm-clients", default="8,16,32",
                   help="GPU report: shared-memory client processes, a comma list (each count one measurement; "
                        "a 65,536-row CUDA-region request is mostly HTTP and Python in the client and the "
                        "daemon, so the GPU's rate needs many clients)")
    p.add_argument("--generator", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = build_parser().parse_args(argv)
    if opts.generator:
        return generator_main(opts.generator)
    opts.argv = argv
    opts.concurrency = [int(c) for c in opts.concurrency.split(",") if c.strip()]
    opts.sweep_wires = [w.strip() for w in opts.sweep_wires.split(",") if w.strip()]
    bad = sorted(set(opts.sweep_wires) - {"json", "binary32", "binary16"})
    if bad:
        raise SystemExit(f"--sweep-wires: unknown {bad[0]!r}; use json, binary32, binary16")
    opts.tritonclient_concurrency = [int(c) for c in opts.tritonclient_concurrency.split(",") if c.strip()]
    opts.tritonclient = bool(opts.tritonclient_concurrency)
    opts.grpc_clients = [int(c) for c in opts.grpc_clients.split(",") if c.strip()]
    if len(opts.grpc_clients) not in (0, 2):
        raise SystemExit("--grpc-clients: two counts (large requests, small requests), or '' to skip")
    try:
        opts.uvicorn_matrix = [tuple(pair.split("/")) for pair in opts.uvicorn_matrix.split(",") if pair.strip()]
        for loop, http in opts.uvicorn_matrix:
            if loop not in ("asyncio", "uvloop", "auto") or http not in ("h11", "httptools", "auto"):
                raise ValueError(f"{loop}/{http}")
    except ValueError as exc:
        raise SystemExit(f"--uvicorn-matrix: expected loop/http pairs like uvloop/httptools; got {exc}") from exc
    if opts.backend != "cpu":
        from mmad.bench.service_gpu import main as gpu_main

        return gpu_main(opts)
    try:
        doc = run(opts)
    except MMADError as exc:
        print(f"mmad bench --service: error: {exc}", file=sys.stderr)
        return 2
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "service-cpu.json"
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    written = [json_path]
    before = None
    if opts.before and Path(opts.before).is_file() and Path(opts.before).resolve() != json_path.resolve():
        before = json.loads(Path(opts.before).read_text())
    if opts.docs:
        docs = Path(opts.docs)
        docs.parent.mkdir(parents=True, exist_ok=True)
        written += [docs, write_docs(doc, docs, before)]
    print(markdown(doc, None))
    print("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
