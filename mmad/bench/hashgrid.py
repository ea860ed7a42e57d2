"""``mmad bench --hashgrid``: tiny-cuda-nn's hash-grid image config on each backend, against a
PyTorch hash grid in the same run and tiny-cuda-nn's own figures on an H100.

The model is ``IMAGE_CONFIG`` (mmad/demo.py: 2 inputs, HashGrid 16 levels × 2 features, base
resolution 16, scale 1.5, 64 × 2 ReLU MLP, 3 outputs) with each ``--log2-hashmap-sizes`` table
(default 2^15 and 2^19), in fp16 on cuda (its mma variant computes only in fp16) and fp32
elsewhere unless ``--precision`` says otherwise. Every backend and the peer get the same
parameters (mmad's initial weights; grid tables normal(0, 0.1), since tcnn's ±1e-4 would leave
the grid out of the output and a broken grid would pass the check) and the same data: positions
uniform in [0, 1)^2, targets ``demo_field`` of them. For each backend and table:

* check: the forward (fp32 out, so that the bound judges the model's arithmetic and not the
  fp16 output's rounding, 2.4e-4 on its own) of 4096 fresh positions against the float64 cpu
  oracle with the same parameters (``mmad.bench.kernels.oracle_check``); above 3e-3 for fp16
  or 1e-4 for fp32 the backend is not timed and the run fails;
* inference: ``forward(dx, out_dtype=float16)`` on device-array positions (fp32 in, fp16 out:
  tcnn's I/O; wgpu device arrays are float32 out), timed as ``mmad bench`` times a
  forward on that backend (mmad.bench.kernels: CUDA events over three rotated input sets on
  cuda, a recorded program re-submitted 10 times on vulkan, 10 calls a sample on wgpu);
* training: ``train_step(dx, dy, steps)``, one call of ``--steps-per-sample`` steps whose
  returned losses are the synchronisation point, on the host clock: rows × steps / seconds,
  the optimizer step included. The losses of every call, warm-up included, must be finite and
  the last below the first, else the run fails.

A backend that cannot run here or refuses the model (BackendUnavailable, SpecError: vulkan's
coopmat variant a precision fp32 model) is a "refused" row with its reason, not an error of the run.

The PyTorch peer (``--peer torch``) is ``mmad.export.to_torch``: the same model in plain torch
ops with the grid tables as parameters (checked against the float64 oracle in
tests/test_bench_hashgrid.py). On CUDA the forward is the fp32 module under autocast fp16 (the
positions stay fp32: ``.half()`` on the module would round them into other cells), fp16 out,
captured in a CUDA graph as the other benchmarks' peer (hundreds of small kernels, launched
eagerly, would time the host); training runs eagerly under autocast: MSE loss, backward,
fused Adam (lr 1e-2, β 0.9 / 0.99, ε 1e-15) on fp32 parameters; both timed with CUDA events.
On the CPU both run in fp32 on the host clock.

tiny-cuda-nn is not run here (its PyTorch bindings crash on the GPU stack the benchmark runs
on): its figures are those of its native C++ API on an H100 (``TCNN_REFERENCE``), and the ratios
against them are ``x_tcnn_reference_*``, figures from another run, never same-run figures.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmad.backends.dispatch import CHECK_ROWS
from mmad.backends import timing
from mmad.bench.kernels import (
    DEVICE_FP32_ONLY, CheckFailed, Options as KernelOptions, Target, _measure_cuda, _measure_host,
    _measure_vulkan, _NoBar, _release_device_memory, _split, oracle_check, resolve_target, write_report,
)
from mmad.demo import IMAGE_CONFIG, demo_field
from mmad.errors import BackendUnavailable, MMADError, SpecError
from mmad.spec import MLPSpec

TCNN_REFERENCE = {
    "source": "tiny-cuda-nn 2.0, native C++ API, JIT-fused, H100",
    "rows": 1 << 18,
    "train_msps": {15: 566, 19: 446},
    "infer_msps": {15: 3227, 19: 2976},
}
# the targets: a little above tiny-cuda-nn's figures (M samples/s at 2^18 rows per table size), and
# the ratio to the same run's peer
BARS = {"train_msps": {15: 600, 19: 480}, "infer_msps": {15: 3300, 19: 3000}}
X_TORCH_BAR = 10.0
TOLERANCE = {"fp16": 3e-3, "fp32": 1e-4}  # relative L2 error of the fp32-out forward vs float64
TABLE_STD = 0.1
ROWS_GPU = 1 << 18
ROWS_CPU = 1 << 12
PEER_LR = 1e-2  # IMAGE_CONFIG's optimizer
FORWARD_TIMERS = {"cuda": _measure_cuda, "vulkan": _measure_vulkan}  # else the host clock


@dataclass
class Unavailable:
    """A ``--backend`` that cannot run here: each of its rows is "refused" with ``reason``."""

    arg: str
    reason: str


@dataclass
class Options:
    backends: list[Target | Unavailable]  # in the order of --backend
    sizes: list[int]
    rows: int
    repeats: int
    steps: int
    precision: str | None  # None: fp16 on cuda, fp32 elsewhere
    peer: str
    json: Path | None
    markdown: Path | None
    command: str


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mmad bench --hashgrid", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", action="append", metavar="NAME[:VARIANT]",
                   help="cpu, cuda[:mma|cublaslt|wgmma], vulkan[:coopmat2|coopmat|simt], wgpu; repeatable or "
                        "comma-separated (default: MMAD_BACKEND, else the best available)")
    p.add_argument("--rows", type=int, help="batch rows (default 2^18 on a GPU, 2^12 on the CPU)")
    p.add_argument("--log2-hashmap-sizes", default="15,19",
                   help="comma-separated log2 of the hash tables' sizes (default 15,19)")
    p.add_argument("--precision", choices=("fp16", "fp32"),
                   help="the model's precision on every backend (default fp16 on cuda, whose mma variant "
                        "computes only in fp16, fp32 elsewhere)")
    p.add_argument("--repeats", type=int, default=20, help="timed samples per figure (median reported)")
    p.add_argument("--steps-per-sample", type=int, default=50,
                   help="training steps in each timed train_step call (default 50: each call ends with one "
                        "wait for its losses, about 5 %% of 10 steps of the image config on an H100)")
    p.add_argument("--peer", choices=("torch", "none"), default="torch",
                   help="a PyTorch hash grid + MLP (mmad.export.to_torch) in the same run, or none")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the table as markdown")
    return p.parse_args(argv)


def image_spec(log2_hashmap_size: int, precision: str) -> MLPSpec:
    return MLPSpec.from_json({**IMAGE_CONFIG, "precision": precision,
                              "encoding": {**IMAGE_CONFIG["encoding"], "log2_hashmap_size": log2_hashmap_size}})


def parse_options(args: argparse.Namespace, command: str) -> Options:
    """The options checked and the backends resolved; every mistake is a one-line error."""
    from mmad.backends import BACKENDS

    for name, value in (("--rows", args.rows), ("--repeats", args.repeats),
                        ("--steps-per-sample", args.steps_per_sample)):
        if value is not None and value < 1:
            raise SpecError(name, f"must be at least 1; got {value}")
    sizes = []
    for value in _split([args.log2_hashmap_sizes]):
        if not value.isdigit():
            raise SpecError("--log2-hashmap-sizes", f"{value!r} is not a whole number (e.g. 15,19)")
        try:
            image_spec(int(value), "fp32")
        except SpecError as exc:  # a size the spec refuses, in the spec's words
            raise SpecError("--log2-hashmap-sizes", str(exc)) from exc
        sizes.append(int(value))
    if not sizes:
        raise SpecError("--log2-hashmap-sizes", "name at least one size, e.g. 15,19")
    if args.peer == "torch":
        try:
            import torch  # noqa: F401
        except ImportError as exc:
            raise MMADError(f"--peer torch needs PyTorch ({exc}); install it or pass --peer none") from exc
    backends: list[Target | Unavailable] = []
    try:
        for arg in _split(args.backend) or [None]:
            if arg is not None and arg.partition(":")[0] not in BACKENDS:
                raise SpecError("--backend", f"unknown backend {arg.partition(':')[0]!r}; valid: "
                                             f"{', '.join(BACKENDS)}")
            try:
                backends.append(resolve_target(arg))
            except BackendUnavailable as exc:
                if arg is None:  # MMAD_BACKEND names a backend that cannot run here: its error as it is
                    raise
                backends.append(Unavailable(arg, exc.reason))
    except BaseException:
        close(backends)
        raise
    on_gpu = any(isinstance(t, Target) and t.kind == "gpu" for t in backends)
    return Options(backends, sizes, args.rows or (ROWS_GPU if on_gpu else ROWS_CPU), args.repeats,
                   args.steps_per_sample, args.precision, args.peer, Path(args.json) if args.json else None, Path(args.markdown) if args.markdown else None, command)


def main(argv: list[str]) -> int:
    opts = parse_options(parse_args(argv), shlex.join(["mmad", "bench", "--hashgrid", *argv]))
    try:
        doc = run(opts)
    finally:
        close(opts.backends)
    write_report(doc, markdown_table(doc), opts.json, opts.markdown)
    if doc["errors"]:
        raise CheckFailed("; ".join(doc["errors"]))
    return 0


def close(backends: list[Target | Unavailable]) -> None:
    for t in backends:
        if isinstance(t, Target):
            t.backend.close()


# -- measuring ----------------------------------------------------------------------------------
def run(opts: Options) -> dict[str, Any]:
    try:
        from tqdm import tqdm
    except ImportError:  # the GPU host's image may lack it: no progress bar, the same results
        tqdm = _NoBar
    rng = np.random.default_rng(2026)
    x = rng.random((opts.rows, 2), dtype=np.float32)
    y = demo_field(x)
    results: list[dict[str, Any]] = []
    peers: list[dict[str, Any]] = []
    errors: list[str] = []
    per_size = 2 * (len(opts.backends) + (opts.peer == "torch"))  # train + infer each
    with tqdm(total=per_size * len(opts.sizes), desc="mmad bench --hashgrid", unit="figure", file=sys.stderr) as bar:
        for size in opts.sizes:
            params = grid_params(image_spec(size, "fp32"), np.random.default_rng(size))
            # the peer right before the backends, table by table, so that a change in the
            # machine's load during the run shifts both sides of each ratio alike
            peer = time_torch_peer(image_spec(size, "fp32"), params, x, y, opts) if opts.peer == "torch" else None
            if peer is not None:
                peers.append(peer)
                bar.update(2)
            for t in opts.backends:
                if isinstance(t, Unavailable):
                    row = {"backend": t.arg, "target": t.arg, "device": None, "log2_hashmap_size": size,
                           "precision": precision(t.arg.partition(":")[0], opts), "status": "refused",
                           "reason": t.reason}
                else:
                    spec = image_spec(size, precision(t.row.backend, opts))
                    try:
                        row = measure(t, spec, params, x, y, opts)
                    finally:
                        _release_device_memory(t)
                if row["status"] == "failed":
                    errors.append(f"{row['backend']} with a 2^{size} table: {row['reason']}")
                    tqdm.write(errors[-1])
                results.append(judged(row, peer))
                bar.update(2)
    return {"command": opts.command, "host": socket.gethostname().split(".")[0],
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": platform.python_version(),
            # the table size and the precision are each row's
            "config": {**{k: v for k, v in IMAGE_CONFIG.items() if k != "precision"},
                       "encoding": {k: v for k, v in IMAGE_CONFIG["encoding"].items() if k != "log2_hashmap_size"}},
            "log2_hashmap_sizes": opts.sizes, "rows": opts.rows, "repeats": opts.repeats,
            "steps_per_sample": opts.steps, "table_init": f"normal(0, {TABLE_STD})",
            "tcnn_reference": TCNN_REFERENCE,
            "bars": {**BARS, "x_torch": X_TORCH_BAR}, "peer": peers, "results": results, "errors": errors}


def precision(backend_name: str, opts: Options) -> str:
    """``--precision``, else fp16 on cuda (its mma variant computes only in fp16), fp32 elsewhere."""
    return opts.precision or ("fp16" if backend_name == "cuda" else "fp32")


def grid_params(spec: MLPSpec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """mmad's initial weights with every grid table drawn from normal(0, TABLE_STD)."""
    from mmad.backends.contract import init_params

    params = init_params(spec)
    for name, shape in spec.grid_shapes.items():
        params[name] = rng.normal(0.0, TABLE_STD, size=shape).astype(np.float32)
    return params


