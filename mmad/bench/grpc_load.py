"""The gRPC rows of ``mmad bench --service``: Triton's ``ModelInfer`` with raw tensor contents
(what ``tritonclient.grpc`` sends) against the daemon's gRPC port, beside the HTTP rows of the
same run.

Each client is a ``grpc.aio`` channel with a connection of its own (as each HTTP client is a
connection of its own) sending requests back to back: gRPC's channels to one address share one
connection by default (its global subchannel pool), which the daemon's serving workers would
answer as one client (``--workers``: each connection is one worker's); the requests are ``tritonclient.grpc``'s own messages,
serialized before the clock starts (a load generator's job is to drive the server), and each
reply's raw output is checked (size, finite) inside the clock. The clients can be spread over
several generator processes timing the same wall-clock window (``start_at``): one Python
process's gRPC stack would otherwise bound the figure before the server does.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from mmad.bench.load import MODEL, BenchError, _rows_for, all_finite, summarize

METHOD = "/inference.GRPCInferenceService/ModelInfer"
MAX_MESSAGE = 1 << 30


def request_pool(scenario: dict[str, Any]) -> list[tuple[bytes, int]]:
    """(serialized ModelInferRequest, rows) for ``pool`` requests of fresh random data."""
    from tritonclient.grpc import service_pb2

    rng = np.random.default_rng(scenario["seed"])
    datatype = scenario["datatype"]
    pool = []
    for rows in _rows_for(scenario, rng, scenario["pool"]):
        x = rng.uniform(-1, 1, (rows, scenario["n_input_dims"])).astype("<f2" if datatype == "FP16" else "<f4")
        request = service_pb2.ModelInferRequest(model_name=MODEL)
        request.inputs.add(name="INPUT", datatype=datatype, shape=x.shape)
        output = request.outputs.add(name="OUTPUT")
        output.parameters["output_datatype"].string_param = datatype  # mmad's: outputs in the inputs' datatype
        request.raw_input_contents.append(x.tobytes())
        pool.append((request.SerializeToString(), rows))
    return pool


async def run_grpc_load(scenario: dict[str, Any]) -> dict[str, Any]:
    """``clients`` channels sending requests back to back, bounded in count and time."""
    import grpc
    from tritonclient.grpc import service_pb2

    pool = request_pool(scenario)
    n_out, itemsize = scenario["n_output_dims"], 2 if scenario["datatype"] == "FP16" else 4
    dtype = np.float16 if itemsize == 2 else np.float32
    target = f"{scenario['host']}:{scenario['grpc_port']}"
    options = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE),
               ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(scenario["clients"])]
    latencies: list[float] = []
    measured = {"rows": 0, "bytes": 0, "first_begin": float("inf"), "last_end": 0.0, "completed": 0}
    errors: dict[str, int] = {}
    first_error: list[str] = []

    def fail(kind: str, detail: str) -> None:
        errors[kind] = errors.get(kind, 0) + 1
        if not first_error:
            first_error.append(detail[:300])

    try:
        for channel in channels:
            await asyncio.wait_for(channel.channel_ready(), 30)
        await asyncio.sleep(max(0.0, scenario.get("start_at", 0.0) - time.time()))
        start = time.perf_counter()
        t0 = start + scenario["warmup_s"]
        deadline = t0 + scenario["duration_s"]
        stop = asyncio.Event()

        async def client(index: int) -> None:
            # bytes in: the requests are serialized already
            call = channels[index].unary_unary(METHOD, response_deserializer=service_pb2.ModelInferResponse.FromString)
            k, sent = index * 7919, 0
            while not stop.is_set():
                body, rows = pool[k % len(pool)]
                k += 1
                began = time.perf_counter()
                try:
                    reply = await call(body, timeout=120)
                except grpc.aio.AioRpcError as exc:
                    fail(str(exc.code()), exc.details() or "")
                    if time.perf_counter() >= deadline:
                        stop.set()
                    continue
                ended = time.perf_counter()
                sent += 1
                measured["completed"] += 1
                raw = reply.raw_output_contents[0] if reply.raw_output_contents else b""
                out = np.frombuffer(raw, dtype)
                if out.size != rows * n_out or not all_finite(out):
                    fail("wrong output", f"{out.size} values for {rows} rows")
                elif began >= t0 and sent > scenario["warmup_requests"]:
                    latencies.append(ended - began)
                    measured["rows"] += rows
                    measured["bytes"] += len(body) + len(raw)
                    measured["first_begin"] = min(measured["first_begin"], began)
                    measured["last_end"] = max(measured["last_end"], ended)
                if ended >= deadline or len(latencies) >= scenario["max_requests"]:
                    stop.set()

        await asyncio.gather(*(client(i) for i in range(scenario["clients"])))
    finally:
        for channel in channels:
            await channel.close()
    window_s = measured["last_end"] - min(measured["first_begin"], measured["last_end"])
    result = summarize(latencies, window_s, measured["rows"], measured["bytes"])
    result.update(errors=errors, first_error=first_error[0] if first_error else None,
                  elapsed_s=round(time.perf_counter() - start, 3), completed=measured["completed"])
    return result


def native_command(binary: str, scenario: dict[str, Any]) -> list[str]:
    """The command of the C++ generator (``bench/grpc_loadgen/loadgen.cc``) for ``scenario``:
    the same requests and checks, at a fraction of a Python client's CPU per call."""
    rows = scenario["rows"]
    args = {"target": f"{scenario['host']}:{scenario['grpc_port']}", "model": MODEL, "clients": scenario["clients"],
            "rows-min": rows[0], "rows-max": rows[1], "datatype": scenario["datatype"],
            "n-in": scenario["n_input_dims"], "n-out": scenario["n_output_dims"], "duration-s": scenario["duration_s"],
            "warmup-s": scenario["warmup_s"], "max-requests": scenario["max_requests"], "pool": scenario["pool"],
            "seed": scenario["seed"], "start-at": scenario.get("start_at", 0.0),
            "warmup-requests": scenario["warmup_requests"]}
    return [binary, *(str(part) for key, value in args.items() for part in (f"--{key}", value))]


