"""``mmad bench``: kernel throughput of the S/M/L/W models on any backend (docs/benchmarks.md).

For each model, and each ``--backend NAME[:VARIANT]`` in turn: compile; check the forward's
output against the float64 cpu oracle on up to 4096 random rows, in the I/O type that is timed
(a failed check is an error and the model is not timed on that backend); then time forward
(input already on the device, output left there) and one full training step (forward, L2
loss, backward, Adam) as the median of ``--repeats`` samples after warm-up (mmad.backends.timing):

* cuda — CUDA events around 10 back-to-back forwards, or one ``train_step(steps=10)``, a sample
  (the losses come back once a sample, as from a job's chunk of steps; the PyTorch peer never
  reads its loss); the forward rotates three input sets so that repeated calls do not time an
  input left in L2; ``--io fp16`` is ``forward(x16, out_dtype=float16)`` on fp16 device inputs
  (the PyTorch peer's own I/O);
* vulkan — the forward's recorded program re-submitted 10 times a sample (``--io fp16``: fp16
  device input and output, as on cuda), training
  ``train_step(steps=10)`` (a submission's wait is spread over 10 calls); a batch over the
  device's storage-buffer range trains on halves, its rate scaled to the full batch;
  ``--profile`` adds the GPU timestamps of each dispatch and the driver's pipeline statistics;
* wgpu — 10 back-to-back forwards or ``steps=10`` a sample (its synchronisation is a ~1 ms
  read-back);
* cpu — host clock, one call a sample.

The PyTorch peer (``--peer torch``, mmad.bench.torch_peer) runs in the same process, model by
model right before mmad, so that a change of the machine's load shifts both sides of a ratio
alike: on a CUDA device fp16 (a CUDA-graph forward; autocast + fused Adam training) timed with
CUDA events, on the CPU float32. The floor is max(bytes / copy bandwidth, FLOPs / matmul rate),
both measured in the same run on the device the backend runs on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np

from mmad.backends.dispatch import CHECK_ROWS, oracle_error, settled
from mmad.backends import timing
from mmad.errors import InvalidInput, MMADError, SpecError
from mmad.spec import MLPSpec, bench_spec

FP16_TOLERANCE = 3e-3  # relative L2 error of an fp16-weight model against the float64 oracle
INPUT_SETS = 3
# vulkan and wgpu: a sample's synchronisation (a fence wait, a read-back) costs about a
# millisecond, so each sample is this many back-to-back calls
CALLS_PER_SAMPLE = {"vulkan": 10, "wgpu": 10}
DEVICE_FP32_ONLY = ("wgpu",)  # its device arrays are float32 in and out
PROFILED = ("cuda", "vulkan")
MODES = {"forward": ("forward",), "train": ("train",), "both": ("forward", "train")}
ROWS_GPU = 1 << 20
ROWS_CPU = 1 << 16


class CheckFailed(MMADError):
    """A backend's output differs from the float64 oracle (or training diverged): not timed."""


@dataclass
class Target:
    """One ``--backend`` argument, resolved: the backend object and its probe row."""

    arg: str
    backend: Any
    row: Any
    variant: str | None  # None: the backend's own choice per model

    @property
    def kind(self) -> str:
        """Where its floor and its peer come from: "gpu" for a hardware GPU, else "cpu"."""
        return "gpu" if self.row.backend != "cpu" and not self.row.software else "cpu"


@dataclass
class Options:
    targets: list[Target]
    models: list[str]
    rows: int
    io: dict[str, str]  # backend name -> "fp16" | "fp32"
    modes: tuple[str, ...]
    peer: str
    repeats: int
    json: Path | None
    markdown: Path | None
    profile: bool
    dispatch: Path | None = None  # where the dispatcher's choices go (--dispatch)
    errors: list[str] = field(default_factory=list)


