"""``mmad bench --torch``: mmad.torch's forward + backward from an outside gradient, Python included,
against ``mmad.export.to_torch``'s module in the same run and tiny-cuda-nn's native figures.

Two models, fp16 (tinycudann's modules' precision on CUDA):

* ``image``: the hash-grid image config (mmad/demo.py's ``IMAGE_CONFIG``: HashGrid 16 levels × 2
  features, base 16, scale 1.5, 2^19 table by default, 64 × 2 ReLU MLP, 2 inputs, 3 outputs);
* ``ngp``: the instant-NGP-like composite (HashGrid 2^19 16 levels × 2 features, base 16, scale 2
  on 3 dims + SphericalHarmonics degree 4 on 3 dims, 64 × 2 ReLU MLP, 6 inputs, 4 outputs).

For each, a :class:`mmad.torch.NetworkWithInputEncoding` with random parameters (the tables
normal(0, 0.1): tcnn's ±1e-4 would leave the grid out of the output) is first checked: its
forward of 4096 fresh rows against the float64 cpu oracle holding the same parameters (above
3e-3 the model is not timed and the run fails). Then, on ``--rows`` rows, with d loss / d output
a fixed fp16 tensor handed in from outside: ``y = module(x); y.backward(dy)``, with the
parameters' gradient only (x without grad) and with the input's too (x requiring grad), each call
the whole Python path (autograd, the module, mmad's launches). Timed with CUDA events around
10 back-to-back calls (the host's launch rate shows where it is the bottleneck), median of
``--repeats``; on the CPU with the host clock. The peer is ``mmad.export.to_torch``'s module of
the same parameters (plain PyTorch ops, fp32 under autocast fp16 on CUDA), the same forward +
backward, eager.

tiny-cuda-nn cannot run on the GPU host: ``TCNN_REFERENCE`` holds its native C++ forward +
backward on an H200 (params only / with input gradients), another run's figures; the bars are
≥ those and ≥ 20× the same run's peer.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from mmad.backends import timing
from mmad.bench.kernels import CheckFailed, write_report
from mmad.demo import IMAGE_CONFIG
from mmad.errors import MMADError, SpecError

MODELS = {
    "image": {"n_input_dims": 2, "n_output_dims": 3, "encoding": {**IMAGE_CONFIG["encoding"], "log2_hashmap_size": 19},
              "network": IMAGE_CONFIG["network"]},
    "ngp": {"n_input_dims": 6, "n_output_dims": 4,
            "encoding": {"otype": "Composite", "nested": [
                {"otype": "HashGrid", "n_dims_to_encode": 3, "n_levels": 16, "n_features_per_level": 2,
                 "log2_hashmap_size": 19, "base_resolution": 16, "per_level_scale": 2.0},
                {"otype": "SphericalHarmonics", "n_dims_to_encode": 3, "degree": 4}]},
            "network": {"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "None",
                        "n_neurons": 64, "n_hidden_layers": 2}},
}
# tiny-cuda-nn's native forward + backward on an H200, M samples/s at 2^18 rows, fp16:
# the parameters' gradients only / with the input's
TCNN_REFERENCE = {"source": "tiny-cuda-nn's native C++ forward + backward, H200, batch 2^18, fp16",
                  "params_msps": {"image": 490, "ngp": 427}, "input_msps": {"image": 476, "ngp": 305}}
X_TORCH_BAR = 20.0
TOLERANCE = 3e-3  # the fp16 forward against float64 (docs/design.md)
TABLE_STD = 0.1
ROWS_GPU = 1 << 18
ROWS_CPU = 1 << 11
CHECK_ROWS = 4096


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mmad bench --torch", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="image,ngp", help="comma-separated subset of image,ngp (default both)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="where the tensors live (default cuda where torch "
                                                             "has it, else cpu)")
    p.add_argument("--rows", type=int, help="batch rows (default 2^18 on CUDA, 2^11 on the CPU)")
    p.add_argument("--log2-hashmap-size", type=int, default=19, help="the grids' table size, log2 (default 19)")
    p.add_argument("--repeats", type=int, default=20, help="timed samples per figure (median reported)")
    p.add_argument("--peer", choices=("torch", "none"), default="torch",
                   help="mmad.export.to_torch's module in the same run, or none")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the table as markdown")
    return p.parse_args(argv)


def model_doc(name: str, log2_hashmap_size: int) -> dict[str, Any]:
    doc = MODELS[name]
    enc = doc["encoding"]
    if enc["otype"] == "Composite":
        enc = {**enc, "nested": [{**p, "log2_hashmap_size": log2_hashmap_size} if p["otype"] == "HashGrid" else p
                                 for p in enc["nested"]]}
    else:
        enc = {**enc, "log2_hashmap_size": log2_hashmap_size}
    return {**doc, "encoding": enc}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError as exc:
        raise MMADError(f"mmad bench --torch needs PyTorch ({exc}): pip install mmad[torch]") from exc
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        raise SpecError("--models", f"unknown model(s) {unknown}; allowed: {', '.join(MODELS)}")
    for name, value in (("--rows", args.rows), ("--repeats", args.repeats)):
        if value is not None and value < 1:
            raise SpecError(name, f"must be at least 1; got {value}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise MMADError("--device cuda: this torch has no CUDA device")
    rows = args.rows or (ROWS_GPU if device == "cuda" else ROWS_CPU)
    command = shlex.join(["mmad", "bench", "--torch", *argv])
    doc = run(models, device, rows, args.log2_hashmap_size, args.repeats, args.peer, command)
    write_report(doc, markdown_table(doc), Path(args.json) if args.json else None,
                 Path(args.markdown) if args.markdown else None)
    if doc["errors"]:
        raise CheckFailed("; ".join(doc["errors"]))
    return 0


def run(models: list[str], device: str, rows: int, log2_size: int, repeats: int, peer: str,
        command: str) -> dict[str, Any]:
    import torch

    results, errors = [], []
    for name in models:
        try:
            row = measure(name, model_doc(name, log2_size), device, rows, repeats, peer)
        except MMADError as exc:  # a failed check or launch: reported, the other model still runs
            row = {"model": name, "status": "failed", "reason": str(exc)}
        if row["status"] == "failed":
            errors.append(f"{name}: {row['reason']}")
            print(errors[-1], file=sys.stderr)
        results.append(judged(row))
        if device == "cuda":
            torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    return {"command": command, "host": socket.gethostname().split(".")[0],
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": platform.python_version(),
            "torch": torch.__version__, "device": f"{device} ({gpu})", "rows": rows, "repeats": repeats,
            "log2_hashmap_size": log2_size, "table_init": f"normal(0, {TABLE_STD})", "precision": "fp16",
            "models": {n: model_doc(n, log2_size) for n in models}, "tcnn_reference": TCNN_REFERENCE,
            "bars": {"x_torch": X_TORCH_BAR}, "results": results, "errors": errors}


def random_params(module, rng: np.random.Generator):
    """Xavier-scaled weights (tcnn's initial draws) and grid tables normal(0, TABLE_STD)."""
    import torch

    from mmad.export import tcnn_layout

    flat = module.params.detach().cpu().numpy().copy()
    for seg in tcnn_layout(module.spec):
        if seg.name.startswith("grid"):
            flat[seg.offset:seg.offset + seg.size] = rng.normal(0.0, TABLE_STD, seg.size)
    with torch.no_grad():
        module.params.copy_(torch.from_numpy(flat))


def oracle_error(module, doc: dict[str, Any], device: str, rng: np.random.Generator) -> float:
    """The module's forward of fresh rows against the float64 cpu oracle with its parameters."""
    import torch

    from mmad.backends.cpu import CpuBackend
    from mmad.export import from_tcnn
    from mmad.spec import MLPSpec

    spec = MLPSpec.from_json({**doc, "precision": "fp32"})
    oracle = CpuBackend("float64").compile(spec)
    oracle.set_params(from_tcnn(spec, module.params.detach().cpu().numpy()))
    x = rng.random((CHECK_ROWS, doc["n_input_dims"]), dtype=np.float32)
    with torch.no_grad():
        out = module(torch.from_numpy(x).to(device)).float().cpu().numpy().astype(np.float64)
    ref = oracle.forward_train(x.astype(np.float64), out_dtype=np.float64)[0]
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def measure(name: str, doc: dict[str, Any], device: str, rows: int, repeats: int, peer: str) -> dict[str, Any]:
    import torch

    import mmad.torch as mt
    from mmad.export import from_tcnn, to_torch

    rng = np.random.default_rng(2026)
    module = mt.NetworkWithInputEncoding(doc["n_input_dims"], doc["n_output_dims"], doc["encoding"], doc["network"])
    random_params(module, rng)
    module.to(device)
    err = oracle_error(module, doc, device, rng)
    row: dict[str, Any] = {"model": name, "rel_err_vs_float64": err, "tolerance": TOLERANCE}
    if not err <= TOLERANCE:
        return {**row, "status": "failed", "reason": f"the forward differs from the float64 oracle by {err:.2e} "
                                                     f"(> {TOLERANCE}); not timed"}
    x = torch.rand(rows, doc["n_input_dims"], device=device)
    dy = torch.randn(rows, doc["n_output_dims"], device=device, dtype=torch.float16)
    clock = "torch" if device == "cuda" else "host"
    calls = timing.GPU_CALLS_PER_SAMPLE if device == "cuda" else 1

    def step(x_in, net, grad):
        y = net(x_in)
        y.backward(grad)

    xg = x.clone().requires_grad_()
    params_s = timing.median_seconds(timing.back_to_back(lambda: step(x, module, dy), calls), repeats,
                                     clock=clock, calls=calls)
    input_s = timing.median_seconds(timing.back_to_back(lambda: step(xg, module, dy), calls), repeats,
                                    clock=clock, calls=calls)
    finite = bool(torch.isfinite(module.params.grad).all() and torch.isfinite(xg.grad).all())
    if not finite:
        return {**row, "status": "failed", "reason": "the gradients hold NaN or Inf"}
    runner = module._runners.get((str(x.device), False))
    row.update(status="measured", reason=None, params_msps=rows / params_s / 1e6, input_msps=rows / input_s / 1e6,
               timing={"clock": clock, "calls_per_sample": calls, "path": "y = module(x); y.backward(dy)",
                       "cuda_graphs": bool(getattr(runner, "captured_rows", None))})
    if peer == "torch":
        from mmad.spec import MLPSpec

        spec = MLPSpec.from_json({**doc, "precision": "fp32"})
        plain = to_torch(spec, from_tcnn(spec, module.params.detach().cpu().numpy())).to(device)
        dy32 = dy.float()

        def peer_step(x_in):
            with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=device == "cuda"):
                y = plain(x_in)
            y.float().backward(dy32)

        xpg = x.clone().requires_grad_()
        row["torch_params_msps"] = rows / timing.median_seconds(timing.back_to_back(lambda: peer_step(x), calls),
                                                                repeats, clock=clock, calls=calls) / 1e6
        row["torch_input_msps"] = rows / timing.median_seconds(timing.back_to_back(lambda: peer_step(xpg), calls),
                                                               repeats, clock=clock, calls=calls) / 1e6
        row["peer"] = (f"mmad.export.to_torch (torch {torch.__version__}), "
                       + ("fp32 under autocast fp16, eager" if device == "cuda" else "fp32"))
    return row