def measure(t: Target, spec: MLPSpec, params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray,
            opts: Options) -> dict[str, Any]:
    """Check, then time, one table size on one backend: a row, "measured", "refused" or "failed"."""
    size = spec.encoding.log2_hashmap_size
    row: dict[str, Any] = {"backend": t.arg, "target": t.arg, "device": t.row.device, "log2_hashmap_size": size,
                           "precision": spec.precision}
    try:
        model = t.backend.compile(spec, variant=t.variant)
    except (SpecError, BackendUnavailable) as exc:
        return {**row, "status": "refused", "reason": str(exc)}
    row["backend"] = f"{t.row.backend}:{model.variant}"
    try:
        model.set_params(params)
        rng = np.random.default_rng(size)
        check_x = rng.random((CHECK_ROWS, 2), dtype=np.float32)  # fresh rows, not the timed ones
        rel_err = oracle_check(model, check_x, model.upload(check_x), np.float32, rng)
        tolerance = TOLERANCE[spec.precision]
        if not rel_err <= tolerance:
            raise CheckFailed(f"the forward differs from the float64 oracle by {rel_err:.2e} (> {tolerance} for "
                              f"{spec.precision}); not timed")
        out_dtype = np.float32 if t.row.backend in DEVICE_FP32_ONLY else np.float16
        dx = model.upload(x)
        forward_opts = KernelOptions(targets=[], models=[], rows=opts.rows, io={}, modes=("forward",), peer="none",
                                     repeats=opts.repeats, json=None, markdown=None, profile=False)
        forward = FORWARD_TIMERS.get(t.row.backend, _measure_host)(model, "forward", x, dx, x, y, out_dtype, rng,
                                                                   forward_opts)
        dy = getattr(model, "upload_target", model.upload)(y)  # vulkan keeps targets in their own layout
        calls: list[np.ndarray] = []
        train_s = timing.median_seconds(lambda: calls.append(np.asarray(model.train_step(dx, dy, opts.steps))),
                                        opts.repeats, sync=model.synchronize, calls=opts.steps, warmup=1)
        losses = np.concatenate(calls)
        if not np.isfinite(losses).all():
            raise CheckFailed(f"training produced non-finite losses ({np.count_nonzero(~np.isfinite(losses))} of "
                              f"{losses.size} steps)")
        if not losses[-1] < losses[0]:
            raise CheckFailed(f"training did not lower the loss over {losses.size} steps ({losses[0]:.4g} → "
                              f"{losses[-1]:.4g})")
    except MMADError as exc:  # a failed check, launch or allocation: reported, the others still run
        return {**row, "status": "failed", "reason": str(exc)}
    finally:
        model.close()
    return {**row, "status": "measured", "reason": None, "rel_err_vs_float64": rel_err, "tolerance": tolerance,
            "train_msps": opts.rows / train_s / 1e6, "infer_msps": opts.rows / forward.pop("seconds") / 1e6,
            "infer_io": f"fp32 in, {np.dtype(out_dtype).name.replace('float', 'fp')} out", "infer_timing": forward,
            "train_timing": {"clock": "host", "steps_per_call": opts.steps}, "loss_first": float(losses[0]),
            "loss_last": float(losses[-1]), "train_steps_checked": int(losses.size)}


