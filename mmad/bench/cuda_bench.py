"""CUDA-side timings and checks for the cuda backend (docs/benchmarks.md, "Method"), in one process.

``python -m mmad.bench.cuda_bench --out DIR`` measures, in the same run: the hardware ceilings
(device-to-device copy, cuBLAS fp16 GEMM through PyTorch), the PyTorch fp16 peers (CUDA-graph
forward; autocast + fused Adam training step), and mmad's cuda models S/M/L/W at batch 2^20:
forward and one full training step (forward, L2 loss, backward, Adam), each the median of
``--repeats`` timed runs (CUDA events) after warm-up, on random data, after checking the output
against the float64 cpu oracle on 4096 rows. Also ``--sass``: the instruction mix of the compiled
cubins (cuobjdump), ``--nvmath-check``: what nvmath-python's cuBLASLt epilogs do here, and
``--serve-check``: the daemon on the cuda backend end to end (client -> HTTP -> kernels).
"""

from __future__ import annotations

import argparse
import json
import re
import struct
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mmad.bench.torch_peer import forward_fn, torch_mlp, train_step_fn
from mmad.spec import bench_spec


def cuda_median_s(fn: Callable[[], Any], repeats: int, warmup: int = 3) -> float:
    import cupy as cp

    for _ in range(warmup):
        fn()
    cp.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(repeats):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return statistics.median(times)


def measure_ceilings() -> dict[str, float]:
    import torch

    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    copy = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); b.copy_(a); e.record(); e.synchronize()
        copy.append(s.elapsed_time(e) / 1e3)
    n = 8192
    x = torch.randn(n, n, dtype=torch.float16, device="cuda")
    y = torch.randn(n, n, dtype=torch.float16, device="cuda")
    gemm = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); x @ y; e.record(); e.synchronize()
        gemm.append(s.elapsed_time(e) / 1e3)
    return {"copy_bytes_per_s": 2 * a.numel() / statistics.median(copy[2:]),
            "gemm_flops_per_s": 2 * n ** 3 / statistics.median(gemm[2:])}


def floor_s(name: str, batch: int, ceilings: dict[str, float], training: bool, io_bytes: int = 4) -> float:
    """max(bytes / copy rate, FLOPs / GEMM rate); bytes of the inputs/outputs the kernels move
    (fp32: ``io_bytes`` 4; the fp16-I/O forward: 2)."""
    spec = bench_spec(name)
    per_row = io_bytes * (spec.n_input_dims + spec.n_output_dims * (2 if training else 1))
    flops = spec.flops_per_sample() * (3 if training else 1) * batch
    return max(per_row * batch / ceilings["copy_bytes_per_s"], flops / ceilings["gemm_flops_per_s"])


def torch_peers(names: list[str], batch: int, repeats: int) -> dict[str, dict[str, float]]:
    import torch

    out = {}
    for name in names:
        spec = bench_spec(name)
        net = torch_mlp(spec, "cuda")
        x = torch.randn(batch, spec.n_input_dims, device="cuda")
        y = torch.randn(batch, spec.n_output_dims, device="cuda")
        out[name] = {"forward_s": _torch_median(forward_fn(net, x), repeats),
                     "train_s": _torch_median(train_step_fn(net, x, y), repeats)}
        del net, x, y
        torch.cuda.empty_cache()
    return out


def _torch_median(fn: Callable[[], Any], repeats: int) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times)


def bench_mmad(names: list[str], batch: int, repeats: int, variant: str | None) -> dict[str, dict[str, Any]]:
    import cupy as cp

    from mmad.backends.cpu import CpuBackend
    from mmad.backends.cuda import CudaBackend

    backend = CudaBackend()
    rng = np.random.default_rng(2026)
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        spec = bench_spec(name)
        entry: dict[str, Any] = {}
        try:
            model = backend.compile(spec, variant=variant)
        except Exception as exc:  # reported in the table, not hidden
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            continue
        entry["variant"] = model.variant
        x = rng.standard_normal((batch, spec.n_input_dims), dtype=np.float32)
        y = rng.standard_normal((batch, spec.n_output_dims), dtype=np.float32)
        oracle = CpuBackend("float64").compile(spec)
        oracle.set_params(model.get_params())
        check = np.sort(rng.choice(batch, 4096, replace=False))
        dx, dy = model.upload(x), model.upload(y)
        out = model.download(model.forward(dx))[check]
        ref = oracle.forward(x[check])
        entry["rel_err"] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref)) if np.isfinite(out).all() else float("inf")
        # several input sets so repeated runs do not time a cache-resident input
        xs = [dx] + [model.upload(rng.standard_normal((batch, spec.n_input_dims), dtype=np.float32)) for _ in range(2)]
        it = iter(range(10 ** 9))
        entry["forward_s"] = cuda_median_s(lambda: model.forward(xs[next(it) % 3]), repeats)
        # fp16 in, fp16 out: the I/O of the PyTorch peer's half forward (its input is x.half())
        xs16 = [a.astype(cp.float16) for a in xs]
        x16 = cp.asnumpy(xs16[0][cp.asarray(check)]).astype(np.float32)
        out16 = model.download(model.forward(xs16[0], out_dtype=np.float16))[check].astype(np.float64)
        ref16 = oracle.forward(x16)
        entry["rel_err_half_io"] = (float(np.linalg.norm(out16 - ref16) / np.linalg.norm(ref16))
                                    if np.isfinite(out16).all() else float("inf"))
        entry["forward_half_io_s"] = cuda_median_s(lambda: model.forward(xs16[next(it) % 3], out_dtype=np.float16),
                                                   repeats)
        entry["train_s"] = cuda_median_s(lambda: model.train_step(dx, dy), repeats)
        results[name] = entry
        model.close()
        cp.get_default_memory_pool().free_all_blocks()
    return results


