#!/usr/bin/env python3
"""Soak: mixed concurrent infer / train / jobs / load / unload / weight upload against one daemon.

The daemon runs in its own process on 127.0.0.1 (cpu backend). Worker threads, each with its
own HTTP client, hit it for ``--duration-s`` seconds (default 300):

- infer (4 threads): JSON FP32, binary FP32 and binary FP16, 1-64 rows, on three models, a
  fifth of them pinned to a random stored version; every output is checked for shape and
  finiteness;
- train: ``POST /train`` with 1-4 steps; jobs: a 60-step job with checkpoints, again and again;
- weights: download, upload random weights, checkpoint;
- lifecycle: unload and load one of the models in a loop (its infers then get 503).

Pass criteria: no error except the documented 503 (queue full, model not loaded/unloading),
each 503 carrying ``Retry-After``; the daemon's RSS (``/proc/<pid>/status`` VmRSS) grows less
than 10% from the end of warm-up (the first quarter) to the end; no leaked device buffers.

Device buffers are counted through the backend contract: the daemon is started by this script
(``--serve``) with ``Registry._compile`` wrapped so that every compiled model is recorded until
its ``close()``, and ``GET /soak/device`` (added by this script only, not part of mmad) reports
the open models and the sum of their ``CompiledModel.device_bytes()`` next to what the registry
still references (live + pinned copies). After the load stops, open must equal referenced; after
unloading every model, both must be zero.

Usage: ``python scripts/soak.py --duration-s 300`` (prints a JSON report; exit status 1 on failure).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import orjson
from safetensors.numpy import load as st_load, save as st_save

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fault_injection import Daemon  # noqa: E402  (the shared loopback daemon launcher)

MODELS = {
    "soak-a": {"n_input_dims": 8, "n_output_dims": 4, "network": {"n_neurons": 32, "n_hidden_layers": 2},
               "precision": "fp16", "seed": 1},
    "soak-b": {"n_input_dims": 3, "n_output_dims": 3, "network": {"n_neurons": 64, "n_hidden_layers": 2},
               "encoding": {"otype": "Frequency", "n_frequencies": 4}, "precision": "fp32", "seed": 2},
    "soak-c": {"n_input_dims": 5, "n_output_dims": 2, "network": {"n_neurons": 16, "n_hidden_layers": 1},
               "precision": "fp32", "seed": 3},
}
TRAIN_MODEL, JOB_MODEL, WEIGHTS_MODEL, LIFECYCLE_MODEL = "soak-a", "soak-b", "soak-a", "soak-c"
RSS_LIMIT = 0.10
RSS_SAMPLE_S = 0.5


# -- the daemon side (``--serve``) ------------------------------------------------------------
def serve_main(argv: list[str]) -> int:
    """Run ``mmad serve`` with compiled-model accounting and ``GET /soak/device``."""
    import mmad.server.app as app_module
    from mmad.server import main as daemon_main
    from mmad.engine.registry import Registry

    lock = threading.Lock()
    open_models: dict[int, object] = {}
    totals = Counter()
    compile_model = Registry._compile

    def tracked_compile(self, *args, **kwargs):
        compiled = compile_model(self, *args, **kwargs)
        close = compiled.close

        def tracked_close() -> None:
            with lock:
                if open_models.pop(id(compiled), None) is not None:
                    totals["closed"] += 1
            close()

        compiled.close = tracked_close
        with lock:
            open_models[id(compiled)] = compiled
            totals["compiled"] += 1
        return compiled

    Registry._compile = tracked_compile
    create_app = app_module.create_app

    def create_app_with_counters(settings=None, workers=None):
        app = create_app(settings, workers=workers)

        @app.get("/soak/device", include_in_schema=False)
        async def device_counters():
            registry = app.state.runtime.registry
            held = {}
            for entry in list(registry.models.values()):
                for replica in entry.replicas:
                    if replica.model is not None:
                        held[id(replica.model)] = replica.model
                for compiled in list(entry.pinned.values()):
                    held[id(compiled)] = compiled
            with lock:
                current = dict(open_models)
                counts = dict(totals)
            return {"open_models": len(current), "device_bytes": sum(m.device_bytes() for m in current.values()),
                    "held_models": len(held), "held_bytes": sum(m.device_bytes() for m in held.values()),
                    "unheld_open": sorted(f"{type(m).__name__}:{m.spec.n_input_dims}->{m.spec.n_output_dims}"
                                          for k, m in current.items() if k not in held),
                    "compiled_total": counts.get("compiled", 0), "closed_total": counts.get("closed", 0)}

        if os.environ.get("MMAD_SOAK_TRACEMALLOC"):  # diagnosis only: where does memory grow?
            import tracemalloc

            tracemalloc.start(8)
            baseline = {}

            @app.get("/soak/memory", include_in_schema=False)
            async def memory_growth(reset: bool = False):
                snapshot = tracemalloc.take_snapshot()
                if reset or "snap" not in baseline:
                    baseline["snap"] = snapshot
                    return {"reset": True}
                top = snapshot.compare_to(baseline["snap"], "traceback")[:15]
                return {"top": [{"size_diff": t.size_diff, "count_diff": t.count_diff,
                                 "where": [str(f) for f in t.traceback.format()[-6:]]} for t in top]}

        return app

    app_module.create_app = create_app_with_counters
    return daemon_main.main(argv)


# -- the client side ----------------------------------------------------------------------
class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ok = Counter()
        self.backpressure = Counter()
        self.errors: Counter = Counter()  # distinct problems and how often each happened
        self.error_count = 0

    def record(self, op: str, r: httpx.Response | None, problem: str | None = None) -> bool:
        """True when the response is a success; 503 with Retry-After is documented backpressure."""
        with self.lock:
            if problem is None and r is not None and r.status_code == 503 and r.headers.get("retry-after"):
                self.backpressure[op] += 1
                return False
            if problem is None and r is not None and r.status_code < 300:
                self.ok[op] += 1
                return True
            self.error_count += 1
            detail = problem or f"{r.status_code} {r.text[:200]}" + (
                " (503 without Retry-After)" if r.status_code == 503 else "")
            if detail in self.errors or len(self.errors) < 30:
                self.errors[f"{op}: {detail}"] += 1
            return False


def infer_request(model: str, x: np.ndarray, encoding: str) -> tuple[bytes, dict]:
    if encoding == "json":
        doc = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
        return orjson.dumps(doc), {"Content-Type": "application/json"}
    datatype, dtype = ("FP16", "<f2") if encoding == "fp16" else ("FP32", "<f4")
    blob = x.astype(dtype).tobytes()
    header = orjson.dumps({"inputs": [{"name": "INPUT", "datatype": datatype, "shape": list(x.shape),
                                       "parameters": {"binary_data_size": len(blob)}}],
                           "outputs": [{"name": "OUTPUT", "parameters": {"binary_data": True}}]})
    return header + blob, {"Inference-Header-Content-Length": str(len(header))}


def check_output(r: httpx.Response, rows: int, cols: int) -> str | None:
    length = r.headers.get("inference-header-content-length")
    if length is None:
        out = r.json()["outputs"][0]
        data = np.asarray(out["data"], np.float32)
    else:
        n = int(length)
        out = orjson.loads(r.content[:n])["outputs"][0]
        data = np.frombuffer(r.content[n:], "<f4")
    if out["shape"] != [rows, cols] or data.size != rows * cols:
        return f"output shape {out['shape']} for {rows} rows"
    if not np.isfinite(data).all():
        return "non-finite output"
    return None


class Soak:
    def __init__(self, url: str, duration_s: float, seed: int):
        self.url = url
        self.deadline = time.monotonic() + duration_s
        self.seed = seed
        self.tally = Tally()
        self.stop = threading.Event()
        self.versions: dict[str, list[str]] = {m: ["1"] for m in MODELS}
        self.dataset: str | None = None

    def running(self) -> bool:
        return not self.stop.is_set() and time.monotonic() < self.deadline

    def call(self, http: httpx.Client, op: str, method: str, path: str, **kw) -> httpx.Response | None:
        try:
            r = http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            self.tally.record(op, None, f"{type(exc).__name__}: {exc}")
            return None
        return r if self.tally.record(op, r) else None

    def infer_worker(self, index: int) -> None:
        rng = np.random.default_rng(self.seed * 100 + index)
        with httpx.Client(base_url=self.url, timeout=30.0) as http:
            while self.running():
                model = list(MODELS)[int(rng.integers(len(MODELS)))]
                spec = MODELS[model]
                rows = int(rng.integers(1, 65))
                x = rng.uniform(-1, 1, (rows, spec["n_input_dims"])).astype(np.float32)
                encoding = ("json", "fp32", "fp16")[int(rng.integers(3))]
                body, headers = infer_request(model, x, encoding)
                path = f"/v2/models/{model}/infer"
                if rng.random() < 0.2:
                    version = random.Random(int(rng.integers(1 << 30))).choice(self.versions[model])
                    path = f"/v2/models/{model}/versions/{version}/infer"
                r = self.call(http, "infer", "POST", path, content=body, headers=headers)
                if r is not None:
                    problem = check_output(r, rows, spec["n_output_dims"])
                    if problem:
                        self.tally.record("infer", None, problem)

    def train_worker(self) -> None:
        rng = np.random.default_rng(self.seed + 1)
        spec = MODELS[TRAIN_MODEL]
        with httpx.Client(base_url=self.url, timeout=30.0) as http:
            while self.running():
                x = rng.uniform(-1, 1, (32, spec["n_input_dims"])).astype(np.float32)
                y = np.sin(x[:, :spec["n_output_dims"]] * 2).astype(np.float32)
                doc = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()},
                                  {"name": "TARGET", "datatype": "FP32", "shape": list(y.shape), "data": y.ravel().tolist()}],
                       "parameters": {"steps": int(rng.integers(1, 5))}}
                r = self.call(http, "train", "POST", f"/v2/models/{TRAIN_MODEL}/train", json=doc)
                if r is not None and not all(v is not None for v in r.json()["losses"]):
                    self.tally.record("train", None, f"non-finite loss {r.json()['losses']}")
                time.sleep(0.02)

    def job_worker(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30.0) as http:
            while self.running():
                r = self.call(http, "job", "POST", f"/v2/models/{JOB_MODEL}/jobs",
                              json={"dataset": self.dataset, "steps": 60, "batch_size": 64, "checkpoint_every": 20})
                if r is None:
                    time.sleep(0.5)
                    continue
                job = r.json()["job"]
                state = "running"
                while state not in ("done", "failed", "cancelled"):
                    time.sleep(0.1)
                    s = self.call(http, "job-status", "GET", f"/v2/models/{JOB_MODEL}/jobs/{job}")
                    if s is None:
                        break
                    state = s.json()["state"]
                    if not self.running() and state == "running":
                        self.call(http, "job-cancel", "DELETE", f"/v2/models/{JOB_MODEL}/jobs/{job}")
                if state == "failed":
                    self.tally.record("job", None, f"job {job} failed: {s.json().get('error')}")
                elif s is not None:
                    self.versions[JOB_MODEL] = self.versions[JOB_MODEL] + s.json()["versions"]

    def weights_worker(self) -> None:
        rng = np.random.default_rng(self.seed + 2)
        with httpx.Client(base_url=self.url, timeout=30.0) as http:
            while self.running():
                r = self.call(http, "weights-get", "GET", f"/v2/models/{WEIGHTS_MODEL}/weights")
                if r is not None:
                    params = {k: (v + rng.standard_normal(v.shape).astype(np.float32) * 0.01).astype(np.float32)
                              for k, v in st_load(r.content).items()}
                    u = self.call(http, "weights-put", "PUT", f"/v2/models/{WEIGHTS_MODEL}/weights",
                                  content=st_save(params))
                    if u is not None:
                        self.versions[WEIGHTS_MODEL] = self.versions[WEIGHTS_MODEL] + [u.json()["version"]]
                if rng.random() < 0.3:
                    c = self.call(http, "checkpoint", "POST", f"/v2/models/{WEIGHTS_MODEL}/versions")
                    if c is not None:
                        self.versions[WEIGHTS_MODEL] = self.versions[WEIGHTS_MODEL] + [c.json()["version"]]
                time.sleep(0.2)

    def lifecycle_worker(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30.0) as http:
            while self.running():
                self.call(http, "unload", "POST", f"/v2/repository/models/{LIFECYCLE_MODEL}/unload")
                time.sleep(0.3)
                self.call(http, "load", "POST", f"/v2/repository/models/{LIFECYCLE_MODEL}/load")
                time.sleep(0.7)
            self.call(http, "load", "POST", f"/v2/repository/models/{LIFECYCLE_MODEL}/load")

    def setup(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60.0) as http:
            for name, spec in MODELS.items():
                r = http.put(f"/v2/models/{name}", json={"spec": spec, "config": {"max_queue_requests": 64}})
                if r.status_code not in (200, 201):
                    raise RuntimeError(f"cannot create {name}: {r.status_code} {r.text}")
            rng = np.random.default_rng(self.seed)
            spec = MODELS[JOB_MODEL]
            x = rng.uniform(-1, 1, (2048, spec["n_input_dims"])).astype(np.float32)
            y = np.cos(x * 3).astype(np.float32)
            r = http.post(f"/v2/models/{JOB_MODEL}/datasets", content=st_save({"x": x, "y": y}))
            if r.status_code != 200:
                raise RuntimeError(f"cannot upload the dataset: {r.status_code} {r.text}")
            self.dataset = r.json()["dataset"]

    def threads(self) -> list[threading.Thread]:
        targets = [(self.infer_worker, (i,)) for i in range(4)] + [
            (self.train_worker, ()), (self.job_worker, ()), (self.weights_worker, ()), (self.lifecycle_worker, ())]
        return [threading.Thread(target=t, args=a, name=t.__name__, daemon=True) for t, a in targets]


def run(duration_s: float, seed: int = 0, workdir: Path | None = None, trace_memory: bool = False) -> dict:
    """Run the soak; ``trace_memory`` (slow) adds the daemon's top tracemalloc growth sites."""
    import tempfile

    root = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="mmad-soak-"))
    # every version stays: pinned infers pick any version acknowledged since the start
    daemon = Daemon(root / "store", "--max-queue-requests", "64", "--keep-versions", "0", log_path=root / "daemon.log")
    daemon.command = [sys.executable, str(Path(__file__).resolve()), "--serve"]
    if trace_memory:
        os.environ["MMAD_SOAK_TRACEMALLOC"] = "1"  # inherited by the daemon process
    report: dict = {"duration_s": duration_s, "failures": []}
    daemon.start()
    try:
        soak = Soak(daemon.url, duration_s, seed)
        soak.setup()
        t0 = time.monotonic()
        workers = soak.threads()
        for w in workers:
            w.start()
        rss: list[tuple[float, int]] = []
        device: list[int] = []
        memory_baseline_taken = False
        with httpx.Client(base_url=daemon.url, timeout=30.0) as http:
            while time.monotonic() < soak.deadline:
                if trace_memory and not memory_baseline_taken and time.monotonic() - t0 > duration_s * 0.25:
                    http.get("/soak/memory", params={"reset": True})
                    memory_baseline_taken = True
                rss.append((time.monotonic() - t0, daemon.rss_bytes()))
                if len(rss) % 4 == 0:
                    device.append(http.get("/soak/device").json()["device_bytes"])
                time.sleep(RSS_SAMPLE_S)
            soak.stop.set()
            for w in workers:
                w.join(60)
            if trace_memory:
                report["memory_growth_top"] = http.get("/soak/memory").json()["top"]
            if any(w.is_alive() for w in workers):
                report["failures"].append("a worker did not stop within 60 s")
            quiesced = http.get("/soak/device").json()
            for name in MODELS:
                r = http.post(f"/v2/repository/models/{name}/unload")
                if r.status_code != 200:
                    report["failures"].append(f"final unload of {name}: {r.status_code} {r.text[:200]}")
            unloaded = http.get("/soak/device").json()
            for name in MODELS:  # and they come back
                r = http.post(f"/v2/repository/models/{name}/load")
                if r.status_code != 200:
                    report["failures"].append(f"reload of {name}: {r.status_code} {r.text[:200]}")
        if not daemon.alive:
            report["failures"].append("the daemon died")
        elapsed = time.monotonic() - t0
        tally = soak.tally
        warm = [b for t, b in rss if duration_s * 0.2 <= t <= duration_s * 0.3] or [rss[0][1]]
        last = [b for t, b in rss if t >= duration_s * 0.9] or [rss[-1][1]]
        rss_start, rss_end = float(np.median(warm)), float(np.median(last))
        growth = rss_end / rss_start - 1.0
        report.update({
            "elapsed_s": round(elapsed, 1),
            "requests_ok": dict(tally.ok), "requests_ok_total": sum(tally.ok.values()),
            "backpressure_503": dict(tally.backpressure), "errors": tally.error_count,
            "error_kinds": dict(tally.errors.most_common(30)),
            "infer_per_s": round(tally.ok["infer"] / elapsed, 1),
            "rss_warm_mib": round(rss_start / 2**20, 1), "rss_end_mib": round(rss_end / 2**20, 1),
            "rss_max_mib": round(max(b for _, b in rss) / 2**20, 1), "rss_growth": round(growth, 4),
            "rss_mib_by_tenth": [round(float(np.median([b for t, b in rss if i * duration_s / 10 <= t
                                                        < (i + 1) * duration_s / 10] or [0])) / 2**20, 1)
                                 for i in range(10)],
            "device_bytes_max": max(device) if device else None,
            "device_after_load": quiesced, "device_after_unload": unloaded,
        })
        if tally.error_count:
            report["failures"].append(f"{tally.error_count} errors: {dict(tally.errors.most_common(3))}")
        if growth >= RSS_LIMIT:
            report["failures"].append(f"RSS grew {growth:.1%} (limit {RSS_LIMIT:.0%})")
        if quiesced["open_models"] != quiesced["held_models"] or quiesced["device_bytes"] != quiesced["held_bytes"]:
            report["failures"].append(f"leaked compiled models after the load stopped: {quiesced}")
        if unloaded["open_models"] or unloaded["device_bytes"]:
            report["failures"].append(f"device buffers left after unloading every model: {unloaded}")
        for op in ("infer", "train", "job", "weights-put", "unload", "load"):
            if not tally.ok[op]:
                report["failures"].append(f"no successful {op!r} at all: the mix did not run")
    finally:
        daemon.kill()
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return serve_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, help="store and daemon log here (default: a temporary directory)")
    p.add_argument("--trace-memory", action="store_true",
                   help="diagnosis: report where the daemon's memory grew (tracemalloc, slows it down)")
    args = p.parse_args(argv)
    # SIGTERM (e.g. from `timeout`) unwinds like an exception, so the daemon is stopped too
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    report = run(args.duration_s, args.seed, args.workdir, args.trace_memory)
    print(json.dumps(report, indent=1))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
