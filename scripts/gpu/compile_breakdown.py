"""What a cold compile spends its seconds on, per compiler call: each NVRTC module (its kernels and
source size) of a model on the cuda backend, each glslang build and each driver pipeline of a model
on the vulkan backend, every model in a fresh kernel cache. The facts behind the time to READY of
the models above 3 s (``mmad bench --ready``). Run by ``scripts/gpu/ready_check.sh breakdown``.

    python3 scripts/gpu/compile_breakdown.py [--cuda hashgrid:mma-f16acc,W:mma] [--vulkan W:coopmat,...]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from contextlib import contextmanager

import numpy as np

from mmad.backends.cache import KernelCache
from mmad.bench.ready import ONEBLOB32
from mmad.bench.kernels import bench_spec
from mmad.demo import IMAGE_CONFIG
from mmad.spec import MLPSpec

CALLS: list[tuple[float, float, str]] = []  # (start, seconds, what) of each compiler call
LOCK = threading.Lock()


def spec_of(name: str) -> MLPSpec:
    doc = {"hashgrid": IMAGE_CONFIG, "oneblob32": ONEBLOB32}.get(name)
    doc = bench_spec(name).to_json() if doc is None else dict(doc)
    return MLPSpec.from_json({**doc, "precision": "fp16"})


def timed(fn, describe):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            with LOCK:
                CALLS.append((t0, time.perf_counter() - t0, describe(*args, **kwargs)))
    return wrapper


@contextmanager
def patched(module, name, describe):
    original = getattr(module, name)
    setattr(module, name, timed(original, describe))
    try:
        yield
    finally:
        setattr(module, name, original)


def report(title: str, seconds: float) -> None:
    print(f"== {title}: {seconds:.2f} s in all")
    start = min((c[0] for c in CALLS), default=0.0)
    for t0, s, what in sorted(CALLS):
        print(f"  +{t0 - start:6.2f} s  {s:6.2f} s  {what}")
    CALLS.clear()


def cuda(cases: list[str]) -> None:
    import mmad.backends.cuda.cublaslt as cublaslt
    import mmad.backends.cuda.grids as grids
    import mmad.backends.cuda.mma as mma
    import mmad.backends.cuda.toolchain as toolchain  # the encodings' kernels import it at build time
    from mmad.backends.cuda import CudaBackend

    def nvrtc(source, arch, options, what):
        return f"NVRTC {what}: {source.count('__global__')} kernels, {len(source) // 1024} KiB of source"

    backend = CudaBackend()
    for case in cases:
        name, variant = case.split(":")
        with tempfile.TemporaryDirectory() as cache_dir:
            patches = [patched(m, "nvrtc_compile", nvrtc) for m in (mma, grids, cublaslt, toolchain)]
            for p in patches:
                p.__enter__()
            try:
                t0 = time.perf_counter()
                model = backend.compile(spec_of(name), variant=variant, cache=KernelCache(cache_dir))
                report(f"cuda:{variant} {name} compile", time.perf_counter() - t0)
                x = np.random.default_rng(0).random((1024, model.spec.n_input_dims), dtype=np.float32)
                t0 = time.perf_counter()
                model.forward(x)
                model.synchronize()
                report(f"cuda:{variant} {name} first forward", time.perf_counter() - t0)
                t0 = time.perf_counter()
                model.train_step(x, np.zeros((1024, model.spec.n_output_dims), dtype=np.float32))
                model.synchronize()
                report(f"cuda:{variant} {name} first train step", time.perf_counter() - t0)
                model.close()
            finally:
                for p in patches:
                    p.__exit__(None, None, None)


def vulkan(cases: list[str]) -> None:
    import mmad.backends.vulkan as vk
    import mmad.backends.vulkan.runtime as vr
    from mmad.backends.vulkan import VulkanBackend

    backend = VulkanBackend()
    original_init = vr.Pipeline.__init__

    def pipeline_init(self, device, spirv, n_bindings, push_bytes=0, spec_constants=None, name="kernel",
                      subgroup_size=None):
        t0 = time.perf_counter()
        try:
            original_init(self, device, spirv, n_bindings, push_bytes, spec_constants, name, subgroup_size)
        finally:
            with LOCK:
                CALLS.append((t0, time.perf_counter() - t0, f"pipeline {name} ({len(spirv) // 1024} KiB SPIR-V)"))

    vr.Pipeline.__init__ = pipeline_init
    try:
        with patched(vk, "build_spirv", lambda src, what, *a, **k: f"glslang {what} ({len(src) // 1024} KiB GLSL)"):
            for case in cases:
                name, variant = case.split(":")
                with tempfile.TemporaryDirectory() as cache_dir:
                    t0 = time.perf_counter()
                    model = backend.compile(spec_of(name), variant=variant, cache=KernelCache(cache_dir))
                    report(f"vulkan:{variant} {name} compile", time.perf_counter() - t0)
                    model.close()
    finally:
        vr.Pipeline.__init__ = original_init


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cuda", default="hashgrid:mma-f16acc,W:mma,oneblob32:mma")
    p.add_argument("--vulkan", default="W:coopmat,oneblob32:coopmat,W:coopmat2,oneblob32:coopmat2,hashgrid:coopmat")
    args = p.parse_args()
    for stack, run in (("cuda", cuda), ("vulkan", vulkan)):
        cases = [c for c in getattr(args, stack).split(",") if c]
        for case in cases:
            try:
                run([case])
            except Exception as exc:  # noqa: BLE001 - one case's failure is printed, the rest still run
                CALLS.clear()
                print(f"== {stack} {case} failed: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
