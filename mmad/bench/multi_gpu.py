"""Several GPUs of one host through one daemon: replicas serving, data-parallel training.

``mmad bench --multi-gpu [--backend cuda:mma] [--parts ...] [--json PATH]``, model M, on a host
with two or more devices (the first two are used). In one run (``--parts`` picks some):

* ``loss-curve``: in process, a data-parallel run over two replicas (each its shard and half of
  each batch, gradients all-reduced) against one device trained on the same global batches
  assembled on the host: the largest relative difference of the step losses and of the final
  weights, and whether the replicas' weights are bitwise identical afterwards;
* ``in-process``: ``train_epochs`` on one device at the per-device batch and at the
  global batch, against the data-parallel run at the per-device batch on each device;
* ``jobs``: training jobs through the daemon on a model with one replica and on one with a
  replica on each device (``config.device``), the same dataset and global batch; the rate is the
  daemon's own (steps x batch over the job's training time);
* ``serving``: 8 clients, each a process of its own (so no client's interpreter is the bound),
  sending 65,536-row binary FP16 requests back to back to each model; samples/s, the ratio of
  two replicas to one; and the same through Triton's system shared memory (tritonclient, a
  region pair per client), where the request bodies are small and the devices' copies and
  kernels are what remains.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from mmad.backends import select
from mmad.backends.numerics import epoch_rows
from mmad.backends.parallel import shard_bounds, shard_positions
from mmad.bench.service_quick import start_daemon
from mmad.spec import bench_spec


PARTS = ("loss-curve", "in-process", "jobs", "serving")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mmad bench --multi-gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="cuda:mma", help="NAME[:VARIANT] (default cuda:mma)")
    p.add_argument("--model", default="M", help="one of S,M,L,W (default M)")
    p.add_argument("--batch-log2", type=int, default=20, help="log2 of the per-device batch (default 20)")
    p.add_argument("--rows-log2", type=int, default=22, help="log2 of the dataset rows (default 22)")
    p.add_argument("--check-batch-log2", type=int, default=16, help="per-device batch of the loss-curve check")
    p.add_argument("--check-steps", type=int, default=60, help="steps of the loss-curve check")
    p.add_argument("--job-steps", type=int, default=2000, help="steps of each training job")
    p.add_argument("--serve-seconds", type=float, default=6.0, help="timed serving window per model")
    p.add_argument("--workers", type=int, default=0,
                   help="the daemon's inference workers (mmad serve --workers; default 0)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"what to run, comma-separated among {','.join(PARTS)} (default all)")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    args = p.parse_args(argv)
    args.parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown or not args.parts:
        p.error(f"--parts: {', '.join(unknown) or 'none given'}; choose among {', '.join(PARTS)}")
    return args


def loss_curve_check(backend, variant: str, spec, args) -> dict[str, Any]:
    """Data-parallel on devices 0 and 1 against device 0 alone on the same global batches."""
    part = 1 << args.check_batch_log2
    rows = 4 * 2 * part
    rng = np.random.default_rng()
    x = rng.uniform(-1, 1, (rows, spec.n_input_dims)).astype(np.float16)
    y = rng.uniform(-1, 1, (rows, spec.n_output_dims)).astype(np.float16)
    seed = int(rng.integers(2**32))
    bounds = shard_bounds(rows, 2)
    replicas = [backend.compile(spec, variant=variant, device=d) for d in (0, 1)]
    single = backend.compile(spec, variant=variant, device=0)
    trainer = backend.data_parallel(replicas)
    try:
        shards = [r.put_dataset([(x[a:b], y[a:b])], b - a, x.dtype, y.dtype) for r, (a, b) in zip(replicas, bounds)]
        positions = shard_positions(seed, 2)
        parallel = trainer.train_epochs(shards, [part, part], args.check_steps, positions)
        reference, ref_positions = [], shard_positions(seed, 2)
        for _ in range(args.check_steps):
            take = []
            for (a, b), position in zip(bounds, ref_positions):
                take.append(a + epoch_rows(position.seed, position.epoch, b - a, position.cursor, part))
                position.advance(b - a, part)
            take = np.concatenate(take)
            reference.append(float(single.train_step(x[take], y[take])[0]))
        params = [r.get_params() for r in replicas]
        ref_params = single.get_params()
        identical = all(np.array_equal(params[0][k], params[1][k]) for k in params[0])
        weight_err = max(float(np.abs(params[0][k] - v).max() / max(np.abs(v).max(), 1e-12))
                         for k, v in ref_params.items())
        loss_err = float(np.max(np.abs(np.asarray(parallel, np.float64) - reference) / np.abs(reference)))
        return {"steps": args.check_steps, "per_device_batch": part, "losses_parallel": [float(v) for v in parallel],
                "losses_single": reference, "max_loss_rel_diff": loss_err, "max_weight_rel_diff": weight_err,
                "replica_weights_identical": identical}
    finally:
        trainer.close()
        for model in (*replicas, single):
            model.close()


def in_process_rates(backend, variant: str, spec, x, y, args) -> dict[str, Any]:
    """Samples/s of train_epochs on device 0 (per-device and global batch) and of the
    data-parallel run on devices 0 and 1 (per-device batch each)."""
    part = 1 << args.batch_log2
    rows = x.shape[0]
    out: dict[str, Any] = {}
    single = backend.compile(spec, variant=variant, device=0)
    data = single.put_dataset([(x, y)], rows, x.dtype, y.dtype)
    for label, batch in (("single_per_device_batch", part), ("single_global_batch", 2 * part)):
        position = shard_positions(1, 1)[0]
        single.train_epochs(data, batch, 5, position)  # warm
        steps = max(20, args.job_steps // 2)
        start = time.perf_counter()
        single.train_epochs(data, batch, steps, position)
        out[label] = steps * batch / (time.perf_counter() - start)
    single.close()
    replicas = [backend.compile(spec, variant=variant, device=d) for d in (0, 1)]
    trainer = backend.data_parallel(replicas)
    bounds = shard_bounds(rows, 2)
    shards = [r.put_dataset([(x[a:b], y[a:b])], b - a, x.dtype, y.dtype) for r, (a, b) in zip(replicas, bounds)]
    positions = shard_positions(2, 2)
    trainer.train_epochs(shards, [part, part], 5, positions)
    steps = max(20, args.job_steps // 2)
    start = time.perf_counter()
    trainer.train_epochs(shards, [part, part], steps, positions)
    out["parallel_2_devices"] = steps * 2 * part / (time.perf_counter() - start)
    out["parallel_vs_single"] = out["parallel_2_devices"] / out["single_global_batch"]
    trainer.close()
    for model in replicas:
        model.close()
    return out


def job_rate(client, name: str, dataset: str, batch: int, steps: int) -> dict[str, Any]:
    job = client.start_job(name, dataset, steps, batch, checkpoint_every=steps)
    final = client.follow_job(name, job, progress=False)
    if final["state"] != "done":
        raise SystemExit(f"the job on {name} ended {final['state']}: {final.get('error')}")
    return {"samples_per_s": final["samples_per_s"], "devices": final["devices"], "loss": final["loss"]}


def serve_rate(url: str, spec, name: str, seconds: float, clients: int = 8) -> dict[str, Any]:
    """``clients`` load-generator processes of one connection each (``mmad.bench.load``'s
    generator: a client's own Python, so the generator's GIL is not what is measured) sending
    65,536-row binary FP16 requests back to back; their rates added up."""
    port = int(url.rsplit(":", 1)[1])
    procs = []
    for k in range(clients):
        scenario = {"kind": "http", "host": "127.0.0.1", "port": port, "path": f"/v2/models/{name}/infer",
                    "wire": "binary16", "rows": [65536, 65536], "clients": 1, "max_requests": 100000,
                    "duration_s": seconds, "warmup_s": 1.0, "warmup_requests": 1, "seed": 7 + k, "pool": 2,
                    "n_input_dims": spec.n_input_dims, "n_output_dims": spec.n_output_dims}
        procs.append(subprocess.Popen([sys.executable, "-m", "mmad.bench.load", "--generator", json.dumps(scenario)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=seconds + 120)
        if proc.returncode != 0:
            raise SystemExit(f"a load generator failed: {err[-2000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    errors = [r["first_error"] for r in results if r.get("first_error")]
    return {"samples_per_s": sum(r["samples_per_s"] for r in results),
            "requests": sum(r["requests"] for r in results),
            "p50_ms": float(np.median([r["p50_ms"] for r in results])), "errors": errors, "per_client": results}


def _shm_client(args: tuple[str, int, int, str, int, int, float, float]) -> dict[str, Any]:
    """One load-generator process: its own tritonclient and system shared-memory regions, FP16
    requests of ``rows`` rows back to back from ``start`` until ``deadline`` (wall clock)."""
    import tritonclient.http as httpclient
    import tritonclient.utils.shared_memory as shm

    host, k, rows, name, n_in, n_out, start, deadline = args
    in_bytes, out_bytes = rows * n_in * 2, rows * n_out * 2
    triton = httpclient.InferenceServerClient(host, connection_timeout=120, network_timeout=120)
    tag = f"mmad_bench_{name}_{k}"
    regions = [shm.create_shared_memory_region(tag + "_in", "/" + tag + "_in", in_bytes),
               shm.create_shared_memory_region(tag + "_out", "/" + tag + "_out", out_bytes)]
    latencies: list[float] = []
    error = None
    try:
        x = np.random.default_rng(k).uniform(-1, 1, (rows, n_in)).astype(np.float16)
        shm.set_shared_memory_region(regions[0], [x])
        triton.register_system_shared_memory(tag + "_in", "/" + tag + "_in", in_bytes)
        triton.register_system_shared_memory(tag + "_out", "/" + tag + "_out", out_bytes)
        inp = httpclient.InferInput("INPUT", [rows, n_in], "FP16")
        inp.set_shared_memory(tag + "_in", in_bytes)
        out = httpclient.InferRequestedOutput("OUTPUT")
        out.set_shared_memory(tag + "_out", out_bytes)
        fp16_out = {"output_datatype": "FP16"}  # mmad's request parameter: FP16 outputs, as tiny-cuda-nn's
        triton.infer(name, [inp], outputs=[out], parameters=fp16_out)  # warm
        time.sleep(max(0.0, start - time.time()))
        while time.time() < deadline:
            began = time.perf_counter()
            triton.infer(name, [inp], outputs=[out], parameters=fp16_out)
            latencies.append(time.perf_counter() - began)
        result = shm.get_contents_as_numpy(regions[1], np.float16, [rows, n_out])
        if not np.isfinite(result).all():
            error = f"client {k}: non-finite outputs"
    except Exception as exc:  # noqa: BLE001 - reported in the figures
        error = f"client {k}: {type(exc).__name__}: {exc}"
    finally:
        try:
            triton.unregister_system_shared_memory(tag + "_in")
            triton.unregister_system_shared_memory(tag + "_out")
        except Exception:  # noqa: BLE001 - the daemon may be gone; the regions go below
            pass
        for region in regions:
            shm.destroy_shared_memory_region(region)
        triton.close()
    return {"latencies": latencies, "error": error}


def serve_shm_rate(url: str, spec, name: str, seconds: float, clients: int = 8, rows: int = 65536) -> dict[str, Any]:
    """``clients`` load-generator processes (a client's own Python, so the generator's GIL is
    not what is measured), each with its own system shared-memory regions, sending
    ``rows``-row FP16 requests back to back for ``seconds``."""
    import multiprocessing

    host = url.split("//", 1)[1]
    start = time.time() + 3.0  # every process connected and warm by then
    deadline = start + seconds
    jobs = [(host, k, rows, name, spec.n_input_dims, spec.n_output_dims, start, deadline) for k in range(clients)]
    with multiprocessing.get_context("spawn").Pool(clients) as pool:
        results = pool.map(_shm_client, jobs)
    latencies = [t for r in results for t in r["latencies"]]
    errors = [r["error"] for r in results if r["error"]]
    done = len(latencies)
    in_bytes, out_bytes = rows * spec.n_input_dims * 2, rows * spec.n_output_dims * 2
    return {"requests": done, "samples_per_s": done * rows / seconds,
            "tensor_gb_per_s": done * (in_bytes + out_bytes) / seconds / 1e9,
            "p50_ms": float(np.median(latencies) * 1e3) if latencies else None,
            "p99_ms": float(np.percentile(latencies, 99) * 1e3) if latencies else None, "errors": errors,
            "per_client_requests": [len(r["latencies"]) for r in results]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from mmad_client import Client

    backend, row = select(args.backend)
    label = f"{row.backend}:{row.variant}"
    devices = backend.devices()
    if len(devices) < 2:
        raise SystemExit(f"mmad bench --multi-gpu needs two devices; {label} has {len(devices)}")
    spec = bench_spec(args.model)
    doc: dict[str, Any] = {"kind": "multi-gpu", "host": platform.node(), "backend": label, "model": args.model,
                           "devices": [d.to_json() for d in devices[:2]], "command": " ".join(sys.argv)}
    if "loss-curve" in args.parts:
        doc["loss_curve"] = loss_curve_check(backend, row.variant, spec, args)
        lc = doc["loss_curve"]
        print(f"loss curve: {lc['steps']} steps, max rel. loss diff {lc['max_loss_rel_diff']:.2e}, weights "
              f"{lc['max_weight_rel_diff']:.2e}, replicas identical: {lc['replica_weights_identical']}", flush=True)
    rng = np.random.default_rng()
    rows = 1 << args.rows_log2
    x = rng.uniform(-1, 1, (rows, spec.n_input_dims)).astype(np.float16)
    y = rng.uniform(-1, 1, (rows, spec.n_output_dims)).astype(np.float16)
    if "in-process" in args.parts:
        doc["in_process"] = in_process_rates(backend, row.variant, spec, x, y, args)
        print("in-process M samples/s:", {k: round(v / 1e6, 1) if k != "parallel_vs_single" else round(v, 3)
                                          for k, v in doc["in_process"].items()}, flush=True)
    part = 1 << args.batch_log2
    if "jobs" in args.parts or "serving" in args.parts:
        with tempfile.TemporaryDirectory(prefix="mmad-bench-multi-") as store:
            proc, url = start_daemon(Path(store), label, ["--max-dataset-bytes", str(8 << 30),
                                                          "--workers", str(args.workers)])
            doc["workers"] = args.workers
            try:
                daemon_parts(doc, Client(url, timeout=600), url, spec, x, y, part, args)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    print(table(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


def daemon_parts(doc: dict[str, Any], client, url: str, spec, x, y, part: int, args) -> None:
    """Training jobs and serving through the daemon, on a model with one replica and on one with
    a replica on each of devices 0 and 1."""
    client.create_model("one", spec.to_json())
    meta = client.create_model("two", spec.to_json(), config={"device": [0, 1]})
    if meta.get("devices") != [0, 1]:
        raise SystemExit(f"the two-replica model was placed on {meta.get('devices')}, not devices 0 and 1")
    doc["two_replicas_devices"] = meta["devices"]
    if "jobs" in args.parts:
        datasets = {name: client.upload_dataset(name, x, y, progress=False) for name in ("one", "two")}
        jobs = {"one_per_device_batch": job_rate(client, "one", datasets["one"], part, args.job_steps),
                "one_global_batch": job_rate(client, "one", datasets["one"], 2 * part, args.job_steps),
                "two_global_batch": job_rate(client, "two", datasets["two"], 2 * part, args.job_steps)}
        jobs["two_vs_one_global"] = (jobs["two_global_batch"]["samples_per_s"]
                                     / jobs["one_global_batch"]["samples_per_s"])
        jobs["two_vs_one_per_device"] = (jobs["two_global_batch"]["samples_per_s"]
                                         / jobs["one_per_device_batch"]["samples_per_s"])
        doc["jobs"] = jobs
        print("jobs:", json.dumps(jobs), flush=True)
    if "serving" in args.parts:
        serving = {name: serve_rate(url, spec, name, args.serve_seconds) for name in ("one", "two")}
        serving["two_vs_one"] = serving["two"]["samples_per_s"] / serving["one"]["samples_per_s"]
        shm_serving = {name: serve_shm_rate(url, spec, name, args.serve_seconds) for name in ("one", "two")}
        for figures in shm_serving.values():
            if figures["errors"] or not figures["requests"]:
                raise SystemExit(f"system shared-memory serving failed: {figures['errors'][:3]}")
        shm_serving["two_vs_one"] = shm_serving["two"]["samples_per_s"] / shm_serving["one"]["samples_per_s"]
        doc["serving"], doc["serving_system_shm"] = serving, shm_serving
        print(f"system shared memory, 8 clients: one replica {shm_serving['one']['samples_per_s'] / 1e6:.2f} M/s, "
              f"two {shm_serving['two']['samples_per_s'] / 1e6:.2f} M/s ({shm_serving['two_vs_one']:.2f}x)", flush=True)
        print(f"serving 8 clients x 65,536 rows FP16: one replica {serving['one']['samples_per_s'] / 1e6:.2f} M/s, "
              f"two {serving['two']['samples_per_s'] / 1e6:.2f} M/s ({serving['two_vs_one']:.2f}x)", flush=True)


def table(doc: dict[str, Any]) -> str:
    lines = ["| what | figure |", "|---|---|"]
    if "loss_curve" in doc:
        lc = doc["loss_curve"]
        lines.append(f"| loss curve, 2 devices vs 1 on the same global batches | max rel. diff "
                     f"{lc['max_loss_rel_diff']:.2e} ({lc['steps']} steps); replicas identical: "
                     f"{lc['replica_weights_identical']} |")
    if "in_process" in doc:
        ip = doc["in_process"]
        lines += [f"| in-process train_epochs, 1 device, global batch | {ip['single_global_batch'] / 1e6:.1f} M "
                  "samples/s |",
                  f"| in-process data-parallel, 2 devices | {ip['parallel_2_devices'] / 1e6:.1f} M samples/s "
                  f"({ip['parallel_vs_single']:.2f}x) |"]
    if "jobs" in doc:
        jobs = doc["jobs"]
        lines += [f"| job, 1 replica, global batch | {jobs['one_global_batch']['samples_per_s'] / 1e6:.1f} M "
                  "samples/s |",
                  f"| job, 2 replicas (data-parallel) | {jobs['two_global_batch']['samples_per_s'] / 1e6:.1f} M "
                  f"samples/s ({jobs['two_vs_one_global']:.2f}x) |"]
    if "serving" in doc:
        for key, what in (("serving", "serving"), ("serving_system_shm", "system shared memory")):
            one, two = doc[key]["one"]["samples_per_s"] / 1e6, doc[key]["two"]["samples_per_s"] / 1e6
            lines += [f"| {what}, 8 clients, 1 replica | {one:.2f} M samples/s |",
                      f"| {what}, 8 clients, 2 replicas | {two:.2f} M samples/s ({doc[key]['two_vs_one']:.2f}x) |"]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