def sweep_mma(names: list[str], batch: int, repeats: int, settings: list[str]) -> list[str]:
    """The mma kernels' forward and training time under each tuning setting ("WARPS/MT_TRAIN",
    e.g. "8/1"), oracle-checked on 4096 rows each: which geometry to make the default."""
    import os

    import cupy as cp

    from mmad.backends import cuda
    from mmad.backends.cpu import CpuBackend

    rng = np.random.default_rng(7)
    lines = [f"mma sweep at {batch} rows (median of {repeats}, CUDA events): model warps/mt_train "
             "-> forward ms, train_step ms, rel. err, train regs, blocks/SM"]
    for name in names:
        spec = bench_spec(name)
        x = rng.standard_normal((batch, spec.n_input_dims), dtype=np.float32)
        y = rng.standard_normal((batch, spec.n_output_dims), dtype=np.float32)
        check = np.sort(rng.choice(batch, 4096, replace=False))
        for setting in settings:
            warps, _, mt = setting.partition("/")
            os.environ[cuda.MMA_WARPS_ENV], os.environ[cuda.MMA_MT_TRAIN_ENV] = warps, mt or "1"
            try:
                model = cuda.CudaBackend().compile(spec, variant="mma")
                oracle = CpuBackend("float64").compile(spec)
                oracle.set_params(model.get_params())
                dx, dy = model.upload(x), model.upload(y)
                out = model.download(model.forward(dx))[check]
                err = float(np.linalg.norm(out - oracle.forward(x[check])) / np.linalg.norm(oracle.forward(x[check])))
                fwd = cuda_median_s(lambda: model.forward(dx), repeats)
                train = cuda_median_s(lambda: model.train_step(dx, dy), repeats)
                regs = model._module.kernel("mlp_train_fwd_bwd").num_regs
                lines.append(f"  {name} {setting:>5} -> {1e3 * fwd:7.3f} {1e3 * train:7.3f} {err:.1e} "
                             f"{regs} {model.grid_train // model.info['sm_count']}")
                model.close()
            except Exception as exc:  # one setting failing is a finding, not the end of the sweep
                lines.append(f"  {name} {setting:>5} -> {type(exc).__name__}: {str(exc)[:160]}")
            finally:
                del os.environ[cuda.MMA_WARPS_ENV], os.environ[cuda.MMA_MT_TRAIN_ENV]
                cp.get_default_memory_pool().free_all_blocks()
    return lines


