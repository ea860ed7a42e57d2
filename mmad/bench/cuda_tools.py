"""CUDA-side inspection for `mmad bench` on the GPU host: the SASS instruction mix of the mma
kernels (``--sass``), what nvmath-python's cuBLASLt epilogs do here (``--nvmath-check``), one
model's forward or training as a workload for Nsight Compute or compute-sanitizer
(``--run-forward``, ``--run-train``), and where a variant's time
goes op by op (``--profile`` on cuda). Imports CuPy and nvmath only when a function runs.
"""

from __future__ import annotations

import collections
import json
import re
import shutil
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from mmad.backends import timing
from mmad.spec import bench_spec


def cuda_tool(name: str) -> str:
    """A CUDA toolkit program: on PATH, else where the toolkit installs it."""
    return shutil.which(name) or f"/usr/local/cuda/bin/{name}"


def complete_elf(image: bytes) -> bytes:
    """The cubin padded with zeros to the size its own ELF header declares.

    The cubins CuPy's NVRTC path returned were one byte shorter than their header declares (the
    last byte of the program header table): the driver loads them all the same, but
    cuobjdump refuses them ("does not contain device code").
    """
    phoff, shoff = struct.unpack_from("<QQ", image, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 0x36)
    size = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return image + bytes(max(0, size - len(image)))


def sass_mix(out_dir: Path) -> dict[str, dict[str, int]]:
    """Compile S/M/L, dump each cubin's SASS with cuobjdump, count the instructions that matter."""
    import tempfile

    from mmad.backends.cache import KernelCache
    from mmad.backends.cuda import CudaBackend

    cache_dir = Path(tempfile.mkdtemp(prefix="mmad-sass-"))
    cache = KernelCache(cache_dir)
    backend = CudaBackend()
    mix: dict[str, dict[str, int]] = {}
    for name in ("S", "M", "L"):
        before = set(cache_dir.glob("*/*.bin"))
        backend.compile(bench_spec(name), variant="mma", cache=cache)
        for entry in set(cache_dir.glob("*/*.bin")) - before:
            payload = entry.read_bytes().partition(b"\n")[2]
            cubin = out_dir / f"mma_{name}.cubin"
            if payload[:4] == b"\x7fELF":
                cubin.write_bytes(complete_elf(payload))
                kind = "cubin"
            else:  # CuPy handed back PTX: assemble it the way the driver would
                ptx = out_dir / f"mma_{name}.ptx"
                ptx.write_bytes(payload)
                done = subprocess.run([cuda_tool("ptxas"), "-arch=sm_90", str(ptx), "-o", str(cubin)],
                                      capture_output=True, text=True)
                kind = f"ptx (ptxas rc {done.returncode} {done.stderr.strip()[:200]})"
            dump = subprocess.run([cuda_tool("cuobjdump"), "--dump-sass", str(cubin)], capture_output=True, text=True)
            sass = dump.stdout
            (out_dir / f"mma_{name}.sass.txt").write_text(sass + dump.stderr)
            per_kernel: dict[str, int] = {"binary: " + kind: 1}
            if not sass:
                per_kernel["cuobjdump error: " + dump.stderr.strip()[:200]] = dump.returncode
            current = "?"
            for line in sass.splitlines():
                m = re.search(r"Function : (\w+)", line)
                if m:
                    current = m.group(1)
                for op in ("HMMA", "LDSM", "LDS", "LDG", "STG", "LDL", "STL", "HGMMA"):
                    if re.search(rf"\b{op}\b", line):
                        key = f"{current}:{op}"
                        per_kernel[key] = per_kernel.get(key, 0) + 1
            mix[name] = per_kernel
    return mix