def time_torch_peer(spec: MLPSpec, params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray,
                    opts: Options) -> dict[str, Any]:
    """The PyTorch hash grid + MLP of one table size: training and inference rates."""
    import torch

    from mmad.bench.torch_peer import forward_fn, train_step_fn
    from mmad.export import to_torch

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    clock = "torch" if on_gpu else "host"
    tx, ty = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
    # a module each: the forward's graph reads its weights in place, and training changes the other's
    forward = forward_fn(to_torch(spec, params).to(device), tx, autocast=True)
    calls = timing.GPU_CALLS_PER_SAMPLE if on_gpu else 1  # as mmad's cuda forward is timed
    infer_s = timing.median_seconds(timing.back_to_back(forward, calls), opts.repeats, clock=clock, calls=calls)
    step = train_step_fn(to_torch(spec, params).to(device), tx, ty, lr=PEER_LR)

    def steps() -> None:
        for _ in range(opts.steps):
            step()

    train_s = timing.median_seconds(steps, opts.repeats, clock=clock, calls=opts.steps, warmup=1)
    name = torch.cuda.get_device_name() if on_gpu else platform.processor() or platform.machine()
    del forward, step, tx, ty
    if on_gpu:
        torch.cuda.empty_cache()
    return {"log2_hashmap_size": spec.encoding.log2_hashmap_size, "peer": f"torch-{torch.__version__}",
            "device": f"{device} ({name})",
            "mode": ("forward: autocast fp16 in a CUDA graph, fp32 positions in, fp16 out; training: autocast "
                     "fp16 + fused Adam on fp32 parameters; CUDA events") if on_gpu else "float32, host clock",
            "train_msps": opts.rows / train_s / 1e6, "infer_msps": opts.rows / infer_s / 1e6}