def complete_elf(image: bytes) -> bytes:
    """The cubin padded with zeros to the size its own ELF header declares.

    The cubins CuPy's NVRTC path returned were one byte shorter than their header declares (the
    last byte of the program header table; run 6): the driver loads them all the same, but
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
                done = subprocess.run(["ptxas", "-arch=sm_90", str(ptx), "-o", str(cubin)],
                                      capture_output=True, text=True)
                kind = f"ptx (ptxas rc {done.returncode} {done.stderr.strip()[:200]})"
            dump = subprocess.run(["cuobjdump", "--dump-sass", str(cubin)], capture_output=True, text=True)
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
        t = cuda_median_s(lambda: mm.execute(), 10)
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
            t = cuda_median_s(mm.execute, 10)
            gbs = (h.nbytes + d.nbytes) / t / 1e9
            lines.append(f"  OK   {label}: {1e3 * t:.3f} ms, out {d.dtype} {'F' if d.flags.f_contiguous else 'C'}, "
                         f"rel. err {err:.1e}, {gbs:.0f} GB/s of A + D")
            mm.free()
        except Exception as exc:
            lines.append(f"  FAIL {label}: {type(exc).__name__}: {str(exc)[:300]}")
    return lines


def serve_check(backend: str = "cuda") -> list[str]:
    """The daemon on the cuda backend end to end: client -> HTTP -> kernels, checked on the way."""
    import os
    import socket
    import tempfile

    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo / "client"))
    from mmad_client import Client

    from mmad.backends.cpu import CpuBackend
    from mmad.spec import MLPSpec

    lines: list[str] = []
    store = tempfile.mkdtemp(prefix="mmad-store-")
    log = open(Path(store).parent / "mmad-serve.log", "wb")
    with socket.socket() as probe_sock:
        probe_sock.bind(("127.0.0.1", 0))
        port = probe_sock.getsockname()[1]
    env = {**os.environ, "MMAD_BACKEND": backend}
    daemon = subprocess.Popen([sys.executable, "-m", "mmad.server.main", "--host", "127.0.0.1", "--port", str(port),
                               "--store", store, "--no-demo", "--log-level", "warning"],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=repo)
    try:
        client = Client(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 120
        while True:
            try:
                if client.health_ready():
                    break
            except Exception:  # not listening yet
                pass
            if daemon.poll() is not None or time.monotonic() > deadline:
                log.flush()
                return [f"daemon did not become ready (exit {daemon.poll()}): "
                        f"{(Path(store).parent / 'mmad-serve.log').read_text(errors='replace')[-1500:]}"]
            time.sleep(0.2)
        report = client.devices()
        selected = report.get("selected", {})
        lines.append(f"daemon selected {selected.get('backend')}:{selected.get('variant')} on {selected.get('device')}")
        doc = bench_spec("M").to_json()
        meta = client.create_model("m", doc)
        lines.append(f"created model m on backend {meta.get('backend')}")
        rng = np.random.default_rng(7)
        spec = MLPSpec.from_json(doc)
        x = rng.standard_normal((65_536, spec.n_input_dims), dtype=np.float32)
        y = np.tanh(x[:, :spec.n_output_dims]).astype(np.float32)
        out = np.asarray(client.infer("m", x), dtype=np.float64)
        ref = CpuBackend("float64").compile(spec).forward(x)  # the daemon starts from init_params too
        err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
        lines.append(f"infer 65536 rows over HTTP (binary): rel. err vs float64 oracle {err:.2e}")
        losses = np.asarray(client.train_step("m", x, y, steps=20))
        lines.append(f"train_step x20 over HTTP: loss {losses[0]:.4f} -> {losses[-1]:.4f}, finite {bool(np.isfinite(losses).all())}")
        after = np.asarray(client.infer("m", x[:1000]))
        stats = client.stats("m")["model_stats"][0]
        lines.append(f"infer after training: finite {bool(np.isfinite(after).all())}; "
                     f"{stats['inference_count']} rows in {stats['execution_count']} executions")
    except Exception as exc:  # reported, not hidden
        lines.append(f"serve check failed: {type(exc).__name__}: {exc}")
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()
    return lines


def run_forward(name: str, variant: str, rows: int, times: int = 4) -> str:
    """Compile one model and run its forward ``times`` times on fresh random rows: the workload
    for an outside profiler (ncu picks a launch out of these)."""
    import cupy as cp

    from mmad.backends.cuda import CudaBackend

    spec = bench_spec(name)
    model = CudaBackend().compile(spec, variant=variant)
    x = cp.asarray(np.random.default_rng(3).standard_normal((rows, spec.n_input_dims), dtype=np.float32))
    for _ in range(times):
        out = model.forward(x)
    model.synchronize()
    finite = bool(cp.isfinite(out).all())
    model.close()
    return f"{name}:{model.variant} forward x{times} at {rows} rows, output finite: {finite}"


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
    if hasattr(model, "_mm"):
        mm = model._mm

        def mm_timed(key, a, b, **kw):
            out = timed(f"matmul {key[0]} {key[1]} {a.shape}x{b.shape}", mm, key, a, b, **kw)
            flags = "C" if out.flags.c_contiguous else "F" if out.flags.f_contiguous else "strided"
            spans[-1] = (spans[-1][0] + f" -> {out.shape} {out.dtype} {flags}", *spans[-1][1:])
            return out

        model._mm = mm_timed
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
        seconds = cuda_median_s(mm.execute, 10)
        flags = "C" if out.flags.c_contiguous else "F" if out.flags.f_contiguous else "strided"
        lines.append(f"  {1e3 * seconds:7.3f} ms  {label}: result {out.shape} {flags}-contiguous")
        mm.free()
    seconds = cuda_median_s(lambda: cp.matmul(h_rows, w.T), 10)
    lines.append(f"  {1e3 * seconds:7.3f} ms  cupy.matmul([rows][features], W^T) (no epilog)")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--models", default="S,M,L,W")
    p.add_argument("--batch", type=int, default=1 << 20)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--variant", default=None, help="force a variant (default: the backend's choice per model)")
    p.add_argument("--sass", action="store_true")
    p.add_argument("--nvmath-check", action="store_true")
    p.add_argument("--serve-check", action="store_true", help="the daemon on the cuda backend, end to end")
    p.add_argument("--serve-backend", default="cuda", help="MMAD_BACKEND for --serve-check (cpu to try it anywhere)")
    p.add_argument("--profile", metavar="MODEL:VARIANT", action="append", default=[],
                   help="time every kernel/matmul of one forward and training step (repeatable), e.g. M:mma")
    p.add_argument("--sweep-mma", metavar="SETTINGS", help="time the mma kernels per WARPS/MT_TRAIN setting, "
                   "e.g. 4/1,8/1,16/1,4/2 (models from --models)")
    p.add_argument("--run-forward", metavar="MODEL:VARIANT", help="only run that model's forward a few times at "
                   "--batch rows (for an outside profiler such as ncu), e.g. S:wgmma")
    p.add_argument("--no-bench", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "batch": args.batch}
    if args.run_forward:
        name, _, variant = args.run_forward.partition(":")
        print(run_forward(name.upper(), variant or "mma", args.batch), flush=True)
        return 0
    if args.nvmath_check:
        lines = nvmath_check()
        report["nvmath_check"] = lines
        print("\n".join(lines), flush=True)
    if args.serve_check:
        lines = serve_check(args.serve_backend)
        report["serve_check"] = lines
        print("\n".join(lines), flush=True)
    if args.sweep_mma:
        names = [n.strip().upper() for n in args.models.split(",") if n.strip()]
        lines = sweep_mma(names, args.batch, args.repeats, args.sweep_mma.split(","))
        report["sweep_mma"] = lines
        print("\n".join(lines), flush=True)
    for item in args.profile:
        name, _, variant = item.partition(":")
        lines = profile_ops(name.upper(), variant or "mma", args.batch)
        report.setdefault("profile", {})[item] = lines
        print("\n".join(lines), flush=True)
    if args.sass:
        report["sass"] = sass_mix(out)
        print(json.dumps(report["sass"], indent=1), flush=True)
    if not args.no_bench:
        names = [n.strip().upper() for n in args.models.split(",") if n.strip()]
        ceilings = measure_ceilings()
        peers = torch_peers(names, args.batch, args.repeats)
        mine = bench_mmad(names, args.batch, args.repeats, args.variant)
        report.update(ceilings=ceilings, torch=peers, mmad=mine)
        rows = [f"copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, fp16 GEMM {ceilings['gemm_flops_per_s'] / 1e12:.0f} TFLOP/s",
                "| model | variant | rel.err | fwd Ms/s | torch fwd | x torch | % floor | train Ms/s | torch train | x torch "
                "| % floor | fp16-I/O fwd Ms/s | x torch | % floor | fp16-I/O rel.err |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name in names:
            e, t = mine.get(name, {}), peers[name]
            if "error" in e:
                rows.append(f"| {name} | error: {e['error']} |")
                continue
            b = args.batch
            rows.append(
                f"| {name} | {e['variant']} | {e['rel_err']:.1e} | {b / e['forward_s'] / 1e6:.0f} | {b / t['forward_s'] / 1e6:.0f} | "
                f"{t['forward_s'] / e['forward_s']:.2f} | {100 * floor_s(name, b, ceilings, False) / e['forward_s']:.0f}% | "
                f"{b / e['train_s'] / 1e6:.0f} | {b / t['train_s'] / 1e6:.0f} | {t['train_s'] / e['train_s']:.2f} | "
                f"{100 * floor_s(name, b, ceilings, True) / e['train_s']:.0f}% | "
                f"{b / e['forward_half_io_s'] / 1e6:.0f} | {t['forward_s'] / e['forward_half_io_s']:.2f} | "
                f"{100 * floor_s(name, b, ceilings, False, io_bytes=2) / e['forward_half_io_s']:.0f}% | "
                f"{e['rel_err_half_io']:.1e} |")
        report["table"] = rows
        print("\n".join(rows), flush=True)
    (out / "cuda_bench.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