def nvmath_check() -> list[str]:
    """What nvmath's cuBLASLt epilogs accept and compute here (a probe for the cublaslt model)."""
    import cupy as cp

    lines = []
    try:
        import nvmath
        from nvmath.linalg.advanced import Matmul, MatmulEpilog, matmul
    except Exception as exc:
        return [f"nvmath import failed: {type(exc).__name__}: {exc}"]
    lines.append(f"nvmath {nvmath.__version__}")
    rng = cp.random.default_rng(0)
    m, k, n = 1000, 64, 48
    a = rng.standard_normal((m, k), dtype=cp.float32).astype(cp.float16)
    w = rng.standard_normal((n, k), dtype=cp.float32).astype(cp.float16)
    bias16 = rng.standard_normal(n, dtype=cp.float32).astype(cp.float16)
    bias32 = bias16.astype(cp.float32)
    ref = a.astype(cp.float32) @ w.astype(cp.float32).T
    attempts = {
        "plain a@w.T": lambda: matmul(a, w.T),
        "RELU_BIAS bias16 (n,)": lambda: matmul(a, w.T, epilog=MatmulEpilog.RELU_BIAS, epilog_inputs={"bias": bias16}),
        "RELU_BIAS bias32 (n,)": lambda: matmul(a, w.T, epilog=MatmulEpilog.RELU_BIAS, epilog_inputs={"bias": bias32}),
        "RELU_AUX_BIAS bias16": lambda: matmul(a, w.T, epilog=MatmulEpilog.RELU_AUX_BIAS, epilog_inputs={"bias": bias16}),
        "c fp32 beta=1": lambda: matmul(a, w.T, c=cp.zeros((m, n), cp.float32), beta=1.0),
        "BGRADB (w.T @ a) ": lambda: matmul(a.T, rng.standard_normal((m, n), dtype=cp.float32).astype(cp.float16), epilog=MatmulEpilog.BGRADB),
        "DRELU_BGRAD": lambda: matmul(a, w.T, epilog=MatmulEpilog.DRELU_BGRAD,
                                      epilog_inputs={"relu_aux": matmul(a, w.T, epilog=MatmulEpilog.RELU_AUX_BIAS, epilog_inputs={"bias": bias16})[1]["relu_aux"]}),
    }
    for label, fn in attempts.items():
        try:
            res = fn()
            if isinstance(res, tuple):
                d, aux = res
                aux_desc = {key: (getattr(v, "shape", None), str(getattr(v, "dtype", type(v)))) for key, v in aux.items()}
            else:
                d, aux_desc = res, {}
            err = ""
            if label.startswith("plain") or label.startswith("c fp32"):
                err = f" relerr {float(cp.linalg.norm(d.astype(cp.float32) - ref) / cp.linalg.norm(ref)):.2e}"
            if label.startswith("RELU_BIAS"):
                r2 = cp.maximum(ref + bias32, 0)
                err = f" relerr {float(cp.linalg.norm(d.astype(cp.float32) - r2) / cp.linalg.norm(r2)):.2e}"
            lines.append(f"OK   {label}: out {d.shape} {d.dtype} aux {aux_desc}{err}")
        except Exception as exc:
            lines.append(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:300]}")
    try:
        mm = Matmul(a, w.T)
        mm.plan(epilog=MatmulEpilog.RELU_BIAS, epilog_inputs={"bias": bias16})
        mm.execute()
        t = timing.median_seconds(mm.execute, 10, clock="cupy")
        lines.append(f"OK   stateful Matmul plan/execute; reset_operands: {hasattr(mm, 'reset_operands')}; {t * 1e6:.1f} us")
        mm.free()
    except Exception as exc:
        lines.append(f"FAIL stateful Matmul: {type(exc).__name__}: {str(exc)[:300]}")
    lines += output_layer_options()
    return lines


def output_layer_options(rows: int = 1 << 20, width: int = 256) -> list[str]:
    """The cublaslt model's output layer (W @ h^T + b, W fp16 (width, width), h^T F-order) three
    ways, timed (median of 10) and checked against fp32: an fp32 C broadcast along N (beta 1),
    an fp32 result type with the BIAS epilog, and fp16 out with the BIAS epilog."""
    import cupy as cp
    from nvmath import CudaDataType
    from nvmath.linalg.advanced import Matmul, MatmulEpilog, MatmulOptions

    rng = cp.random.default_rng(1)
    w = (rng.standard_normal((width, width), dtype=cp.float32) / 16).astype(cp.float16)
    h = rng.standard_normal((rows, width), dtype=cp.float32).astype(cp.float16).T  # F order
    b32 = rng.standard_normal(width, dtype=cp.float32)
    ref = w.astype(cp.float32) @ h.astype(cp.float32) + b32[:, None]
    options = {
        "c fp32 (width,1) beta=1": (lambda: Matmul(w, h, c=b32.reshape(width, 1), beta=1.0), None, None),
        "result_type fp32 + BIAS fp32": (lambda: Matmul(w, h, options=MatmulOptions(result_type=CudaDataType.CUDA_R_32F)),
                                         MatmulEpilog.BIAS, b32),
        "fp16 out + BIAS fp16": (lambda: Matmul(w, h), MatmulEpilog.BIAS, b32.astype(cp.float16)),
    }
    lines = [f"output layer, {rows} rows x {width}:"]
    for label, (make, epilog, bias) in options.items():
        try:
            mm = make()
            mm.plan(epilog=epilog, epilog_inputs=None if bias is None else {"bias": bias})
            d = mm.execute()
            d = d[0] if isinstance(d, tuple) else d
            err = float(cp.linalg.norm(d.astype(cp.float32) - ref) / cp.linalg.norm(ref))
            t = timing.median_seconds(mm.execute, 10, clock="cupy")
            gbs = (h.nbytes + d.nbytes) / t / 1e9
            lines.append(f"  OK   {label}: {1e3 * t:.3f} ms, out {d.dtype} {'F' if d.flags.f_contiguous else 'C'}, "
                         f"rel. err {err:.1e}, {gbs:.0f} GB/s of A + D")
            mm.free()
        except Exception as exc:
            lines.append(f"  FAIL {label}: {type(exc).__name__}: {str(exc)[:300]}")
    return lines