def judged(row: dict[str, Any], peer: dict[str, Any] | None) -> dict[str, Any]:
    """``row`` with the same run's peer figures, the ratios to the peer and to tcnn's reference,
    and the targets with whether each is met (None where nothing was measured)."""
    size = row["log2_hashmap_size"]
    measured = row["status"] == "measured"
    out = dict(row)
    bars: dict[str, Any] = {}
    for phase in ("train", "infer"):
        value = row.get(f"{phase}_msps")
        torch_value = peer[f"{phase}_msps"] if peer else None
        reference = TCNN_REFERENCE[f"{phase}_msps"].get(size)
        out[f"torch_{phase}_msps"] = torch_value
        out[f"x_torch_{phase}"] = value / torch_value if measured and torch_value else None
        out[f"x_tcnn_reference_{phase}"] = value / reference if measured and reference else None
        bar = BARS[f"{phase}_msps"].get(size)
        if bar is not None:
            bars[f"{phase}_msps"] = {"bar": bar, "met": value >= bar if measured else None,
                                     "what": f"{phase} >= {bar:,} M samples/s"}
        if peer is not None:
            ratio = out[f"x_torch_{phase}"]
            bars[f"x_torch_{phase}"] = {"bar": X_TORCH_BAR, "met": ratio >= X_TORCH_BAR if measured else None,
                                        "what": f"{phase} >= {X_TORCH_BAR:.0f}x PyTorch"}
    out["bars"] = bars
    return out