def grpc_clients(bench, daemon, rows: tuple[int, int], datatype: str, clients: int, processes: int,
                 max_requests: int, duration_s: float, warmup_s: float, pool: int) -> dict[str, Any]:
    """``clients`` gRPC clients spread over ``processes`` generator processes that time the same
    window; their rates added up, the p99 the worst of theirs."""
    processes = max(1, min(processes, clients))
    start_at = time.time() + 3.0 + processes * 0.5  # every process imported and connected by then
    share = [clients // processes + (1 if k < clients % processes else 0) for k in range(processes)]
    scenario = {"kind": "grpc", "grpc_port": daemon.grpc_port, "rows": list(rows), "datatype": datatype,
                "max_requests": max(1, max_requests // processes), "duration_s": duration_s, "warmup_s": warmup_s,
                "pool": pool, "start_at": start_at, "warmup_requests": 1 if rows[0] == rows[1] and rows[0] > 16 else 0}
    with ThreadPoolExecutor(processes) as threads:
        results = list(threads.map(lambda k: bench.generate({**scenario, "clients": share[k], "seed": 1 + k}),
                                   range(processes)))
    errors: dict[str, int] = {}
    for r in results:
        for kind, n in r["errors"].items():
            errors[kind] = errors.get(kind, 0) + n
    if not any(r["requests"] for r in results):
        raise BenchError(f"no gRPC request was answered: {errors} {results[0].get('first_error')}")
    return {"requests": sum(r["requests"] for r in results),
            "requests_per_s": sum(r["requests_per_s"] for r in results),
            "samples_per_s": sum(r["samples_per_s"] for r in results),
            "mb_per_s": sum(r["mb_per_s"] for r in results),
            "p50_ms": float(np.median([r["p50_ms"] for r in results])),
            "p99_ms": max(r["p99_ms"] for r in results), "errors": errors,
            "first_error": next((r["first_error"] for r in results if r["first_error"]), None),
            "processes": processes, "clients": clients, "datatype": datatype,
            "generator": "native" if getattr(bench.opts, "grpc_generator", None) else "grpc.aio",
            "foreign_cores": max(r["foreign_cores"] for r in results)}