# -- the command line (its options: mmad/cli.py) -----------------------------------------------
def main(args: argparse.Namespace) -> int:
    if args.daemon_check or args.sass or args.nvmath_check or args.run_forward or args.run_train:
        return run_checks(args)
    opts = parse_options(args)
    try:
        doc = run(opts)
    finally:
        for t in opts.targets:
            t.backend.close()
    write_outputs(opts, doc)
    if doc["errors"]:
        raise CheckFailed("; ".join(doc["errors"]))
    return 0


def _split(values: list[str] | None) -> list[str]:
    return [v.strip() for item in values or [] for v in item.split(",") if v.strip()]


def parse_options(args: argparse.Namespace) -> Options:
    """The options checked and the backends resolved; every mistake is a one-line error."""
    from mmad.backends import BACKENDS

    models = [n.strip().upper() for n in args.models.split(",") if n.strip()]
    if not models:
        raise SpecError("--models", "name at least one of S, M, L, W")
    for name in models:
        bench_spec(name)
    if args.rows is not None and args.rows < 1:
        raise SpecError("--rows", f"must be at least 1; got {args.rows}")
    if args.repeats < 1:
        raise SpecError("--repeats", f"must be at least 1; got {args.repeats}")
    wanted = _split(args.backend) or [None]
    for arg in wanted:
        if arg is not None and arg.partition(":")[0] not in BACKENDS:
            raise SpecError("--backend", f"unknown backend {arg.partition(':')[0]!r}; valid: {', '.join(BACKENDS)}")
    for arg in wanted:
        if arg is not None and args.io == "fp16" and arg.partition(":")[0] in DEVICE_FP32_ONLY:
            raise SpecError("--io", f"the {arg.partition(':')[0]} backend's device arrays are float32: use --io fp32")
    if args.peer == "torch":
        try:
            import torch  # noqa: F401
        except ImportError as exc:
            raise MMADError(f"--peer torch needs PyTorch ({exc}); install it or pass --peer none") from exc
    if args.profile and any(arg is not None and arg.partition(":")[0] not in PROFILED for arg in wanted):
        raise SpecError("--profile", f"per-op GPU times exist for {' and '.join(PROFILED)} only")
    if args.profile and any(arg is None or arg.startswith("vulkan") for arg in wanted):
        # mmad.backends.vulkan.PIPELINE_STATS_ENV, read when the device opens
        os.environ.setdefault("MMAD_VULKAN_PIPELINE_STATS", "1")
    targets: list[Target] = []
    try:
        for arg in wanted:
            targets.append(resolve_target(arg))
            if args.profile and targets[-1].row.backend not in PROFILED:
                raise SpecError("--profile", f"per-op GPU times exist for {' and '.join(PROFILED)} only; "
                                             f"the default backend here is {targets[-1].row.backend}")
        io: dict[str, str] = {}
        for t in targets:
            name = t.row.backend
            if name in DEVICE_FP32_ONLY:
                if args.io == "fp16":
                    raise SpecError("--io", f"the {name} backend's device arrays are float32: use --io fp32")
                io[name] = "fp32"
            else:
                io[name] = args.io or "fp16"
        if args.dispatch and [t.variant for t in targets].count(None) != 1:
            raise SpecError("--dispatch", "reports the backend's own choice of variant: name one --backend "
                                          "without a variant (e.g. --backend cuda)")
    except BaseException:
        for t in targets:
            t.backend.close()
        raise
    rows = args.rows or (ROWS_GPU if any(t.kind == "gpu" for t in targets) else ROWS_CPU)
    return Options(targets, models, rows, io, MODES[args.mode], args.peer, args.repeats,
                   Path(args.json) if args.json else None, Path(args.markdown) if args.markdown else None,
                   args.profile, Path(args.dispatch) if args.dispatch else None)