# -- reporting ----------------------------------------------------------------------------------
def markdown_table(doc: dict[str, Any]) -> str:
    def fmt(value: Any, pattern: str) -> str:
        return pattern.format(value) if isinstance(value, (int, float)) else "–"

    head = ("| backend | table | precision | train M samples/s | infer M samples/s | × torch train / infer | "
            "× tcnn ref. train / infer | rel. err | targets |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in doc["results"]:
        if r["status"] == "measured":
            missed = [b["what"] for b in r["bars"].values() if not b["met"]]
            verdict = "all met" if not missed else "missed: " + ", ".join(missed)
        else:
            verdict = f"{r['status']}: {r['reason']}"
        lines.append(f"| {r['backend']} | 2^{r['log2_hashmap_size']} | {r['precision']} | "
                     f"{fmt(r.get('train_msps'), '{:,.2f}')} | {fmt(r.get('infer_msps'), '{:,.2f}')} | "
                     f"{fmt(r['x_torch_train'], '{:.1f}×')} / {fmt(r['x_torch_infer'], '{:.1f}×')} | "
                     f"{fmt(r['x_tcnn_reference_train'], '{:.2f}×')} / {fmt(r['x_tcnn_reference_infer'], '{:.2f}×')} | "
                     f"{fmt(r.get('rel_err_vs_float64'), '{:.1e}')} | {verdict} |")
    lines.append("")
    lines += [f"Failed: {e}" for e in doc["errors"]]
    for p in doc["peer"]:
        lines.append(f"PyTorch peer (same run), 2^{p['log2_hashmap_size']} table: {p['peer']} on {p['device']}, "
                     f"{p['mode']}: train {p['train_msps']:,.2f}, infer {p['infer_msps']:,.2f} M samples/s.")
    ref = doc["tcnn_reference"]
    sizes = sorted(ref["train_msps"])
    lines.append(f"tiny-cuda-nn reference (not run here; {ref['source']}; batch 2^{ref['rows'].bit_length() - 1}), "
                 "train / infer M samples/s: "
                 + "; ".join(f"2^{s} table {ref['train_msps'][s]:,} / {ref['infer_msps'][s]:,}" for s in sizes) + ".")
    bars = doc["bars"]
    lines.append("Targets: train " + ", ".join(f"≥ {bars['train_msps'][s]:,} (2^{s})" for s in sizes)
                 + "; infer " + ", ".join(f"≥ {bars['infer_msps'][s]:,} (2^{s})" for s in sizes)
                 + f"; ≥ {bars['x_torch']:.0f}× the same run's PyTorch peer at both.")
    lines.append(f"{doc['rows']:,} rows; median of {doc['repeats']}; {doc['steps_per_sample']} training steps a "
                 "timed call.")
    return "\n".join(lines)