def run_forward(name: str, variant: str, rows: int, io: str = "fp16", times: int = 4) -> str:
    """Compile one model and run its forward ``times`` times on fresh random device rows of
    ``io`` in and out: the workload for an outside profiler (ncu picks a launch out of these)
    or compute-sanitizer."""
    import cupy as cp

    from mmad.backends.cuda import CudaBackend

    spec = bench_spec(name)
    model = CudaBackend().compile(spec, variant=variant)
    dtype = np.float16 if io == "fp16" else np.float32
    x = cp.asarray(np.random.default_rng(3).standard_normal((rows, spec.n_input_dims), dtype=np.float32)).astype(dtype)
    for _ in range(times):
        out = model.forward(x, out_dtype=dtype)
    model.synchronize()
    finite = bool(cp.isfinite(out).all())
    plan = getattr(model, "wg", None)
    stages = ("" if plan is None else f", wgmma {plan.half_warpgroups} warpgroups x {plan.half_stages} ring tiles"
              if io == "fp16" and plan.half_io else f", wgmma input stages {plan.x_stages}")
    model.close()
    return (f"{name}:{model.variant} {io} forward x{times} at {rows} rows{stages}, "
            f"output {'finite' if finite else 'NOT FINITE'}")


def run_train(name: str, variant: str, rows: int, steps: int = 2) -> str:
    """Compile one model and run ``steps`` training steps on fresh random device rows, then as
    many over a device dataset of those rows (the epoch path's kernels, batch ``rows`` // 2): the
    workload for compute-sanitizer or an outside profiler."""
    import cupy as cp

    from mmad.backends.contract import EpochPosition
    from mmad.backends.cuda import CudaBackend

    spec = bench_spec(name)
    model = CudaBackend().compile(spec, variant=variant)
    rng = np.random.default_rng(3)
    x = rng.uniform(-1, 1, (rows, spec.n_input_dims)).astype(np.float32)
    y = rng.uniform(-1, 1, (rows, spec.n_output_dims)).astype(np.float32)
    losses = list(model.train_step(cp.asarray(x), cp.asarray(y), steps))
    data = model.put_dataset([(x, y)], rows, np.float32, np.float32)
    losses += list(model.train_epochs(data, max(1, rows // 2), steps, EpochPosition(7)))
    model.close()
    finite = bool(np.isfinite(losses).all())
    return (f"{name}:{model.variant} {2 * steps} training steps at {rows} rows (half over a device dataset), "
            f"losses {'finite' if finite else 'NOT FINITE'}: {', '.join(f'{v:.4f}' for v in losses)}")


def profile_ops(name: str, variant: str, rows: int) -> list[str]:
    """Where a variant's time goes: CUDA events around every kernel launch (and, for cublaslt,
    every matmul) of one forward and one training step after a warm-up."""
    import cupy as cp

    from mmad.backends.cuda import CudaBackend

    model = CudaBackend().compile(bench_spec(name), variant=variant)
    rng = np.random.default_rng(0)
    x = cp.asarray(rng.standard_normal((rows, model.spec.n_input_dims), dtype=np.float32))
    y = cp.asarray(rng.standard_normal((rows, model.spec.n_output_dims), dtype=np.float32))
    model.forward(x), model.train_step(x, y)
    cp.cuda.Device().synchronize()
    spans: list[tuple[str, Any, Any]] = []

    def timed(label, fn, *a, **kw):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        host = time.perf_counter()
        start.record()
        result = fn(*a, **kw)
        end.record()
        spans.append((f"{label} [host {1e3 * (time.perf_counter() - host):.3f} ms]", start, end))
        return result

    launch = model._launch
    model._launch = lambda kernel, *a, **kw: timed(f"kernel {kernel}", launch, kernel, *a, **kw)
    if hasattr(model, "_launch_wgmma"):  # the wgmma forward's kernels go through their own module
        launch_wgmma = model._launch_wgmma
        model._launch_wgmma = lambda kernel, *a, **kw: timed(f"kernel {kernel}", launch_wgmma, kernel, *a, **kw)
    if hasattr(model, "_mm_aux"):  # every cublaslt matmul goes through it
        mm = model._mm_aux

        def mm_timed(key, a, b, *args, **kw):
            out, aux = timed(f"matmul {key[0]} {key[1]} {a.shape}x{b.shape}", mm, key, a, b, *args, **kw)
            flags = "C" if out.flags.c_contiguous else "F" if out.flags.f_contiguous else "strided"
            spans[-1] = (spans[-1][0] + f" -> {out.shape} {out.dtype} {flags}{' +' if aux else ''}"
                         f"{' '.join(sorted(aux))}", *spans[-1][1:])
            return out, aux

        model._mm_aux = mm_timed
    lines = []
    for what, call in (("forward", lambda: model.forward(x)), ("train_step", lambda: model.train_step(x, y))):
        spans.clear()
        wall = time.perf_counter()
        timed(what, call)
        cp.cuda.Device().synchronize()
        wall = time.perf_counter() - wall
        total = cp.cuda.get_elapsed_time(*spans[-1][1:])
        inside = sum(cp.cuda.get_elapsed_time(s, e) for _, s, e in spans[:-1])
        lines.append(f"{name} {variant} {what} at {rows} rows: {total:.3f} ms on the GPU ({inside:.3f} ms in "
                     f"the ops listed), {1e3 * wall:.2f} ms wall")
        inner = spans[:-1]
        # GPU time between one op's end and the next op's start: the GPU waiting for the host, or
        # work no wrapper saw (CuPy casts and reductions)
        gaps = [cp.cuda.get_elapsed_time(spans[-1][1], inner[0][1])] if inner else []
        gaps += [cp.cuda.get_elapsed_time(a[2], b[1]) for a, b in zip(inner, inner[1:])]
        lines += [f"  {cp.cuda.get_elapsed_time(s, e):8.3f} ms  {label}  (gap before: {gap:.3f} ms)"
                  for (label, s, e), gap in zip(inner, gaps)]
    if variant == "cublaslt":
        lines += cublaslt_layouts(model.layers[1][0], model.layers[1][1], rows)
    model.close()
    return lines


def cublaslt_layouts(k: int, n: int, rows: int) -> list[str]:
    """One hidden layer's matmul (RELU_BIAS epilog) with the activations in either memory order,
    against CuPy's own cuBLAS call: which operand layout cuBLASLt runs fast."""
    import cupy as cp
    from nvmath.linalg.advanced import Matmul, MatmulEpilog

    rng = cp.random.default_rng(0)
    w = rng.standard_normal((n, k), dtype=cp.float32).astype(cp.float16)
    bias = rng.standard_normal(n, dtype=cp.float32).astype(cp.float16)
    h_rows = rng.standard_normal((rows, k), dtype=cp.float32).astype(cp.float16)  # [rows][features]
    cases = {"b = h^T stored [features][rows]": cp.ascontiguousarray(h_rows.T),
             "b = h^T as a view of [rows][features]": h_rows.T}
    lines = [f"one layer {n}x{k} over {rows} rows, fp16, RELU_BIAS:"]
    for label, b in cases.items():
        mm = Matmul(w, b)
        mm.plan(epilog=MatmulEpilog.RELU_BIAS, epilog_inputs={"bias": bias})
        out = mm.execute()
        seconds = timing.median_seconds(mm.execute, 10, clock="cupy")
        flags = "C" if out.flags.c_contiguous else "F" if out.flags.f_contiguous else "strided"
        lines.append(f"  {1e3 * seconds:7.3f} ms  {label}: result {out.shape} {flags}-contiguous")
        mm.free()
    seconds = timing.median_seconds(lambda: cp.matmul(h_rows, w.T), 10, clock="cupy")
    lines.append(f"  {1e3 * seconds:7.3f} ms  cupy.matmul([rows][features], W^T) (no epilog)")
    return lines


def wgmma_sass(out_dir: Path) -> list[str]:
    """The wgmma forwards (fp32 and fp16 I/O) of S/M/L/W and the wgmma training kernels of S/M/L
    compiled with nvcc as the backend does, their SASS dumped: per model and kernel the plan
    (weights resident, warpgroups, input staging, shared memory) and the count of each
    instruction that matters, against the HGMMA count the source implies."""
    from mmad.backends.cuda.toolchain import nvcc_compile
    from mmad.backends.cuda.wgmma import WGMMA_NVCC_OPTIONS, WgmmaPlan

    lines = []
    keys = ("HGMMA", "HMMA", "LDL", "STL", "WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR", "BAR", "LDGSTS", "STS", "LDS", "STG")

    def counted(plan: WgmmaPlan, tag: str) -> tuple[dict[str, collections.Counter[str]], str]:
        cubin = out_dir / f"{tag}.cubin"
        cubin.write_bytes(nvcc_compile(plan.source, WGMMA_NVCC_OPTIONS, tag))
        dump = subprocess.run([cuda_tool("cuobjdump"), "--dump-sass", str(cubin)], capture_output=True, text=True)
        (out_dir / f"{tag}.sass.txt").write_text(dump.stdout + dump.stderr)
        ops: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        fn = "?"
        for line in dump.stdout.splitlines():
            m = re.search(r"Function : (\w+)", line)
            if m:
                fn = m.group(1)
            m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
            if m:
                op = m.group(1)
                ops[fn][op if op.startswith("WARPGROUP") else op.split(".")[0]] += 1
        return ops, "" if dump.stdout else f" cuobjdump rc={dump.returncode}: {dump.stderr.strip()[:200]}"

    def report(name: str, kernel: str, how: str, expected: int, counts: collections.Counter[str], note: str) -> str:
        return (f"{name} {kernel} {how} HGMMA expected={expected} " + " ".join(f"{k}={counts[k]}" for k in keys)
                + f" total={sum(counts.values())}{note}")

    for name in "SMLW":
        plan = WgmmaPlan(bench_spec(name))
        ops, note = counted(plan, f"wgmma_{name}")
        # one HGMMA per wgmma in the source: layer 0, the (not unrolled) hidden loop, the output layer
        forward = plan.kin_p // 16 + (plan.wp // 16 if plan.n_hidden > 1 else 0) + plan.wp // 16
        kernels = [("wgmma_forward", f"warpgroups={plan.warpgroups} staged={plan.input_staged} smem={plan.smem_bytes}")]
        if plan.half_io:
            kernels.append(("wgmma_forward_half", f"warpgroups={plan.half_warpgroups} ring={plan.half_stages} "
                                                  f"smem={plan.smem_half_bytes}"))
        for kernel, how in kernels:
            lines.append(report(name, kernel, f"resident={plan.w_resident} {how}", forward, ops[kernel], note))
        train = WgmmaPlan(bench_spec(name), training=True)
        if not train.trains:
            lines.append(f"{name} training: {train.why_not}")
            continue
        ops, note = counted(train, f"wgmma_train_{name}")
        # the forward's, then the backward's: the output layer, the (not unrolled) hidden loop
        backward = train.nout_p // 16 + (train.wp // 16 if train.n_hidden > 1 else 0)
        how = f"warpgroups={train.train_warpgroups} blocks/SM={train.train_min_blocks} smem={train.smem_train_bytes}"
        for kernel in ("wgmma_train_fwd_bwd", "wgmma_train_fwd_bwd_rows"):
            lines.append(report(name, kernel, how, forward + backward, ops[kernel], note))
        for kernel in ("wgmma_wgrad_in", "wgmma_wgrad_hid"):  # 4 k16 steps a 64-row stage
            lines.append(report(name, kernel, f"stages={train.wgrad_stages}", 4, ops[kernel], note))
    return lines


def sass_report(out_dir: Path, variant: str = "mma") -> list[str]:
    """The SASS check of ``variant`` (mma: ``sass_mix``, plus ``sass.json``; wgmma: ``wgmma_sass``)
    into ``out_dir``, one summary line per model (the optimizer kernel's counts left out: it has
    no matrix instructions)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if variant == "wgmma":
        return wgmma_sass(out_dir)
    if variant != "mma":
        raise ValueError(f"the SASS check covers the mma and wgmma variants; got {variant!r}")
    mix = sass_mix(out_dir)
    (out_dir / "sass.json").write_text(json.dumps(mix, indent=1))
    return [f"{model} " + " ".join(f"{k}={v}" for k, v in sorted(counts.items()) if not k.startswith("mlp_optimize"))
            for model, counts in mix.items()]