def resolve_target(arg: str | None) -> Target:
    """One ``--backend`` argument (None: MMAD_BACKEND, else the best available) resolved; a backend
    that cannot run here raises BackendUnavailable, a name or variant that does not exist SpecError."""
    from mmad.backends import parse_forced, select

    try:
        backend, row = select(arg)
    except SpecError as exc:  # select() names MMAD_BACKEND, the usual source of a choice
        raise SpecError("--backend", str(exc).removeprefix(f"{exc.field}: ")) from exc
    if arg is None:  # MMAD_BACKEND's variant, else the backend's choice, as the daemon's
        forced = parse_forced()
        variant = forced[1] if forced else None
    else:
        variant = arg.partition(":")[2] or None
    return Target(arg or (f"{row.backend}:{variant}" if variant else row.backend), backend, row, variant)


def run_checks(args: argparse.Namespace) -> int:
    """``--daemon-check``, ``--sass``, ``--nvmath-check``, ``--run-forward``, ``--run-train``: lines
    printed as they come."""
    status = 0
    try:
        if args.run_train:
            from mmad.bench import cuda_tools

            name, _, variant = args.run_train.partition(":")
            bench_spec(name.upper())
            print(cuda_tools.run_train(name.upper(), variant or "mma", args.rows or ROWS_GPU), flush=True)
            return 0
        if args.run_forward:
            from mmad.bench import cuda_tools

            name, _, variant = args.run_forward.partition(":")
            bench_spec(name.upper())
            print(cuda_tools.run_forward(name.upper(), variant or "mma", args.rows or ROWS_GPU, args.io or "fp16"),
                  flush=True)
            return 0
        if args.nvmath_check:
            from mmad.bench import cuda_tools

            print("\n".join(cuda_tools.nvmath_check()), flush=True)
        if args.sass:
            from mmad.bench import cuda_tools

            for arg in _split(args.backend) or ["cuda:mma"]:
                name, _, variant = arg.partition(":")
                if name != "cuda" or variant not in ("", "mma", "wgmma"):
                    raise SpecError("--backend", f"--sass inspects cuda:mma or cuda:wgmma; got {arg!r}")
                print("\n".join(cuda_tools.sass_report(Path(args.sass), variant or "mma")), flush=True)
        if args.daemon_check:
            from mmad.bench.daemon_check import daemon_check

            backends = _split(args.backend)
            if len(backends) > 1:
                raise SpecError("--backend", "--daemon-check runs one daemon: name one backend")
            ok, lines = daemon_check(backends[0] if backends else "cuda")
            print("\n".join(lines), flush=True)
            status = 0 if ok else 1
    except ImportError as exc:
        raise MMADError(f"this check needs the cuda backend's stack (CuPy; nvmath-python for --nvmath-check): {exc}") from exc
    except FileNotFoundError as exc:
        raise MMADError(f"this check needs the CUDA toolkit's programs (cuobjdump, ptxas): {exc}") from exc
    return status


