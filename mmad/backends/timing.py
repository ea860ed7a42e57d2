"""The one median timer and the one hardware floor every mmad benchmark uses (docs/benchmarks.md).

``median_seconds``: warm-up calls, then the median of ``repeats`` timed samples of ``fn``, each
sample read from one clock:

* ``"host"`` — ``time.perf_counter`` around ``fn()`` then ``sync()`` (the host waits for the
  device, so the sample includes submission and the wait);
* ``"cupy"`` / ``"torch"`` — a pair of CUDA events recorded on that library's current stream
  around ``fn()``: GPU time from the first to the last launch, without the host's wait;
* ``"gpu"`` — ``gpu_seconds()`` after each ``fn()``: what the device itself reported for the
  work ``fn`` ran (the vulkan backend's timestamps, ``model.gpu_times``).

``calls`` is how many calls ``fn`` makes per sample (back-to-back launches or ``steps=``): the
result is per call, so a fixed cost per sample (a read-back to synchronise) is spread over them.
On CUDA every timer makes :data:`GPU_CALLS_PER_SAMPLE` calls a sample (:func:`back_to_back`): the
throughput of a queue of calls. With one call a sample the GPU would idle from the start event
until the host had launched the call's first kernel (Python and the launch, 5-15 µs), inside a
60-80 µs forward of model S or of the hash-grid image config.

``measure_ceilings`` measures, now and here, the copy bandwidth and the matmul rate the floor
divides by: on the GPU host a 1 GiB device-to-device copy and an 8192² fp16 matmul (PyTorch,
else CuPy); on the CPU a 128 MiB ``np.copyto`` and a 2048² float32 matmul (NumPy's BLAS).
``floor_seconds`` is max(bytes moved / copy bandwidth, FLOPs / matmul rate).
"""

from __future__ import annotations

import platform
import statistics
import time
from typing import Any, Callable

import numpy as np

from mmad.errors import MMADError
from mmad.spec import MLPSpec

CLOCKS = ("host", "cupy", "torch", "gpu")
GPU_CALLS_PER_SAMPLE = 10


def back_to_back(fn: Callable[[], Any], calls: int) -> Callable[[], None]:
    """``fn`` called ``calls`` times: one sample of ``median_seconds(..., calls=calls)``."""
    def sample() -> None:
        for _ in range(calls):
            fn()

    return sample


