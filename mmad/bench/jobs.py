"""Training through the daemon against training in-process and PyTorch, in one run.

``mmad bench --jobs [options]``. For each model and batch size, the same backend variant:

* ``job``: a training job over HTTP (``mmad serve`` started here on a free loopback port,
  the dataset uploaded through the client in chunks, ``start_job``, followed to the end);
  the rate is the daemon's own (steps x batch over the job's training time) and the client's
  wall time from the start request to the final event;
* ``epochs``: ``train_epochs`` in-process on the same dataset held on the device (what a job
  runs, without HTTP, threads or checkpoints);
* ``in-process``: ``train_step(x, y, steps=N)`` on device arrays of one batch (the backend's
  own rate at that batch);
* ``torch``: PyTorch on the same device, data on the device, a batch drawn each step from a
  per-epoch ``randperm`` (autocast fp16 + fused Adam, as tests' peer; CUDA only).

Each figure is the median of ``--repeats`` timed runs of about ``--seconds`` each. Ratios:
job / in-process at the same batch (the issue's target), in-process at each batch per sample
against the largest batch, job / torch. ``--big`` also uploads a 2^22-row dataset of model M
in chunks, trains on it, and checks that an oversized one is refused while the daemon serves.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from mmad.backends import select
from mmad.backends.contract import EpochPosition
from mmad.bench.service_quick import start_daemon
from mmad.spec import bench_spec


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mmad bench --jobs", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="", help="NAME[:VARIANT] (default: the best available)")
    p.add_argument("--models", default="M", help="comma-separated subset of S,M,L,W (default M)")
    p.add_argument("--batches", default="14,16,18,20", help="log2 of the batch sizes (default 14,16,18,20)")
    p.add_argument("--rows", type=int, help="dataset rows (default 2^20 on a GPU, 2^14 on the CPU)")
    p.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32", help="the dataset's type as uploaded")
    p.add_argument("--seconds", type=float, default=1.0, help="training time per timed run (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per figure (median reported)")
    p.add_argument("--peer", choices=("torch", "none"), default="torch")
    p.add_argument("--big", action="store_true", help="also upload and train a 2^22-row model-M dataset")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    return p.parse_args(argv)


def _median_rate(run, steps: int, batch: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(steps)
        times.append(time.perf_counter() - start)
    return steps * batch / float(np.median(times))


def _steps_for(seconds: float, per_step_s: float, least: int = 3) -> int:
    return max(least, int(seconds / max(per_step_s, 1e-7)))


def in_process(model, x: np.ndarray, y: np.ndarray, batch: int, args) -> dict[str, float]:
    """train_step on one device batch (steps per call as the job's chunks take), and
    train_epochs over the device dataset."""
    on_device = not isinstance(model.upload(x[:1]), np.ndarray)  # the backend keeps arrays on a device
    dx = model.upload(x[:batch]) if on_device else x[:batch]
    upload_target = getattr(model, "upload_target", model.upload)  # vulkan keeps targets in their own layout
    dy = upload_target(y[:batch]) if on_device else y[:batch]
    start = time.perf_counter()
    model.train_step(dx, dy, 3)
    per_step = (time.perf_counter() - start) / 3
    steps = _steps_for(args.seconds, per_step)
    model.train_step(dx, dy, steps)  # warm: graphs captured, workspace sized
    step_rate = _median_rate(lambda n: model.train_step(dx, dy, n), steps, batch, args.repeats)
    step100 = _median_rate(lambda n: model.train_step(dx, dy, n), 100, batch, args.repeats)
    data = model.put_dataset([(x, y)], x.shape[0], x.dtype, y.dtype)
    position = EpochPosition(1)
    model.train_epochs(data, batch, steps, position)
    epochs_rate = _median_rate(lambda n: model.train_epochs(data, batch, n, position), steps, batch, args.repeats)
    return {"in_process": step_rate, "in_process_100_steps": step100, "epochs": epochs_rate,
            "steps_per_run": steps, "dataset_on_device": data.on_device}


def torch_rate(spec, x: np.ndarray, y: np.ndarray, batch: int, args) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    from mmad.bench.torch_peer import torch_mlp

    xs = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).cuda()
    ys = torch.from_numpy(np.ascontiguousarray(y, dtype=np.float32)).cuda()
    net = torch_mlp(spec, "cuda").float()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, betas=(0.9, 0.99), eps=1e-15, fused=True)
    rows = xs.shape[0]
    state = {"order": torch.randperm(rows, device="cuda"), "at": 0}

    def run(steps: int) -> None:
        for _ in range(steps):
            if state["at"] + batch > rows:
                state["order"], state["at"] = torch.randperm(rows, device="cuda"), 0
            idx = state["order"][state["at"]:state["at"] + batch]
            state["at"] += batch
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(net(xs[idx]).float(), ys[idx])
            loss.backward()
            opt.step()
        torch.cuda.synchronize()

    run(3)
    start = time.perf_counter()
    run(3)
    steps = _steps_for(args.seconds, (time.perf_counter() - start) / 3)
    return _median_rate(run, steps, batch, args.repeats)


def job_rates(client, name: str, dataset: str, batch: int, steps: int, repeats: int) -> dict[str, float]:
    daemon, wall = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        job = client.start_job(name, dataset, steps, batch, checkpoint_every=steps)
        final = client.follow_job(name, job, progress=False)
        wall.append(steps * batch / (time.perf_counter() - start))
        if final["state"] != "done":
            raise SystemExit(f"job on {name} at batch {batch} ended {final['state']}: {final.get('error')}")
        daemon.append(final["samples_per_s"])
    return {"job": float(np.median(daemon)), "job_wall": float(np.median(wall))}


def big_dataset(client, url: str) -> dict[str, Any]:
    """A 2^22-row model-M dataset (2 GiB as fp32) uploaded in chunks and trained on; then one
    over the daemon's --max-dataset-bytes is refused and the daemon still answers."""
    import httpx

    spec = bench_spec("M")
    rows = 1 << 22
    rng = np.random.default_rng()
    x = rng.uniform(-1, 1, size=(rows, spec.n_input_dims)).astype(np.float32)
    y = rng.uniform(-1, 1, size=(rows, spec.n_output_dims)).astype(np.float32)
    client.create_model("big", spec.to_json())
    start = time.perf_counter()
    dataset = client.upload_dataset("big", x, y, progress=False)
    upload_s = time.perf_counter() - start
    job = client.start_job("big", dataset, 64, 1 << 18, checkpoint_every=64)
    final = client.follow_job("big", job, progress=False)
    refused = httpx.post(f"{url}/v2/models/big/datasets/{dataset}/chunks",
                         content=_chunk_bytes(x[:1 << 16], y[:1 << 16]), timeout=60)
    alive = httpx.get(f"{url}/v2/health/ready", timeout=10).status_code
    return {"rows": rows, "bytes": int(x.nbytes + y.nbytes), "upload_s": upload_s,
            "upload_mib_per_s": (x.nbytes + y.nbytes) / upload_s / 2**20, "job_state": final["state"],
            "job_samples_per_s": final["samples_per_s"], "oversized_status": refused.status_code,
            "oversized_error": refused.json().get("error") if refused.status_code >= 400 else None,
            "ready_after": alive}


def _chunk_bytes(x: np.ndarray, y: np.ndarray) -> bytes:
    from safetensors.numpy import save

    return save({"x": x, "y": y})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from mmad_client import Client

    backend, row = select(args.backend)
    label = f"{row.backend}:{row.variant}"
    on_gpu = row.backend != "cpu"
    rows = args.rows or (1 << 20 if on_gpu else 1 << 14)
    batches = [1 << int(b) for b in args.batches.split(",")]
    batches = [b for b in batches if b <= rows]
    dtype = np.float16 if args.dtype == "fp16" else np.float32
    results: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    big_limit = 2 * 2**30 + 2**20  # the 2^22-row fp32 dataset of M fits; one chunk more does not
    with tempfile.TemporaryDirectory(prefix="mmad-bench-jobs-") as store:
        flags = ["--max-dataset-bytes", str(big_limit)] if args.big else []
        proc, url = start_daemon(Path(store), label, flags)
        try:
            client = Client(url, timeout=600)
            for name in args.models.split(","):
                spec = bench_spec(name)
                model = backend.compile(spec, variant=row.variant)
                rng = np.random.default_rng()
                x = rng.uniform(-1, 1, size=(rows, spec.n_input_dims)).astype(dtype)
                y = rng.uniform(-1, 1, size=(rows, spec.n_output_dims)).astype(dtype)
                client.create_model(name, spec.to_json())
                start = time.perf_counter()
                dataset = client.upload_dataset(name, x, y, progress=False)
                upload_s = time.perf_counter() - start
                for batch in batches:
                    figures = in_process(model, x, y, batch, args)
                    steps = figures["steps_per_run"]
                    figures.update(job_rates(client, name, dataset, batch, steps, args.repeats))
                    figures["torch"] = torch_rate(spec, x, y, batch, args) if args.peer == "torch" else None
                    figures.update(model=name, backend=label, batch=batch, dataset_rows=rows,
                                   dataset_dtype=args.dtype, upload_s=upload_s,
                                   upload_mib_per_s=(x.nbytes + y.nbytes) / upload_s / 2**20)
                    results.append(figures)
                    _print_row(figures)
                model.close()
                client.delete_model(name)
            if args.big:
                extra["big_dataset"] = big_dataset(client, url)
                print("big dataset:", json.dumps(extra["big_dataset"]))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    for model_name in {r["model"] for r in results}:
        mine = [r for r in results if r["model"] == model_name]
        top = max(mine, key=lambda r: r["batch"])
        for r in mine:
            r["in_process_100_vs_largest_batch"] = r["in_process_100_steps"] / top["in_process"]
    print(_table(results))
    if args.json:
        doc = {"kind": "training-service", "host": platform.node(), "device": row.device, "backend": label,
               "results": results, **extra}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


def _print_row(r: dict[str, Any]) -> None:
    peer = "-" if r["torch"] is None else f"{r['torch'] / 1e6:.1f}"
    print(f"{r['model']} batch 2^{int(math.log2(r['batch']))}: job {r['job'] / 1e6:.1f} M/s, "
          f"epochs {r['epochs'] / 1e6:.1f}, in-process {r['in_process'] / 1e6:.1f}, torch {peer}", flush=True)


def _table(results: list[dict[str, Any]]) -> str:
    head = ("| model | backend | batch | job M/s | job/in-process | epochs M/s | in-process M/s | "
            "in-process 100 steps / largest batch | torch M/s | job/torch |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in results:
        torch_col = "-" if r["torch"] is None else f"{r['torch'] / 1e6:.1f}"
        vs_torch = "-" if r["torch"] is None else f"{r['job'] / r['torch']:.2f}"
        lines.append(f"| {r['model']} | {r['backend']} | 2^{int(math.log2(r['batch']))} | {r['job'] / 1e6:.1f} | "
                     f"{r['job'] / r['in_process']:.2f} | {r['epochs'] / 1e6:.1f} | {r['in_process'] / 1e6:.1f} | "
                     f"{r['in_process_100_vs_largest_batch']:.2f} | {torch_col} | {vs_torch} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