# -- measuring ----------------------------------------------------------------------------------
def run(opts: Options) -> dict[str, Any]:
    try:
        from tqdm import tqdm
    except ImportError:  # the GPU host's image may lack it: no progress bar, the same results
        tqdm = _NoBar
    kinds = sorted({t.kind for t in opts.targets})
    ceilings = {kind: timing.measure_ceilings(on_gpu=kind == "gpu" and _cuda_reachable()) for kind in kinds}
    peers: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    profiles: dict[str, list[str]] = {}
    steps = len(opts.models) * len(opts.modes) * (len(opts.targets) + (len(kinds) if opts.peer == "torch" else 0))
    with tqdm(total=steps, desc="mmad bench", unit="figure", file=sys.stderr) as bar:
        for name in opts.models:
            spec = bench_spec(name)
            # the peer and mmad are timed model by model, back to back, so that a change in the
            # machine's load during the run shifts both sides of each ratio alike
            peer_by_kind = {}
            for kind in kinds:
                if opts.peer == "torch":
                    peer_by_kind[kind] = time_torch_peer(name, opts, kind)
                    peers += peer_by_kind[kind]
                    bar.update(len(opts.modes))
            for t in opts.targets:
                try:
                    results = measure(t, spec, name, opts)
                except MMADError as exc:  # a failed check, compile or launch: reported, never timed
                    opts.errors.append(f"{name} on {t.arg}: {exc}")
                    tqdm.write(f"{name} on {t.arg}: {exc}")
                    bar.update(len(opts.modes))
                    continue
                finally:
                    _release_device_memory(t)
                for r in results:
                    floor = ceilings[t.kind]
                    r["floor_seconds"] = timing.floor_seconds(spec, opts.rows, floor, r["mode"] == "train",
                                                              2 if r["io"] == "fp16" else 4)
                    r["pct_floor"] = 100 * r["floor_seconds"] / r["seconds"]
                    peer = next((p for p in peer_by_kind.get(t.kind, []) if p["mode"] == r["mode"]), None)
                    r["peer"] = peer["peer"] if peer else None
                    r["peer_seconds"] = peer["seconds"] if peer else None
                    r["x_peer"] = peer["seconds"] / r["seconds"] if peer else None
                    rows.append(r)
                    bar.update(1)
                if opts.profile and t.row.backend == "cuda":
                    from mmad.bench import cuda_tools

                    variant = results[0]["backend"].partition(":")[2]
                    lines = cuda_tools.profile_ops(name, variant, opts.rows)
                    profiles[f"{name}:{variant}"] = lines
                    tqdm.write("\n".join(lines))
    return {"host": socket.gethostname().split(".")[0], "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "rows": opts.rows, "repeats": opts.repeats, "floor": ceilings, "peer": peers,
            "results": rows, "profile": profiles, "errors": opts.errors,
            "python": platform.python_version()}


def _release_device_memory(t: Target) -> None:
    """Hand the model's freed device blocks back to the driver: CuPy's pool would keep them from
    the PyTorch peer of the next model."""
    if t.row.backend == "cuda":
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()


class _NoBar:
    def __init__(self, **kw: Any) -> None:
        pass

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    @staticmethod
    def write(text: str) -> None:
        print(text, file=sys.stderr, flush=True)


def _cuda_reachable() -> bool:
    """Whether the GPU ceilings can be measured through CUDA (PyTorch or CuPy); otherwise the
    GPU backend runs somewhere the CPU's ceilings describe better than nothing (lavapipe, a CPU
    adapter)."""
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except ImportError:
        pass
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver: not reachable
        return False


def oracle_check(model: Any, x_in: np.ndarray, dev_in: Any, out_dtype: Any, rng: np.random.Generator) -> float:
    """Relative L2 error of ``forward(dev_in, out_dtype)`` against the float64 cpu oracle with the
    same parameters, on up to CHECK_ROWS random rows of ``x_in`` (the host copy of ``dev_in``)."""
    check = np.sort(rng.choice(x_in.shape[0], min(CHECK_ROWS, x_in.shape[0]), replace=False))
    return oracle_error(model, x_in[check], model.download(model.forward(dev_in, out_dtype=out_dtype))[check])


