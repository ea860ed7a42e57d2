"""cuda backend: fused MLP kernels on NVIDIA GPUs, through CuPy (memory, streams, NVRTC).

One file per variant; ``probe()`` reports each, with the reason when it cannot run:

* ``wgmma`` (:mod:`.wgmma`) — Hopper warpgroup MMA forwards (fp16 and fp32 I/O) and training
  (the backward through the resident weights read transposed, weight gradients as wgmma over the
  batch), compute capability 9.0 and nvcc, for models whose weights fit shared memory
  (``MMAD_CUDA_WGMMA=0`` turns the wgmma variants off).
* ``wgmma+mma`` (:mod:`.wgmma`) — the wgmma forwards with the ``mma`` variant's training kernels
  (every model whose wgmma forward fits; S and M train fastest on mma's fused kernel).
* ``mma`` (:mod:`.mma`) — mma.sync.m16n8k16 fused forward and training, compute capability 8.0+,
  widths 16-256.
* ``mma-f16acc`` (:mod:`.mma`) — the same kernels, except that the forwards with fp16 outputs
  accumulate in fp16, as tiny-cuda-nn's fully fused MLP does (fewer registers, a lighter epilogue;
  a little less precise: the dispatcher keeps it only where it is faster and within tolerance).
* ``cublaslt`` (:mod:`.cublaslt`) — per-layer cuBLASLt matmuls through nvmath-python.
* ``mma-f16acc+cublaslt`` and ``wgmma+cublaslt`` (:mod:`.cublaslt_trained`) — trained by
  ``cublaslt``, served by the ``mma-f16acc`` or ``wgmma`` forward (a copy of the parameters,
  refreshed on the device after training): for models whose fastest training and fastest
  forward are different variants'.

A grid-encoded model (HashGrid, DenseGrid, TiledGrid) runs on ``mma`` or ``mma-f16acc`` with the
grid kernels around its MLP kernels (:mod:`.grids`); left to the backend it takes ``mma-f16acc``,
unmeasured: tiny-cuda-nn's own arithmetic for a grid and its fully fused MLP (and the faster on
the H100), where measuring a fresh model (tables near 1e-4, subnormal in fp16 products) would
tell nothing of trained ones.

``compile(spec)`` without a variant returns at once a model on the quickest variant to compile
(``QUICK_VARIANTS``: cublaslt, whose kernels are library matmuls and a few element-wise kernels,
else mma, ...) and measures the usable ones on the model's shapes in the background, on the
device's queue (:mod:`mmad.backends.dispatch`); the daemon swaps the fastest in. A decision in
the kernel cache is used at once. ``MMAD_DISPATCH=measure`` measures before returning,
``fixed`` takes wgmma where offered, else mma, without measuring.

:mod:`.toolchain` holds the compilers, cubin loading and the host<->device side every variant
shares; :mod:`.knobs` the environment settings. Kernels are specialised per model, compiled
(NVRTC, nvcc for wgmma) and kept in the kernel cache (key: backend, architecture, compiler
version, options, source): a cache hit loads the cubin without compiling. The package imports
without CuPy; the probe then says why nothing can run.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from functools import partial
from typing import Any

import numpy as np

from mmad.backends.cache import KernelCache
from mmad.backends.contract import Backend, CompiledModel, DeviceInfo, MMAShape, ProbeRow, check_device_index
from mmad.backends.cuda.cublaslt import CublasLtModel, cublaslt_availability
from mmad.backends.cuda.cublaslt_trained import SPLIT_VARIANTS, CublasLtTrainedModel
from mmad.backends.cuda.grids import CudaGridModel
from mmad.backends.cuda.knobs import CudaKnobs
from mmad.backends.cuda.mma import MMA_MAX_WIDTH, CudaMmaModel
from mmad.backends.cuda.toolchain import cupy_module, device_info, find_nvcc, nvrtc_version, version_text
from mmad.backends.cuda.wgmma import WGMMA_OFF, CudaWgmmaModel, WgmmaPlan, nvcc_runs_wgmma
from mmad.backends.dispatch import BUDGET_S, dispatch, median_timer
from mmad.backends.dispatch import ROWS as DISPATCH_ROWS
from mmad.errors import BackendUnavailable, SpecError
from mmad.install import cuda_unavailable_reason, read_driver
from mmad.spec import MLPSpec

VARIANTS = ("wgmma", "wgmma+mma", "mma", "mma-f16acc", "cublaslt", *SPLIT_VARIANTS)
MMA_VARIANTS = ("mma", "mma-f16acc")  # the mma.sync kernels: EMA and grid encodings run on these
PINNED_PORTABLE = 1  # cudaHostAllocPortable
# the largest batch the variants are measured on (W's inputs and targets of 2^20 rows are 2 GiB of
# host memory); a model that runs larger batches is measured on this many rows
MAX_DISPATCH_ROWS = 1 << 20
# what a model serves on while its variants are measured: the first of these it can use and that
# compiles and runs correctly (the later ones are fallbacks), and why it is ready quickly (H200,
# cold cache: cuBLASLt's element-wise kernels 0.14 s for W, where the mma module took 3.3 s for M
# and 18.8 s for W)
QUICK_VARIANTS = (
    ("cublaslt", "the quickest to compile (library matmuls and a few small element-wise kernels)"),
    ("mma", "one NVRTC module of fused kernels"),
    ("mma-f16acc", "one NVRTC module of fused kernels"),
    ("wgmma+mma", "nvcc-built forwards, the mma variant's training"),
    ("wgmma", "nvcc-built kernels"),
)


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self) -> None:
        self._rows: list[ProbeRow] | None = None

    def probe(self) -> list[ProbeRow]:
        if self._rows is None:
            self._rows = self._probe()
        return self._rows

    def _probe(self) -> list[ProbeRow]:
        def all_unavailable(reason: str, **kw: Any) -> list[ProbeRow]:
            return [ProbeRow("cuda", v, False, reason=reason, **kw) for v in VARIANTS]

        # where nothing can run, the driver tells which piece is missing: the driver, a GPU, a
        # driver new enough for CuPy's CUDA, or CuPy itself (with the command that installs it)
        try:
            cp = cupy_module()
        except BackendUnavailable as exc:
            missing = getattr(exc.__cause__, "name", None) == "cupy"
            return all_unavailable(cuda_unavailable_reason(read_driver(), exc.reason, cupy_missing=missing))
        try:
            count = cp.cuda.runtime.getDeviceCount()
        except Exception as exc:  # no driver, no device, a driver older than CuPy's CUDA, broken install
            try:
                cupy_cuda = cp.cuda.runtime.runtimeGetVersion() // 1000
            except Exception:  # the runtime library itself is unusable: the device error says enough
                cupy_cuda = None
            return all_unavailable(cuda_unavailable_reason(read_driver(), f"no CUDA device is usable: {exc}",
                                                           cupy_cuda=cupy_cuda))
        if count == 0:
            return all_unavailable(cuda_unavailable_reason(read_driver(), "no CUDA device is present"))
        try:
            info = device_info(cp)
            nvrtc = nvrtc_version()
            api = (f"driver {version_text(cp.cuda.runtime.driverGetVersion())}, runtime "
                   f"{version_text(cp.cuda.runtime.runtimeGetVersion())}, NVRTC {nvrtc}, "
                   f"CuPy {cp.__version__}")
        except Exception as exc:
            return all_unavailable(f"querying the CUDA device failed: {type(exc).__name__}: {exc}")
        cc = info["cc"]
        common = {"device": info["name"], "api_version": api}
        details = {"compute_capability": f"{cc[0]}.{cc[1]}", "multiprocessors": info["sm_count"]}
        if count > 1:  # the rows describe device 0; models can be placed on every one
            details["devices"] = [f"{d.index}: {d.name}" for d in self.devices()]
        mma_shape = [MMAShape(16, 8, 16, scope="warp")]

        # wgmma: compute capability 9.0, nvcc builds a wgmma kernel and a child process runs it
        # with the right result (MMAD_CUDA_WGMMA=0 turns it off)
        wg_shapes = [MMAShape(64, n, 16, scope="warpgroup") for n in (8, 16, 32, 64, 128, 256)]
        if cc != (9, 0):
            wg = ProbeRow("cuda", "wgmma", False, reason=f"wgmma needs compute capability 9.0 (sm_90a); "
                          f"this GPU is {cc[0]}.{cc[1]}", details=dict(details), **common)
        elif not CudaKnobs.from_env().wgmma:
            wg = ProbeRow("cuda", "wgmma", False, reason=WGMMA_OFF, details=dict(details), **common)
        else:
            ok, why = nvcc_runs_wgmma()
            wg = ProbeRow("cuda", "wgmma", ok, reason="" if ok else f"the sm_90a wgmma check failed: {why}",
                          details={**details, "nvcc": find_nvcc() or "missing"},
                          mma_shapes=wg_shapes if ok else [], **common)
        # the wgmma forwards with the mma variant's training (any model whose forward fits)
        wg_mma = replace(wg, variant="wgmma+mma", details={**wg.details, "forward": "wgmma", "training": "mma"})
        if cc >= (8, 0):
            mma, acc16 = (ProbeRow("cuda", v, True, mma_shapes=mma_shape, details={**details, "max_width": MMA_MAX_WIDTH,
                                   "forward_accumulator": acc}, **common)
                          for v, acc in (("mma", "fp32"), ("mma-f16acc", "fp16")))
        else:
            mma, acc16 = (ProbeRow("cuda", v, False, reason=f"mma.sync m16n8k16 kernels need compute capability "
                                   f"8.0 or newer; this GPU is {cc[0]}.{cc[1]}", details=dict(details), **common)
                          for v in MMA_VARIANTS)
        lt_ok, lt_reason, lt_version = cublaslt_availability()
        lt = ProbeRow("cuda", "cublaslt", lt_ok, reason=lt_reason,
                      details={**details, "nvmath": lt_version}, **common)
        # trained by cublaslt, served by another variant's forward: usable where both are
        splits = []
        for name, fwd in ((n, {"mma-f16acc": acc16, "wgmma": wg}[f]) for n, f in SPLIT_VARIANTS.items()):
            ok = fwd.available and lt.available
            splits.append(ProbeRow("cuda", name, ok,
                                   reason="; ".join(f"{r.variant}: {r.reason}" for r in (fwd, lt) if not r.available),
                                   mma_shapes=fwd.mma_shapes if ok else [],
                                   details={**details, "forward": fwd.variant, "training": "cublaslt"}, **common))
        return [wg, wg_mma, mma, acc16, lt, *splits]

    @staticmethod
    def _wgmma_fits(spec: MLPSpec, variant: str = "wgmma+mma") -> bool:
        """Whether the variant's wgmma kernels fit the model: the forward for every wgmma
        variant, the training too for ``wgmma`` (its weights resident in shared memory)."""
        try:
            return WgmmaPlan(spec, training=True).trains if variant == "wgmma" else bool(WgmmaPlan(spec))
        except SpecError:
            return False

    def devices(self) -> list[DeviceInfo]:
        """Every CUDA device (``cudaGetDeviceCount`` order), with its memory now."""
        try:
            cp = cupy_module()
            count = cp.cuda.runtime.getDeviceCount()
        except Exception:  # noqa: BLE001 - no CUDA: no device (the probe says why)
            return []
        out = []
        for index in range(count):
            with cp.cuda.Device(index):
                free, total = cp.cuda.runtime.memGetInfo()
                out.append(DeviceInfo(index, device_info(cp)["name"], int(total), int(free)))
        return out

    def pin_host_memory(self, buffer: Any) -> Any:
        from mmad.backends.cuda.toolchain import host_register

        return host_register(cupy_module(), buffer)

    def page_locked_allocator(self) -> Any:
        cp = cupy_module()

        def alloc(nbytes: int) -> np.ndarray:
            # portable: page-locked for every device's context (models sit on several GPUs)
            memory = cp.cuda.pinned_memory.PinnedMemory(nbytes, PINNED_PORTABLE)
            return np.frombuffer(cp.cuda.pinned_memory.PinnedMemoryPointer(memory, 0), dtype=np.uint8, count=nbytes)

        return alloc

    def cuda_ipc_opener(self) -> Any:
        from mmad.backends.cuda.ipc import open_ipc_region

        return open_ipc_region

    def region_group_slot(self, device: int, size: int) -> Any:
        from mmad.backends.cuda.region_group import CudaGroupSlot

        return CudaGroupSlot(cupy_module(), device, size)

    def data_parallel(self, replicas: list[CompiledModel]) -> Any:
        from mmad.backends.cuda.parallel import NcclDataParallel

        return NcclDataParallel(replicas)

    def compile(self, spec: MLPSpec, variant: str | None = None, cache: Any = None,
                device: int = 0, batch_rows: int | None = None) -> CompiledModel:
        """``spec`` compiled as ``variant``; without one, the fastest usable variant for this model
        on this device, measured once and kept in the kernel cache: where no decision is cached,
        the first usable of ``QUICK_VARIANTS`` at once while the others are measured in the
        background (``MMAD_DISPATCH=background``, the default; the caller swaps the choice in, see
        :func:`mmad.backends.dispatch.settled`) or before returning (``measure``); or the fixed
        rule (``fixed``): wgmma where offered and the model fits, else mma.
        A model with tiny-cuda-nn's EMA optimizer or a grid encoding runs on mma or mma-f16acc (the
        variants that keep the average; the grid kernels work around their MLP kernels,
        :mod:`.grids`); a grid model left to the backend takes mma-f16acc (see the module's description).
        The variants are measured on ``batch_rows`` rows (the batch the model will mostly run; at
        most ``MAX_DISPATCH_ROWS``), else on the dispatcher's 65,536."""
        rows = {r.variant: r for r in self.probe()}
        if variant is not None and variant not in rows:
            raise SpecError("variant", f"the cuda backend has variants {', '.join(VARIANTS)}; got {variant!r}")
        grids = bool(spec.grid_shapes)
        if grids and variant not in (None, *MMA_VARIANTS):
            raise SpecError("variant", f"grid encodings run on the cuda backend's mma and mma-f16acc variants only "
                                       f"(grid kernels around their MLP kernels); the {variant} variant has none")
        knobs = CudaKnobs.from_env()
        ema = spec.optimizer.ema is not None
        if variant is None and grids:
            variant = "mma-f16acc"
        elif variant is None and knobs.dispatch == "fixed":
            variant = "wgmma" if rows["wgmma"].available and self._wgmma_fits(spec, "wgmma") and not ema else "mma"
        if variant is not None and not rows[variant].available:
            raise BackendUnavailable(f"cuda:{variant}", rows[variant].reason)
        usable = [v for v in VARIANTS if rows[v].available
                  and (not v.startswith("wgmma") or self._wgmma_fits(spec, v))
                  and (not ema or v in MMA_VARIANTS)]
        if not usable:
            raise BackendUnavailable("cuda", "; ".join(f"{v}: {rows[v].reason}" for v in VARIANTS))
        cp = cupy_module()
        check_device_index(device, cp.cuda.runtime.getDeviceCount(), "cuda")
        if cache is None:
            cache = KernelCache()
        with cp.cuda.Device(device):  # the model's buffers and kernels live on this device
            info = device_info(cp)
            if variant is not None:
                return self._build(variant, spec, cp, info, cache, knobs)
            cc = info["cc"]
            settings = {k: v for k, v in asdict(knobs).items() if k != "dispatch"}

            def build(name: str, for_spec: MLPSpec) -> CompiledModel:
                with cp.cuda.Device(device):  # the dispatcher compiles on threads of its own
                    return self._build(name, for_spec, cp, info, cache, knobs)

            # a new driver, CUDA runtime or CuPy may change which variant is fastest: measured again
            return dispatch(spec, {v: partial(build, v) for v in usable}, backend="cuda",
                            device=f"{info['name']} sm_{cc[0]}{cc[1]}", cache=cache, io="fp16",
                            timer=median_timer("cupy", budget_s=BUDGET_S),
                            key_extra={**settings, "stack": rows["mma"].api_version},
                            rows=DISPATCH_ROWS if batch_rows is None else min(batch_rows, MAX_DISPATCH_ROWS),
                            quick=[q for q in QUICK_VARIANTS if q[0] in usable] if knobs.dispatch == "background" else (),
                            device_queue=f"cuda:{device}", device_context=lambda: cp.cuda.Device(device))

    @staticmethod
    def _build(variant: str, spec: MLPSpec, cp: Any, info: dict[str, Any], cache: KernelCache,
               knobs: CudaKnobs) -> CompiledModel:
        if variant in MMA_VARIANTS:
            return (CudaGridModel if spec.grid_shapes else CudaMmaModel)(spec, cp, info, cache, knobs,
                                                                           forward_acc16=variant == "mma-f16acc")
        if variant in ("wgmma", "wgmma+mma"):
            return CudaWgmmaModel(spec, cp, info, cache, knobs, wgmma_training=variant == "wgmma")
        if variant in SPLIT_VARIANTS:
            return CublasLtTrainedModel(spec, cp, info, cache, knobs, variant)
        return CublasLtModel(spec, cp, info, cache)


__all__ = ["CudaBackend", "VARIANTS"]