def median_seconds(fn: Callable[[], Any], repeats: int, *, sync: Callable[[], None] | None = None,
                   clock: str = "host", gpu_seconds: Callable[[], float] | None = None,
                   warmup: int = 3, calls: int = 1) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` samples after ``warmup`` calls."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}; got {clock!r}")
    if repeats < 1 or calls < 1:
        raise ValueError(f"repeats and calls must be at least 1; got {repeats}, {calls}")
    if clock == "gpu" and gpu_seconds is None:
        raise ValueError("the gpu clock needs gpu_seconds (the device's own time of the last call)")
    event_pair, elapsed = _cuda_events(clock) if clock in ("cupy", "torch") else (None, None)
    if sync is None:
        sync = _stream_sync(clock)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        if event_pair is not None:
            start, end = event_pair()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(elapsed(start, end))
        elif clock == "gpu":
            fn()
            sync()
            times.append(gpu_seconds())
        else:
            began = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - began)
    return statistics.median(times) / calls


def _cuda_events(clock: str) -> tuple[Callable[[], tuple[Any, Any]], Callable[[Any, Any], float]]:
    if clock == "cupy":
        import cupy as cp

        return (lambda: (cp.cuda.Event(), cp.cuda.Event())), (lambda s, e: cp.cuda.get_elapsed_time(s, e) / 1e3)
    import torch

    def pair() -> tuple[Any, Any]:
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    return pair, (lambda s, e: s.elapsed_time(e) / 1e3)


def _stream_sync(clock: str) -> Callable[[], None]:
    if clock == "cupy":
        import cupy as cp

        return lambda: cp.cuda.get_current_stream().synchronize()
    if clock == "torch":
        import torch

        return torch.cuda.synchronize
    return lambda: None


# -- hardware floor ---------------------------------------------------------------------------
def measure_ceilings(on_gpu: bool, repeats: int = 10) -> dict[str, Any]:
    """Copy bandwidth (bytes read + written per second) and matmul rate, measured now.

    ``on_gpu``: the CUDA device through PyTorch (else CuPy); an error naming both when neither
    can reach one. Otherwise the CPU through NumPy.
    """
    if on_gpu:
        try:
            return _ceilings_torch(repeats)
        except ImportError:
            pass
        try:
            return _ceilings_cupy(repeats)
        except ImportError as exc:
            raise MMADError("the GPU floor needs PyTorch or CuPy with a CUDA device; neither imports "
                            f"({exc})") from exc
    a = np.random.default_rng(0).random(1 << 25, dtype=np.float32)  # 128 MiB: past every cache
    b = np.empty_like(a)
    copy_s = median_seconds(lambda: np.copyto(b, a), max(3, repeats // 2), warmup=1)
    n = 2048
    x = np.random.default_rng(1).random((n, n), dtype=np.float32)
    gemm_s = median_seconds(lambda: x @ x, max(3, repeats // 2), warmup=1)
    return {"copy_bytes_per_s": 2 * a.nbytes / copy_s, "gemm_flops_per_s": 2 * n ** 3 / gemm_s,
            "gemm_type": "fp32 (NumPy BLAS)", "device": platform.processor() or platform.machine()}


def _ceilings_torch(repeats: int) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        raise ImportError("PyTorch sees no CUDA device")
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    copy_s = median_seconds(lambda: b.copy_(a), repeats, clock="torch", warmup=2)
    n = 8192
    x = torch.randn(n, n, dtype=torch.float16, device="cuda")
    y = torch.randn(n, n, dtype=torch.float16, device="cuda")
    gemm_s = median_seconds(lambda: x @ y, repeats, clock="torch", warmup=2)
    device = torch.cuda.get_device_name()
    a = b = x = y = None  # 1 GiB twice and two matrices: back to the driver before the benchmark
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * (1 << 30) / copy_s, "gemm_flops_per_s": 2 * n ** 3 / gemm_s,
            "gemm_type": f"fp16 (PyTorch {torch.__version__}, cuBLAS)", "device": device}


def _ceilings_cupy(repeats: int) -> dict[str, Any]:
    import cupy as cp

    a = cp.random.randint(0, 255, 1 << 30, dtype=cp.uint8)
    b = cp.empty_like(a)
    copy_s = median_seconds(lambda: cp.copyto(b, a), repeats, clock="cupy", warmup=2)
    n = 8192
    x = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    y = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    gemm_s = median_seconds(lambda: x @ y, repeats, clock="cupy", warmup=2)
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    a = b = x = y = None
    cp.get_default_memory_pool().free_all_blocks()
    return {"copy_bytes_per_s": 2 * (1 << 30) / copy_s, "gemm_flops_per_s": 2 * n ** 3 / gemm_s,
            "gemm_type": f"fp16 (CuPy {cp.__version__}, cuBLAS)",
            "device": name.decode() if isinstance(name, bytes) else str(name)}


def floor_seconds(spec: MLPSpec, rows: int, ceilings: dict[str, Any], training: bool, io_bytes: int) -> float:
    """max(bytes / copy bandwidth, FLOPs / matmul rate) for ``rows`` samples.

    Bytes: the inputs and outputs (training: inputs, targets and the outputs' gradient) at
    ``io_bytes`` a value; FLOPs: one forward (training: three, forward plus the two backward
    products).
    """
    per_row = io_bytes * (spec.n_input_dims + spec.n_output_dims * (2 if training else 1))
    flops = spec.flops_per_sample() * (3 if training else 1) * rows
    return max(per_row * rows / ceilings["copy_bytes_per_s"], flops / ceilings["gemm_flops_per_s"])