def judged(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with its ratios to the peer and to tcnn's reference, and whether each bar is met."""
    out = dict(row)
    measured = row["status"] == "measured"
    bars = {}
    for phase in ("params", "input"):
        value = row.get(f"{phase}_msps")
        reference = TCNN_REFERENCE[f"{phase}_msps"][row["model"]]
        peer = row.get(f"torch_{phase}_msps")
        out[f"x_tcnn_reference_{phase}"] = value / reference if measured else None
        out[f"x_torch_{phase}"] = value / peer if measured and peer else None
        bars[f"{phase}_msps"] = {"bar": reference, "met": value >= reference if measured else None,
                                 "what": f"{phase} >= {reference} M samples/s"}
        if peer is not None:
            bars[f"x_torch_{phase}"] = {"bar": X_TORCH_BAR, "met": out[f"x_torch_{phase}"] >= X_TORCH_BAR,
                                        "what": f"{phase} >= {X_TORCH_BAR:.0f}x to_torch"}
    out["bars"] = bars
    return out


def markdown_table(doc: dict[str, Any]) -> str:
    def fmt(value: Any, pattern: str) -> str:
        return pattern.format(value) if isinstance(value, (int, float)) else "–"

    head = ("| model | params grads M samples/s | + input grads M samples/s | × to_torch | × tcnn native | "
            "rel. err | bars |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in doc["results"]:
        if r["status"] == "measured":
            missed = [b["what"] for b in r["bars"].values() if not b["met"]]
            verdict = "all met" if not missed else "missed: " + ", ".join(missed)
        else:
            verdict = f"{r['status']}: {r['reason']}"
        lines.append(f"| {r['model']} | {fmt(r.get('params_msps'), '{:,.3g}')} | {fmt(r.get('input_msps'), '{:,.3g}')} "
                     f"| {fmt(r.get('x_torch_params'), '{:.1f}×')} / {fmt(r.get('x_torch_input'), '{:.1f}×')} "
                     f"| {fmt(r.get('x_tcnn_reference_params'), '{:.2f}×')} / "
                     f"{fmt(r.get('x_tcnn_reference_input'), '{:.2f}×')} "
                     f"| {fmt(r.get('rel_err_vs_float64'), '{:.1e}')} | {verdict} |")
    lines.append("")
    lines += [f"Failed: {e}" for e in doc["errors"]]
    ref = doc["tcnn_reference"]
    lines.append(f"tiny-cuda-nn (not run here; {ref['source']}), params / + input M samples/s: "
                 + "; ".join(f"{m} {ref['params_msps'][m]} / {ref['input_msps'][m]}" for m in ref["params_msps"]) + ".")
    lines.append(f"{doc['rows']:,} rows on {doc['device']}, fp16, 2^{doc['log2_hashmap_size']} tables; "
                 f"y = module(x); y.backward(dy) with Python included; median of {doc['repeats']}.")
    return "\n".join(lines)


__all__ = ["MODELS", "TCNN_REFERENCE", "main", "markdown_table", "run"]