def measure(t: Target, spec: MLPSpec, spec_label: str, opts: Options) -> list[dict[str, Any]]:
    """Check, then time, one model on one backend: a row per mode."""
    backend_name = t.row.backend
    rng = np.random.default_rng(2026)
    rows = opts.rows
    started = time.perf_counter()
    # a variant chosen for this batch: the benchmark times the measured choice, not the quick
    # variant that serves while the dispatcher measures in the background
    model = settled(t.backend.compile(spec, variant=t.variant, batch_rows=rows))
    compile_s = time.perf_counter() - started
    label = f"{backend_name}:{model.variant}"
    try:
        x = rng.standard_normal((rows, spec.n_input_dims), dtype=np.float32)
        y = rng.standard_normal((rows, spec.n_output_dims), dtype=np.float32)
        io = opts.io[backend_name]
        half = io == "fp16"
        out_dtype = np.float16 if half else np.float32
        x_in = x.astype(np.float16) if half else x
        dev_in = _device_input(model, x_in)
        rel_err = oracle_check(model, x_in.astype(np.float32), dev_in, out_dtype, rng)
        if not rel_err <= FP16_TOLERANCE:
            raise CheckFailed(f"the {io} forward of {label} differs from the float64 oracle by {rel_err:.2e} "
                              f"(> {FP16_TOLERANCE}); not timed")
        base = {"backend": label, "target": t.arg, "device": t.row.device, "rows": rows, "repeats": opts.repeats,
                "rel_err_vs_float64": rel_err, "checked_io": io, "compile_s": compile_s,
                # the dispatcher's decision where the backend chose the variant by measurement
                # (compile_s then includes the measuring)
                "dispatch": model.dispatch.to_json() if model.dispatch is not None else None}
        out: list[dict[str, Any]] = []
        measure_mode = {"cuda": _measure_cuda, "vulkan": _measure_vulkan}.get(backend_name, _measure_host)
        for mode in opts.modes:
            extra = measure_mode(model, mode, x_in, dev_in, x, y, out_dtype, rng, opts)
            row = {"model": spec_label, **base, "mode": mode, "io": io if mode == "forward" else "fp32", **extra}
            row["samples_per_s"] = rows / row["seconds"]
            out.append(row)
        return out
    finally:
        model.close()


def _device_input(model: Any, x_in: np.ndarray) -> Any:
    """``x_in`` on the model's device in its own dtype (fp16 stays fp16 on cuda: the cast runs
    on the device, as the fp16 pipeline's producer would leave it)."""
    if x_in.dtype == np.float16 and model.backend == "cuda":
        return model.upload(x_in.astype(np.float32)).astype(np.float16)
    return model.upload(x_in)


def _input_sets(model: Any, x_in: np.ndarray, dev_in: Any, rng: np.random.Generator) -> list[Any]:
    """Several input sets, so that repeated calls do not time an input resident in a cache: the
    others are row permutations of ``x_in``, drawn as it was whatever that is (positions in
    [0, 1) for a grid: normal draws would land outside the grid's domain)."""
    extra = [_device_input(model, rng.permutation(x_in)) for _ in range(INPUT_SETS - 1)]
    return [dev_in, *extra]


def _train_losses_finite(model: Any, dx: Any, dy: Any, **kw: Any) -> None:
    losses = np.asarray(model.train_step(dx, dy, **kw))
    if not np.isfinite(losses).all():
        raise CheckFailed(f"training {model.backend}:{model.variant} produced non-finite losses {losses}; not timed")


def _measure_cuda(model, mode, x_in, dev_in, x, y, out_dtype, rng, opts) -> dict[str, Any]:
    """CUDA events around ``timing.GPU_CALLS_PER_SAMPLE`` back-to-back calls a sample."""
    calls = timing.GPU_CALLS_PER_SAMPLE
    if mode == "forward":
        xs = _input_sets(model, x_in, dev_in, rng)
        it = count()
        seconds = timing.median_seconds(
            timing.back_to_back(lambda: model.forward(xs[next(it) % len(xs)], out_dtype=out_dtype), calls),
            opts.repeats, clock="cupy", calls=calls)
        return {"seconds": seconds, "clock": "cuda events", "calls_per_sample": calls}
    dx, dy = model.upload(x), model.upload(y)
    _train_losses_finite(model, dx, dy)
    # one call of ``calls`` steps a sample: its losses come back once, as a job's chunk of steps
    # does (the PyTorch peer never reads its loss); a call a step would time the host's wait too
    seconds = timing.median_seconds(lambda: model.train_step(dx, dy, steps=calls), opts.repeats,
                                    clock="cupy", calls=calls)
    return {"seconds": seconds, "clock": "cuda events", "calls_per_sample": calls}


def _measure_host(model, mode, x_in, dev_in, x, y, out_dtype, rng, opts) -> dict[str, Any]:
    """cpu and wgpu: the host clock around ``calls`` calls and a synchronize."""
    calls = CALLS_PER_SAMPLE.get(model.backend, 1)
    info: dict[str, Any] = {}
    if model.backend == "wgpu":  # the kernels' plan, which decides most of their speed
        info["plan"] = {"rows_per_workgroup": model.plan.rows, "chunk_rows": model.plan.chunk_rows,
                        "fwd_stages": [(st.k, st.n, st.kc) for st in model.plan.fwd], "storage": model.storage}
    if mode == "forward":
        xs = _input_sets(model, x_in, dev_in, rng)
        it = count()

        def forward() -> None:
            for _ in range(calls):
                model.forward(xs[next(it) % len(xs)], out_dtype=out_dtype)

        seconds = timing.median_seconds(forward, opts.repeats, sync=model.synchronize, calls=calls)
        return {"seconds": seconds, "clock": "host", "calls_per_sample": calls, **info}
    dx, dy = model.upload(x), model.upload(y)
    _train_losses_finite(model, dx, dy, steps=min(2, calls))
    repeats = opts.repeats if calls == 1 else max(3, opts.repeats // 4)
    def fn() -> None:  # with calls > 1: one submission and one read-back of the losses
        model.train_step(dx, dy, steps=calls)
    seconds = timing.median_seconds(fn, repeats, sync=model.synchronize, calls=calls, warmup=1 if calls > 1 else 3)
    return {"seconds": seconds, "clock": "host", "calls_per_sample": calls, **info}


def _measure_vulkan(model, mode, x_in, dev_in, x, y, out_dtype, rng, opts) -> dict[str, Any]:
    """The recorded program re-submitted (``run`` waits for its fence: no synchronize needed);
    with ``--profile``, GPU timestamps in programs recorded again afterwards (timestamps may
    serialise dispatches, so the wall-clock figure is taken without them)."""
    reps = CALLS_PER_SAMPLE["vulkan"]
    result: dict[str, Any] = {"clock": "host", "calls_per_sample": reps,
                              "geometry": {"rows_per_tile": model.geo.rows_per_tile, "threads": model.geo.threads,
                                           "shape": model.geo.coopmat,
                                           **({"weight_gradient_tile": model.geo.coopmat2.wgrad}
                                              if model.geo.coopmat2 else {})}}
    if opts.profile:
        stats = model.pipeline_statistics()
        if any(stats.values()):
            result["pipeline_stats"] = stats
    if mode == "forward":
        out = model.forward(dev_in, out_dtype=out_dtype)
        program = model.forward_into(dev_in, out, run=False)
        result["seconds"] = timing.median_seconds(lambda: program.run(times=reps), opts.repeats, warmup=1, calls=reps)
        if opts.profile:
            model.set_gpu_timestamps(True)
            try:
                stamped = model.forward_into(dev_in, out, run=False)
                result["gpu_seconds"] = timing.median_seconds(
                    stamped.run, opts.repeats, clock="gpu", warmup=1,
                    gpu_seconds=lambda: sum(s for _, s in model.gpu_times("forward")))
            finally:
                model.set_gpu_timestamps(False)
        return result
    train_rows = opts.rows
    while True:
        try:
            tx = dev_in if train_rows == opts.rows and x_in.dtype == np.float32 else model.upload(x[:train_rows])
            dy = model.upload_target(y[:train_rows])
            _train_losses_finite(model, tx, dy, steps=1)
            seconds = timing.median_seconds(lambda tx=tx, dy=dy: model.train_step(tx, dy, steps=reps),
                                            max(3, opts.repeats // 4), warmup=1, calls=reps)
            break
        except InvalidInput as exc:  # a buffer over maxStorageBufferRange: halve the batch
            result["train_note"] = str(exc)
            train_rows //= 2
            if train_rows < 65536:
                raise
    scale = opts.rows / train_rows  # per-sample time scaled to the full batch: the table compares rates
    result.update(seconds=seconds * scale, train_rows=train_rows)
    if opts.profile:
        model.set_gpu_timestamps(True)
        try:
            result["gpu_seconds"] = scale * timing.median_seconds(
                lambda: model.train_step(tx, dy, steps=1), max(3, opts.repeats // 4), clock="gpu", warmup=1,
                gpu_seconds=lambda: sum(s for _, s in model.gpu_times("train")))
            split: dict[str, float] = {}
            for kernel, s in model.gpu_times("train"):  # the last step's dispatches
                split[kernel] = split.get(kernel, 0.0) + s * scale
            result["gpu_split_s"] = split
        finally:
            model.set_gpu_timestamps(False)
    return result


def time_torch_peer(name: str, opts: Options, kind: str) -> list[dict[str, Any]]:
    """The PyTorch peer of one model: a row per mode (seconds per call)."""
    import torch

    from mmad.bench.torch_peer import forward_fn, torch_mlp, train_step_fn

    spec = bench_spec(name)
    on_gpu = kind == "gpu" and torch.cuda.is_available()
    if kind == "gpu" and not on_gpu:
        print("mmad bench: PyTorch sees no CUDA device; the peer of the GPU backends runs on the CPU (float32)",
              file=sys.stderr)
    device = "cuda" if on_gpu else "cpu"
    clock = "torch" if on_gpu else "host"
    net = torch_mlp(spec, device)
    gen = torch.Generator(device=device).manual_seed(7)
    x = torch.randn(opts.rows, spec.n_input_dims, device=device, generator=gen)
    y = torch.randn(opts.rows, spec.n_output_dims, device=device, generator=gen)
    label = f"torch-{torch.__version__}-{device} ({'fp16' if on_gpu else 'float32'})"
    out = []
    calls = timing.GPU_CALLS_PER_SAMPLE if on_gpu else 1  # as the cuda backend's calls are timed
    for mode in opts.modes:
        fn = forward_fn(net, x) if mode == "forward" else train_step_fn(net, x, y)
        seconds = timing.median_seconds(timing.back_to_back(fn, calls), opts.repeats, clock=clock, calls=calls)
        out.append({"model": name, "peer": label, "mode": mode, "rows": opts.rows, "seconds": seconds,
                    "samples_per_s": opts.rows / seconds})
    del net, x, y
    if on_gpu:
        torch.cuda.empty_cache()
    return out


# -- reporting ----------------------------------------------------------------------------------
def markdown_table(doc: dict[str, Any]) -> str:
    def fmt(value: Any, pattern: str) -> str:
        return pattern.format(value) if isinstance(value, (int, float)) else "–"

    gpu = any("gpu_seconds" in r for r in doc["results"])
    head = "| model | backend | mode | io | rows | M samples/s | × peer | % floor | rel. err |" + (" GPU ms |" if gpu else "")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in doc["results"]:
        line = (f"| {r['model']} | {r['backend']} | {r['mode']} | {r['io']} | {r['rows']} | "
                f"{r['samples_per_s'] / 1e6:.2f} | {fmt(r['x_peer'], '{:.2f}×')} | {r['pct_floor']:.1f}% | "
                f"{r['rel_err_vs_float64']:.1e} |")
        if gpu:
            line += f" {fmt(r.get('gpu_seconds', None) and 1e3 * r['gpu_seconds'], '{:.3f}')} |"
        lines.append(line)
    lines += dispatch_lines(doc)
    for e in doc["errors"]:
        lines.append(f"\nNot timed: {e}")
    peers = sorted({p["peer"] for p in doc["peer"]})
    lines.append(f"\nPeer: {', '.join(peers) if peers else 'none'}; median of {doc['repeats']}.")
    for kind, f in doc["floor"].items():
        lines.append(f"Floor ({kind}): copy {f['copy_bytes_per_s'] / 1e9:.1f} GB/s, matmul "
                     f"{f['gemm_flops_per_s'] / 1e12:.2f} TFLOP/s ({f['gemm_type']}, {f['device']}), measured in the same run.")
    return "\n".join(lines)


def dispatch_lines(doc: dict[str, Any]) -> list[str]:
    """One line per model whose variant the backend chose by measurement: the choice and each
    variant's figures from the dispatcher's own short run (or why it was skipped)."""
    lines, seen = [], set()
    for r in doc["results"]:
        d = r.get("dispatch")
        if d is None or (r["model"], r["target"]) in seen:  # one line for a model's forward and train rows
            continue
        seen.add((r["model"], r["target"]))
        parts = [f"{v['variant']} skipped ({v['reason']})" if v["status"] == "skipped" else
                 f"{v['variant']} {v['forward_msps']:.0f}/{v['train_msps']:.0f}, score {v['score']:.2f}"
                 for v in d["variants"]]
        lines.append(f"Dispatcher: {r['model']} on {r['target']} → {d['variant']}"
                     f"{' (cached)' if d['from_cache'] else ''}; M samples/s forward/train at {d['rows']} rows: "
                     + "; ".join(parts))
    return lines


def dispatch_report(opts: Options, doc: dict[str, Any]) -> dict[str, Any]:
    """``--dispatch``'s document: per model the chosen variant, its forward and training rates at
    ``rows`` (M samples/s), the same run's PyTorch rates and the dispatcher's decision."""
    target = next(t.arg for t in opts.targets if t.variant is None)
    models: dict[str, dict[str, Any]] = {}
    for r in doc["results"]:
        if r["target"] != target:
            continue
        m = models.setdefault(r["model"], {"variant": r["backend"].partition(":")[2],
                                           "rel_err_vs_float64": r["rel_err_vs_float64"],
                                           "dispatch": r["dispatch"]})
        m[f"{r['mode']}_msps"] = r["samples_per_s"] / 1e6
        m[f"torch_{r['mode']}_msps"] = r["rows"] / r["peer_seconds"] / 1e6 if r["peer_seconds"] else None
    io = opts.io[target.partition(":")[0]]
    mode = next(k for k, v in MODES.items() if v == opts.modes)
    command = (f"mmad bench --backend {target} --models {','.join(opts.models)} --rows {opts.rows} --io {io} "
               f"--mode {mode} --peer {opts.peer} --repeats {opts.repeats} --dispatch {opts.dispatch}")
    return {"command": command, "host": doc["host"], "when": doc["when"], "backend": target, "rows": doc["rows"],
            "io": io, "repeats": doc["repeats"],
            "peer": sorted({p["peer"] for p in doc["peer"]}), "models": models, "errors": doc["errors"]}


def write_outputs(opts: Options, doc: dict[str, Any]) -> None:
    if opts.dispatch:
        opts.dispatch.parent.mkdir(parents=True, exist_ok=True)
        opts.dispatch.write_text(json.dumps(dispatch_report(opts, doc), indent=2))
    write_report(doc, markdown_table(doc), opts.json, opts.markdown)


def write_report(doc: dict[str, Any], table: str, json_path: Path | None, markdown_path: Path | None) -> None:
    """``doc`` as JSON and ``table`` as markdown under a heading of host and time, where asked
    for; the table printed either way."""
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=2, default=str))
    if markdown_path:
        markdown_path.parent.mkdir(parents=True, exist_ok=True)
        markdown_path.write_text(f"# {doc['host']}, {doc['when']}\n\n{table}\n")
    print(table, flush=True)
