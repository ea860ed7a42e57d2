"""cuda backend: fused MLP kernels on NVIDIA GPUs, through CuPy (memory, streams, NVRTC).

Variants (``probe()`` reports each, with the reason when it cannot run):

* ``wgmma`` — Hopper warpgroup MMA (sm_90a), ``shaders/cuda/mlp_wgmma.cu``: the forward pass
  on wgmma (one warpgroup per 64-row tile, weights in shared memory in the swizzled K-major
  image the descriptors read, packed through maps built on the host with
  ``layouts.wgmma_smem_operand``; later layers take A from registers), training through the
  mma variant's kernels (same master weights). Built with nvcc for sm_90a into a cubin (NVRTC
  crashed compiling wgmma on the H100; there is no NVRTC fallback). It has never run on a GPU,
  so the probe reports it unavailable unless ``MMAD_CUDA_WGMMA=1`` is set; then it must pass
  the probe's checks (compute capability 9.0, nvcc builds and a child process runs a wgmma).
* ``mma`` — ``shaders/cuda/mlp_mma.cu``: mma.sync.m16n8k16 (fp16 in, fp32 accumulate), compute
  capability 8.0 or newer, hidden widths 16-256 (the default for every model). One kernel runs the whole forward pass with
  activations chained in registers; a training step is one fused forward + loss + backward
  kernel (per-layer activations and gradients written once for the weight gradients), one
  weight-gradient kernel per layer (mma over fixed row chunks: deterministic), and one
  reduction + optimizer kernel per layer that also refreshes the packed fp16 weight images.
* ``cublaslt`` — per-layer cuBLASLt matmuls with epilogs through nvmath-python's stateful
  ``Matmul``, plus ``shaders/cuda/mlp_elementwise.cu`` (see :class:`CublasLtModel`); chosen
  only when asked for by name.

Kernels are specialised per model (widths, depth, activations, loss, optimizer constants as
``#define``s), compiled by NVRTC to a cubin and stored in the kernel cache (key: backend,
architecture, NVRTC version, options, source); a cache hit loads the cubin without calling
NVRTC. This module imports without CuPy: the probe then reports why nothing can run.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

from mmad.backends import layouts as L
from mmad.backends import numerics as nm
from mmad.backends.cache import KernelCache
from mmad.backends.contract import (
    Backend, CompiledModel, MMAShape, ProbeRow, check_host_output, check_params, check_rows, init_params,
    optimizer_state_names,
)
from mmad.errors import BackendUnavailable, CompileError, InvalidInput, LaunchError, SpecError
from mmad.shaders import read_source
from mmad.spec import ACTIVATIONS, LOSSES, MLPSpec

log = logging.getLogger("mmad.backends.cuda")

VARIANTS = ("wgmma", "mma", "cublaslt")
MMA_MAX_WIDTH = 256  # wider than 128 holds 254 registers per thread (see docs/gpu-notes-cuda.md)
WARPS_PER_BLOCK = 4  # default warps per block of the mma kernels (MMAD_CUDA_MMA_WARPS measures others)
MMA_WARPS_ENV = "MMAD_CUDA_MMA_WARPS"
MMA_MT_TRAIN_ENV = "MMAD_CUDA_MMA_MT_TRAIN"  # 16-row tiles per warp in training (1 or 2)
FUSED_WGRAD_ENV = "MMAD_CUDA_FUSED_WGRAD"  # 0: weight gradients in their own kernels even where they fit
FUSED_WARPS, FUSED_ROWS = 8, 128  # mlp_train_fused: warps per block, rows per super-tile (FW, SUPER_ROWS)
FUSED_MAX_ACC = 96  # fp32 weight-gradient accumulators per thread the fused kernel may hold
ROW_GRANULE = 128  # rows are padded to this; a multiple of every kernel's rows per warp-tile
WGRAD_ROWS = 32  # rows per step of the weight-gradient kernel (its chunks are multiples)
SMEM_WEIGHTS_LIMIT = 100 * 1024  # weights go through shared memory when they fit twice per SM
FUSED_SMEM_LIMIT = 227 * 1024  # sm_80 / sm_90 opt-in limit per block (the fused kernel runs one per SM)

MMA_KERNELS = ("mlp_forward", "mlp_forward_half", "mlp_train_fwd_bwd", "mlp_wgrad", "mlp_optimize")
ACT_CODES = {name: i for i, name in enumerate(ACTIVATIONS)}
LOSS_CODES = {name: i for i, name in enumerate(LOSSES)}
# activations whose derivative follows from the stored fp16 output (no extra buffer)
DERIVATIVE_FROM_OUTPUT = ("None", "ReLU", "LeakyReLU")

WGMMA_ENV = "MMAD_CUDA_WGMMA"
WGMMA_OFF = ("wgmma is off by default: on the H100/H200 it ran correctly but slower than mma.sync on "
             "small models (docs/cuda.md); set MMAD_CUDA_WGMMA=1 to enable")
WGMMA_NVCC_OPTIONS = ("-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-std=c++17")
WGMMA_KERNELS = ("wgmma_forward", "wgmma_pack")
WGMMA_TILE_ROWS = 64  # one warpgroup's m64 tile
WGMMA_THREADS = 128  # one warpgroup
WGMMA_WARPGROUPS_ENV = "MMAD_CUDA_WGMMA_WARPGROUPS"  # forces 1 or 2 warpgroups per block
WGMMA_STAGES_ENV = "MMAD_CUDA_WGMMA_STAGES"  # forces 0, 1 or 2 prefetched input tiles per warpgroup
WGMMA_MIN_BLOCKS_ENV = "MMAD_CUDA_WGMMA_MIN_BLOCKS"  # __launch_bounds__ blocks per SM (1-4; measuring)
WGMMA_SMEM_LIMIT = 227 * 1024  # sm_90's opt-in shared memory per block
WGMMA_SMEM_PER_SM = 228 * 1024  # sm_90's shared memory per SM (each block also takes 1 KiB for the system)
WGMMA_ALIGN = 1024  # 128-byte swizzle atoms repeat every 1024 bytes: every section starts on one

# one m64n8k16 with A from registers (all 1.0) and B (8 x 16, all 1.0) from a 32-byte-swizzled
# shared tile: every accumulator element is 16, so each thread's four sum to 64
_WGMMA_PROBE_KERNEL = r"""
extern "C" __global__ void wgmma_probe(float* out) {
    __shared__ __align__(1024) unsigned short b[8 * 16];
    b[threadIdx.x] = 0x3C00;  // 1.0 in fp16
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
    const unsigned one = 0x3C003C00u;
    const unsigned long long desc = kmajor_desc((unsigned)__cvta_generic_to_shared(b), 0, 8, 32);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    asm volatile("{.reg .pred p; setp.ne.b32 p, %9, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;}"
                 : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
                 : "r"(one), "r"(one), "r"(one), "r"(one), "l"(desc), "r"(0));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    asm volatile("" : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3) :: "memory");
    out[threadIdx.x] = d0 + d1 + d2 + d3;
}
"""

_WGMMA_PROBE_RUN = """
import sys, cupy
module = cupy.RawModule(path=sys.argv[1])
kernel = module.get_function("wgmma_probe")
out = cupy.zeros(128, dtype=cupy.float32)
kernel((1,), (128,), (out,))
cupy.cuda.Device().synchronize()
values = out.get()
if not (values == 64).all():
    sys.exit(f"wrong wgmma result: {values[:8].tolist()} (expected 64 each)")
"""


def find_nvcc() -> str | None:
    """nvcc on PATH, under $CUDA_HOME / $CUDA_PATH, or in /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return None


def nvcc_version(nvcc: str) -> str:
    """The release ("13.0.88") ``nvcc --version`` reports, part of the kernel cache key."""
    try:
        done = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CompileError("the wgmma kernels", f"{nvcc} --version failed: {exc}") from exc
    match = re.search(r"V(\d+\.\d+\.\d+)", done.stdout)
    return match.group(1) if match else (done.stdout.strip().splitlines() or ["unknown"])[-1]


def nvcc_compile(source: str, options: tuple[str, ...], what: str) -> bytes:
    """Compile CUDA C++ to a cubin with nvcc; CompileError with the log on failure."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise CompileError(what, "nvcc was not found (PATH, CUDA_HOME, CUDA_PATH, /usr/local/cuda); "
                                 "the wgmma kernels are built with nvcc only", source)
    with tempfile.TemporaryDirectory(prefix="mmad-nvcc-") as tmp:
        src, cubin = os.path.join(tmp, "kernel.cu"), os.path.join(tmp, "kernel.cubin")
        with open(src, "w") as f:
            f.write(source)
        try:
            done = subprocess.run([nvcc, *options, src, "-o", cubin], capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise CompileError(what, f"nvcc did not finish: {exc}", source) from exc
        if done.returncode != 0:
            raise CompileError(what, f"nvcc exit {done.returncode}:\n{done.stderr}{done.stdout}", source)
        with open(cubin, "rb") as f:
            return f.read()


def _nvcc_runs_wgmma() -> tuple[bool, str]:
    """Build a wgmma kernel with nvcc, then run it in a child process (a crash stays there)."""
    source = read_source("cuda/wgmma_layout.cuh") + _WGMMA_PROBE_KERNEL
    try:
        cubin = nvcc_compile(source, WGMMA_NVCC_OPTIONS, "the wgmma probe kernel")
    except CompileError as exc:
        return False, exc.log.strip()[-300:]
    fd, path = tempfile.mkstemp(suffix=".cubin", prefix="mmad-wgmma-probe-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        done = subprocess.run([sys.executable, "-c", _WGMMA_PROBE_RUN, path], capture_output=True, text=True,
                              timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"the wgmma run check did not finish: {exc}"
    finally:
        os.unlink(path)
    if done.returncode == 0:
        return True, ""
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return False, f"the wgmma run check failed (exit {done.returncode}): {' '.join(tail)[:300]}"


# -- CuPy access ---------------------------------------------------------------------------
def _cupy():
    """The cupy module, or BackendUnavailable saying why not."""
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailable("cuda", f"CuPy is not installed ({exc})") from exc
    except Exception as exc:  # a broken CUDA install can fail at import time
        raise BackendUnavailable("cuda", f"CuPy failed to import: {type(exc).__name__}: {exc}") from exc
    return cupy


def _nvrtc_version() -> str:
    from cupy_backends.cuda.libs import nvrtc

    return "%d.%d" % tuple(nvrtc.getVersion())


def _device_errors(cp) -> tuple[type[BaseException], ...]:
    return (cp.cuda.driver.CUDADriverError, cp.cuda.runtime.CUDARuntimeError,
            cp.cuda.memory.OutOfMemoryError)


def _half_output(out_dtype: Any) -> bool:
    """Whether a forward's ``out_dtype`` asks for fp16 (else fp32); anything else is an error."""
    dt = np.dtype(out_dtype)
    if dt not in (np.float16, np.float32):
        raise InvalidInput(f"out_dtype must be float16 or float32; got {dt}")
    return dt == np.float16


def _version_text(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def nvrtc_compile(source: str, arch: str, options: tuple[str, ...], what: str) -> bytes:
    """Compile CUDA C++ to a cubin with NVRTC (through CuPy); CompileError with the log on failure.

    ``arch`` is the compute capability as digits ("90"); CuPy adds ``-arch=sm_<arch>``.
    """
    cp = _cupy()
    from cupy.cuda import compiler

    try:
        compiled = compiler.compile_using_nvrtc(source, options=tuple(options), arch=arch,
                                                filename="mmad_kernel.cu")
    except compiler.CompileException as exc:
        log = exc.get_message() if hasattr(exc, "get_message") else str(exc)
        raise CompileError(what, log, source) from exc
    except _device_errors(cp) as exc:
        raise CompileError(what, f"NVRTC could not run: {exc}", source) from exc
    # CuPy 14 returns (binary, name mapping); older versions the binary alone
    cubin = compiled[0] if isinstance(compiled, tuple) else compiled
    if isinstance(cubin, str):  # CuPy chose PTX (an arch newer than its NVRTC knows): still loadable
        cubin = cubin.encode()
    return bytes(cubin)


class LoadedModule:
    """A cubin loaded into the current context; its kernels by name."""

    def __init__(self, cp, cubin: bytes, names: tuple[str, ...]):
        # RawModule(path=...) is CuPy's documented way to load a prebuilt cubin; it reads the
        # file at the first get_function, so every kernel is fetched before the file goes
        fd, path = tempfile.mkstemp(suffix=".cubin", prefix="mmad-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(cubin)
            self.module = cp.RawModule(path=path)
            self.kernels = {name: self.module.get_function(name) for name in names}
        finally:
            os.unlink(path)

    def kernel(self, name: str):
        return self.kernels[name]


def device_info(cp) -> dict[str, Any]:
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"]
    return {
        "name": name.decode() if isinstance(name, bytes) else str(name),
        "cc": (int(props["major"]), int(props["minor"])),
        "sm_count": int(props["multiProcessorCount"]),
        "smem_per_sm": int(props.get("sharedMemPerMultiprocessor", 228 * 1024)),
        "smem_optin": int(props.get("sharedMemPerBlockOptin", 227 * 1024)),
        "regs_per_sm": int(props.get("regsPerMultiprocessor", 65536)),
    }


def pad16(n: int) -> int:
    return (n + 15) // 16 * 16


def b_image_index(k_dim: int, k: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Where element (k, n) of a K x N B operand sits in its packed image (halves).

    Mirrors ``b_image_index`` in mlp_mma.cu: n-tile (8 columns) major, then k-chunk (16),
    then lane (g = n % 8, t = (k % 8) // 2 -> lane 4g + t), then the four halves b0 b1 b2 b3
    (b0 b1: k % 16 < 8, b2 b3: k % 16 >= 8; low/high half by k % 2).
    """
    k = np.asarray(k)
    n = np.asarray(n)
    kc, kk = k >> 4, k & 15
    hi, rr = kk >> 3, kk & 7
    lane = (n & 7) * 4 + (rr >> 1)
    return ((((n >> 3) * (k_dim >> 4) + kc) * 32 + lane) * 4 + hi * 2 + (rr & 1)).astype(np.int64)


def _env_choice(name: str, allowed: tuple[int, ...], default: int) -> int:
    """An integer tuning knob from the environment, one of ``allowed`` (a typo is an error)."""
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    if not raw.isdigit() or int(raw) not in allowed:
        raise SpecError(name, f"must be one of {', '.join(map(str, allowed))}; got {raw!r}")
    return int(raw)


# -- the mma.sync model ------------------------------------------------------------------------
class MmaPlan:
    """Geometry and generated source of one spec's mma kernels (needs no GPU, no CuPy)."""

    def __init__(self, spec: MLPSpec):
        if spec.precision != "fp16":
            raise SpecError("precision", f"the cuda mma variant computes in fp16; got {spec.precision!r}")
        if spec.n_neurons > MMA_MAX_WIDTH:
            raise SpecError("network.n_neurons",
                            f"the cuda mma variant supports widths up to {MMA_MAX_WIDTH}; got {spec.n_neurons}")
        self.spec = spec
        self.width = spec.n_neurons
        self.n_hidden = spec.n_hidden_layers
        self.k_in = pad16(spec.n_encoded_dims)
        self.n_out_pad = pad16(spec.n_output_dims)
        # (fan_in, fan_out, K padded, N padded) per layer
        self.layers = [(fi, fo, pad16(fi), pad16(fo)) for fi, fo in spec.layer_dims]
        self.n_layers = len(self.layers)
        self.wf_total = sum(k * n for _, _, k, n in self.layers)
        self.wb_total = sum(k * n for _, _, k, n in self.layers[1:])
        self.store_dact = spec.activation not in DERIVATIVE_FROM_OUTPUT
        self.smem_fwd = self.wf_total * 2
        self.smem_train = (self.wf_total + self.wb_total) * 2
        self.w_smem_fwd = self.smem_fwd <= SMEM_WEIGHTS_LIMIT
        self.w_smem_train = self.smem_train <= SMEM_WEIGHTS_LIMIT
        self.mt_fwd = 2 if self.width <= 64 else 1  # two 16-row tiles per warp share B loads
        self.warps = _env_choice(MMA_WARPS_ENV, (2, 4, 8, 16), WARPS_PER_BLOCK)
        self.mt_train = _env_choice(MMA_MT_TRAIN_ENV, (1, 2), 1)
        self.fused_wgrad, self.smem_fused = self._fused_plan()
        self.source = self._source()

    def _fused_plan(self) -> tuple[bool, int]:
        """Whether mlp_train_fused applies (weight gradients accumulated in the training kernel),
        and its shared memory: the weights, a 128-row stash of every layer's input, a delta stage.
        It needs the derivative from h (ReLU family), the weights in shared memory, and
        accumulators that fit in registers (each thread holds 1/256 of every dW)."""
        rows = FUSED_ROWS
        stash = sum(rows * (k + 8) for _, _, k, _ in self.layers)
        stage = rows * (max(self.width, self.n_out_pad) + 8)
        smem = (self.wf_total + self.wb_total + stash + stage) * 2
        units = [math.ceil((n // 16) * (k // 16) / FUSED_WARPS) for _, _, k, n in self.layers]
        acc = 8 * sum(units)  # two m16n8 fragments of 4 floats per 16 x 16 unit
        wanted = _env_choice(FUSED_WGRAD_ENV, (0, 1), 1) == 1
        fits = (not self.store_dact and self.w_smem_train and acc <= FUSED_MAX_ACC
                and smem <= FUSED_SMEM_LIMIT and self.mt_train == 1)
        return wanted and fits, smem

    def _source(self) -> str:
        s, opt = self.spec, self.spec.optimizer

        def f32(v: float) -> str:
            return f"{float(np.float32(v))!r}f"

        defines = {
            "NIN": s.n_encoded_dims, "KIN": self.k_in, "WIDTH": self.width, "NHID": self.n_hidden,
            "NOUT": s.n_output_dims, "NOUT_PAD": self.n_out_pad,
            "ACT": ACT_CODES[s.activation], "OUT_ACT": ACT_CODES[s.output_activation],
            "LOSS": LOSS_CODES[s.loss], "HUBER_DELTA": f32(s.huber_delta),
            "MT_FWD": self.mt_fwd, "MT_TRAIN": self.mt_train, "WARPS": self.warps,
            "W_SMEM_FWD": int(self.w_smem_fwd), "W_SMEM_TRAIN": int(self.w_smem_train),
            "STORE_DACT": int(self.store_dact), "FUSED_WGRAD": int(self.fused_wgrad),
            "OPT_ADAM": int(opt.otype == "Adam"),
            "LR": f32(opt.learning_rate), "BETA1": f32(opt.beta1), "BETA2": f32(opt.beta2),
            "EPS": f32(opt.epsilon), "L2REG": f32(opt.l2_reg), "MOMENTUM": f32(opt.momentum),
        }
        head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
        return head + read_source("cuda/mlp_common.cuh") + read_source("cuda/mlp_mma.cu")


class CudaMmaModel(MmaPlan, CompiledModel):
    """A model compiled to the fused mma.sync kernels; every buffer lives on the device."""

    backend = "cuda"
    variant = "mma"

    def __init__(self, spec: MLPSpec, cp, info: dict[str, Any], cache: KernelCache | None):
        CompiledModel.__init__(self, spec)
        MmaPlan.__init__(self, spec)
        self.cp = cp
        self.info = info
        self.arch_digits = f"{info['cc'][0]}{info['cc'][1]}"
        self.arch = f"sm_{self.arch_digits}"
        self.options = ("-std=c++17",)
        self._module = self._build(cache)
        self._allocate()
        self.set_params(init_params(spec))

    # -- build ------------------------------------------------------------------------------
    def _build(self, cache: KernelCache | None) -> LoadedModule:
        what = f"mma kernels for model {self.spec.content_hash()} ({self.describe()})"

        def build() -> bytes:
            return nvrtc_compile(self.source, self.arch_digits, self.options, what)

        compiler = f"nvrtc-{_nvrtc_version()}"
        if cache is None:
            cubin = build()
        else:
            cubin = cache.get_or_build(build, backend="cuda-mma", device=self.arch, compiler=compiler,
                                       options=list(self.options), source=self.source)
        try:
            module = LoadedModule(self.cp, cubin, MMA_KERNELS + (("mlp_train_fused",) if self.fused_wgrad else ()))
            fwd, train = module.kernel("mlp_forward"), module.kernel("mlp_train_fwd_bwd")
            if self.w_smem_fwd and self.smem_fwd > 48 * 1024:
                fwd.max_dynamic_shared_size_bytes = self.smem_fwd
                module.kernel("mlp_forward_half").max_dynamic_shared_size_bytes = self.smem_fwd
            if self.w_smem_train and self.smem_train > 48 * 1024:
                train.max_dynamic_shared_size_bytes = self.smem_train
            if self.fused_wgrad and self.smem_fused > 48 * 1024:
                module.kernel("mlp_train_fused").max_dynamic_shared_size_bytes = self.smem_fused
        except _device_errors(self.cp) as exc:
            raise LaunchError(f"loading the compiled {what} failed: {exc}") from exc
        self.grid_fwd = self._resident_blocks(fwd, self.smem_fwd if self.w_smem_fwd else 0)
        self.grid_train = self._resident_blocks(train, self.smem_train if self.w_smem_train else 0)
        self.grid_fused = (self._resident_blocks(module.kernel("mlp_train_fused"), self.smem_fused, FUSED_WARPS)
                           if self.fused_wgrad else 0)
        return module

    def _resident_blocks(self, kernel, smem: int, warps: int | None = None) -> int:
        """Blocks of one launch that fit on the GPU at once (the persistent grid)."""
        warps = warps or self.warps
        threads = warps * 32
        regs = max(int(kernel.num_regs), 1)
        regs_per_warp = math.ceil(regs * 32 / 256) * 256
        by_regs = self.info["regs_per_sm"] // (regs_per_warp * warps)
        by_smem = self.info["smem_per_sm"] // (smem + 1024) if smem else 64
        by_threads = 2048 // threads
        return max(1, min(by_regs, by_smem, by_threads, 32)) * self.info["sm_count"]

    def describe(self) -> str:
        s = self.spec
        return (f"{s.n_encoded_dims}->{s.n_neurons}x{s.n_hidden_layers}->{s.n_output_dims}, "
                f"{s.activation}/{s.output_activation}, {s.loss}, {s.optimizer.otype}")

    # -- buffers ----------------------------------------------------------------------------
    def _allocate(self) -> None:
        cp = self.cp
        try:
            n_w = [n * k for _, _, k, n in self.layers]
            n_b = [n for _, _, _, n in self.layers]
            total_w, total_b = sum(n_w), sum(n_b)
            self.w_all = cp.zeros(total_w, dtype=cp.float32)
            self.b_all = cp.zeros(total_b, dtype=cp.float32)  # the kernels read biases here
            n_slots = 2 if self.spec.optimizer.otype == "Adam" else 1
            self.slot_w = [cp.zeros(total_w, dtype=cp.float32) for _ in range(n_slots)]
            self.slot_b = [cp.zeros(total_b, dtype=cp.float32) for _ in range(n_slots)]
            self.wimage = cp.zeros(self.wf_total + self.wb_total, dtype=cp.uint16)
            self.dummy = cp.zeros(4, dtype=cp.float32)
        except _device_errors(cp) as exc:
            raise LaunchError(f"allocating the model's device buffers failed: {exc}") from exc
        self.w_off, self.b_off, self.wf_off, self.wb_off = [], [], [], []
        ow = ob = of = 0
        ob_img = self.wf_total
        for i, (_, _, k, n) in enumerate(self.layers):
            self.w_off.append(ow)
            self.b_off.append(ob)
            self.wf_off.append(of)
            self.wb_off.append(ob_img if i > 0 else -1)
            ow += n * k
            ob += n
            of += n * k
            if i > 0:
                ob_img += n * k
        self._workspace: dict[int, dict[str, Any]] = {}

    def _workspace_for(self, rows_pad: int) -> dict[str, Any]:
        ws = self._workspace.get(rows_pad)
        if ws is not None:
            return ws
        self._workspace.clear()  # one batch size at a time: large buffers are not hoarded
        cp = self.cp
        w, nh = self.width, self.n_hidden
        sm = self.info["sm_count"]
        if self.fused_wgrad:
            # one partial sum per block of mlp_train_fused, every layer (mlp_optimize adds them)
            blocks = self.fused_blocks(rows_pad)
            chunks = [(blocks, 0)] * self.n_layers
            max_partial = blocks * sum(n * k + n for _, _, k, n in self.layers)
        else:
            chunks, max_partial = [], 0
            for _, _, k, n in self.layers:
                tiles = math.ceil(n / 64) * math.ceil(k / 64)
                n_chunks = max(1, min(rows_pad // WGRAD_ROWS, math.ceil(4 * sm / tiles)))
                chunk_rows = math.ceil(rows_pad / n_chunks / WGRAD_ROWS) * WGRAD_ROWS
                n_chunks = math.ceil(rows_pad / chunk_rows)
                chunks.append((n_chunks, chunk_rows))
                max_partial = max(max_partial, n_chunks * (n * k + n))
        stored_rows = 0 if self.fused_wgrad else rows_pad  # the fused kernel keeps h and deltas on chip
        try:
            ws = {
                "h": cp.empty(max(stored_rows * (self.k_in + nh * w) // 2, 2), dtype=cp.uint32),
                "d": cp.empty(max(stored_rows * (nh * w + self.n_out_pad) // 2, 2), dtype=cp.uint32),
                "dact": cp.empty(stored_rows * nh * w // 2 if self.store_dact else 2, dtype=cp.uint32),
                "partial": cp.empty(max_partial, dtype=cp.float32),
                "loss": cp.zeros(max(self.grid_train * self.warps, self.grid_fused * FUSED_WARPS), dtype=cp.float64),
                "chunks": chunks,
            }
        except _device_errors(cp) as exc:
            raise LaunchError(f"allocating training buffers for {rows_pad} rows failed: {exc}") from exc
        self._workspace[rows_pad] = ws
        return ws

    # -- host <-> device ----------------------------------------------------------------------
    def upload(self, x: np.ndarray) -> Any:
        try:
            return self.cp.asarray(np.ascontiguousarray(x, dtype=np.float32))
        except _device_errors(self.cp) as exc:
            raise LaunchError(f"copying {np.shape(x)} to the device failed: {exc}") from exc

    def download(self, a: Any) -> np.ndarray:
        try:
            return self.cp.asnumpy(a)
        except _device_errors(self.cp) as exc:
            raise LaunchError(f"copying from the device failed: {exc}") from exc

    def synchronize(self) -> None:
        try:
            self.cp.cuda.get_current_stream().synchronize()
        except _device_errors(self.cp) as exc:
            raise LaunchError(f"a CUDA kernel failed: {exc}") from exc

    def _device_input(self, x: Any, cols: int, name: str, encode: bool,
                      keep_half: bool = False) -> tuple[Any, bool]:
        """(device fp32 C-contiguous rows x encoded cols, whether x came from the host); with
        ``keep_half``, an fp16 device array without an encoding to apply stays fp16."""
        cp = self.cp
        on_device = isinstance(x, cp.ndarray)
        if not on_device:
            host = check_rows(x, cols, name)
            if encode and self.spec.encoding.otype != "Identity":
                host = np.ascontiguousarray(nm.encode(self.spec.encoding, host), dtype=np.float32)
            elif keep_half and host.dtype == np.float16:  # half the bytes over PCIe, no cast on either side
                try:
                    return self.cp.asarray(np.ascontiguousarray(host)), True
                except _device_errors(self.cp) as exc:
                    raise LaunchError(f"copying {host.shape} to the device failed: {exc}") from exc
            return self.upload(host), True
        if x.ndim == 1 and cols == 1:
            x = x.reshape(-1, 1)
        if x.ndim != 2 or x.shape[1] != cols:
            raise InvalidInput(f"{name} must have shape [rows, {cols}]; got {list(x.shape)}")
        if x.dtype not in (cp.float32, cp.float16, cp.float64):
            raise InvalidInput(f"{name} must be float32 or float16; got {x.dtype}")
        if keep_half and x.dtype == cp.float16 and not (encode and self.spec.encoding.otype != "Identity"):
            x = cp.ascontiguousarray(x)
            # the kernels read 4-byte pairs and cuBLASLt plans assume aligned operands
            return (x.copy() if x.data.ptr % 16 else x), False
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        if encode and self.spec.encoding.otype != "Identity":
            # encodings are defined once, in NumPy (numerics.encode): applied on the host
            x = self.upload(nm.encode(self.spec.encoding, self.download(x)))
        return x, False

    def _launch(self, name: str, grid, block, args, smem: int = 0) -> None:
        try:
            self._module.kernel(name)(grid, block, args, shared_mem=smem)
        except _device_errors(self.cp) as exc:
            raise LaunchError(f"launching {name} failed: {exc}") from exc

    # -- compute --------------------------------------------------------------------------------
    def forward(self, x: Any, out_dtype: Any = np.float32) -> Any:
        """See ``CompiledModel.forward``; ``out_dtype`` float16 gives fp16 outputs (rounded once
        from the fp32 result). fp16 device inputs with fp16 outputs run ``mlp_forward_half``,
        which reads and writes fp16 (the I/O of an fp16 pipeline, half the bytes)."""
        cp = self.cp
        half_out = _half_output(out_dtype)
        dx, from_host = self._device_input(x, self.spec.n_input_dims, "input", encode=True, keep_half=half_out)
        rows = dx.shape[0]
        half_io = half_out and dx.dtype == cp.float16
        out = cp.empty((rows, self.spec.n_output_dims), dtype=cp.float16 if half_io else cp.float32)
        if rows:
            rows_pad = math.ceil(rows / ROW_GRANULE) * ROW_GRANULE
            tiles = rows_pad // (16 * self.mt_fwd)
            grid = max(1, min(self.grid_fwd, math.ceil(tiles / self.warps)))
            self._launch("mlp_forward_half" if half_io else "mlp_forward", (grid,), (self.warps * 32,),
                         (dx, np.int64(rows), np.int64(rows_pad), out, self.wimage, self.b_all),
                         self.smem_fwd if self.w_smem_fwd else 0)
        if half_out and not half_io:
            out = out.astype(cp.float16)
        return self.download(out) if from_host else out

    def forward_to_host(self, x: np.ndarray, out: np.ndarray, executor: Any = None) -> None:
        """``forward`` into the host array ``out`` in its own dtype: an fp16 ``out`` is produced
        on the device (fp16 inputs read as they are), so half the bytes come back and the host
        casts nothing."""
        out = check_host_output(out, np.shape(x)[0], self.spec.n_output_dims)
        if self.spec.encoding.otype != "Identity":  # encoded in fp32 on the host, then as below
            np.copyto(out, self.forward(x, out_dtype=out.dtype))
            return
        dx, _ = self._device_input(x, self.spec.n_input_dims, "input", encode=False,
                                   keep_half=out.dtype == np.float16)
        result = self.forward(dx, out_dtype=out.dtype)
        try:
            result.get(out=out)
        except _device_errors(self.cp) as exc:
            raise LaunchError(f"copying the output from the device failed: {exc}") from exc

    def fused_blocks(self, rows_pad: int) -> int:
        """Blocks of mlp_train_fused for a batch: resident ones, at most one per 128-row super-tile."""
        return max(1, min(self.grid_fused, rows_pad // FUSED_ROWS))

    def _forward_backward(self, dx, dy, rows: int, step_slot) -> dict[str, Any]:
        """Forward + loss + backward in one kernel; the weight gradients inside it (fused plan) or
        in each layer's chunked kernel afterwards (``_layer_grads``)."""
        rows_pad = math.ceil(rows / ROW_GRANULE) * ROW_GRANULE
        ws = self._workspace_for(rows_pad)
        grad_scale = np.float32(self.spec.loss_scale / (rows * self.spec.n_output_dims))
        if self.fused_wgrad:
            grid = self.fused_blocks(rows_pad)
            loss_slots = ws["loss"][: grid * FUSED_WARPS]
            self._launch("mlp_train_fused", (grid,), (FUSED_WARPS * 32,),
                         (dx, np.int64(rows), np.int64(rows_pad), self.wimage, self.b_all, dy, grad_scale,
                          ws["partial"], loss_slots), self.smem_fused)
        else:
            grid = max(1, min(self.grid_train, math.ceil(rows_pad // (16 * self.mt_train) / self.warps)))
            loss_slots = ws["loss"][: grid * self.warps]
            self._launch("mlp_train_fwd_bwd", (grid,), (self.warps * 32,),
                         (dx, np.int64(rows), np.int64(rows_pad), self.wimage, self.b_all, dy, grad_scale,
                          ws["h"], ws["d"], ws["dact"], loss_slots),
                         self.smem_train if self.w_smem_train else 0)
        step_slot[...] = loss_slots.sum()
        ws["rows_pad"] = rows_pad
        return ws

    def _layer_grads(self, ws: dict[str, Any], i: int) -> tuple[int, Any, Any]:
        """Layer i's partial weight / bias sums: (chunks, partial W sums, partial b sums), from
        mlp_train_fused's buffer (layout: partial_off in mlp_mma.cu) or its own kernel."""
        rows_pad = ws["rows_pad"]
        _, _, k, n = self.layers[i]
        n_chunks, chunk_rows = ws["chunks"][i]
        if self.fused_wgrad:
            off = n_chunks * sum(nj * kj + nj for _, _, kj, nj in self.layers[:i])
            return (n_chunks, ws["partial"][off:off + n_chunks * n * k],
                    ws["partial"][off + n_chunks * n * k:off + n_chunks * (n * k + n)])
        h_off = 0 if i == 0 else rows_pad * (self.k_in + (i - 1) * self.width)
        d_off = rows_pad * i * self.width
        h = ws["h"].view(self.cp.uint16)[h_off:h_off + rows_pad * k]
        d = ws["d"].view(self.cp.uint16)[d_off:d_off + rows_pad * n]
        pw = ws["partial"][: n_chunks * n * k]
        pb = ws["partial"][n_chunks * n * k: n_chunks * (n * k + n)]
        tiles = math.ceil(n / 64) * math.ceil(k / 64)
        self._launch("mlp_wgrad", (n_chunks, tiles), (128,),
                     (d, np.int32(n), h, np.int32(k), np.int64(chunk_rows), np.int64(rows_pad), pw, pb))
        return n_chunks, pw, pb

    def _optimize_layer(self, i: int, mode: int, n_chunks: int, pw, pb, lr_t: float,
                        grad_w=None, grad_b=None) -> None:
        fan_in, fan_out, k, n = self.layers[i]
        w = self.w_all[self.w_off[i]:self.w_off[i] + n * k]
        b = self.b_all[self.b_off[i]:self.b_off[i] + n]
        s1w = self.slot_w[0][self.w_off[i]:self.w_off[i] + n * k]
        s1b = self.slot_b[0][self.b_off[i]:self.b_off[i] + n]
        s2w = self.slot_w[-1][self.w_off[i]:self.w_off[i] + n * k]
        s2b = self.slot_b[-1][self.b_off[i]:self.b_off[i] + n]
        total = n * k + n
        d = self.dummy
        self._launch("mlp_optimize", (math.ceil(total / 256),), (256,),
                     (np.int32(mode), w, b, s1w, s1b, s2w, s2b, d if pw is None else pw,
                      d if pb is None else pb, np.int32(n_chunks), np.int32(n), np.int32(k),
                      np.int32(fan_out), np.int32(fan_in), self.wimage, np.int32(self.wf_off[i]),
                      np.int32(self.wb_off[i]), np.float32(lr_t), np.float32(1.0 / self.spec.loss_scale),
                      d if grad_w is None else grad_w, d if grad_b is None else grad_b))

    def _prepare_batch(self, x: Any, y: Any) -> tuple[Any, Any, int]:
        dx, _ = self._device_input(x, self.spec.n_input_dims, "input", encode=True)
        dy, _ = self._device_input(y, self.spec.n_output_dims, "target", encode=False)
        if dy.shape[0] != dx.shape[0]:
            raise InvalidInput(f"target has {dy.shape[0]} rows but input has {dx.shape[0]}")
        if dx.shape[0] == 0:
            raise InvalidInput("a training batch needs at least one row")
        return dx, dy, dx.shape[0]

    def train_step(self, x: Any, y: Any, steps: int = 1) -> np.ndarray:
        if steps < 1:
            raise InvalidInput(f"steps must be at least 1; got {steps}")
        dx, dy, rows = self._prepare_batch(x, y)
        losses = self.cp.zeros(steps, dtype=self.cp.float64)
        opt = self.spec.optimizer
        for s in range(steps):
            ws = self._forward_backward(dx, dy, rows, losses[s])
            step = self.step_count + 1
            lr_t = opt.learning_rate * math.sqrt(1 - opt.beta2 ** step) / (1 - opt.beta1 ** step) \
                if opt.otype == "Adam" else opt.learning_rate
            for i in reversed(range(self.n_layers)):
                n_chunks, pw, pb = self._layer_grads(ws, i)
                self._optimize_layer(i, 0, n_chunks, pw, pb, lr_t)
            self.step_count = step
        total = self.download(losses) / (rows * self.spec.n_output_dims)
        return total.astype(np.float32)

    def loss_and_grads(self, x: Any, y: Any) -> tuple[float, dict[str, np.ndarray]]:
        cp = self.cp
        dx, dy, rows = self._prepare_batch(x, y)
        loss = cp.zeros((), dtype=cp.float64)
        ws = self._forward_backward(dx, dy, rows, loss)
        grads: dict[str, np.ndarray] = {}
        for i in reversed(range(self.n_layers)):
            fan_in, fan_out, k, n = self.layers[i]
            n_chunks, pw, pb = self._layer_grads(ws, i)
            gw = cp.zeros(n * k, dtype=cp.float32)
            gb = cp.zeros(n, dtype=cp.float32)
            self._optimize_layer(i, 1, n_chunks, pw, pb, 0.0, gw, gb)
            grads[f"W{i}"] = self.download(gw).reshape(n, k)[:fan_out, :fan_in].copy()
            grads[f"b{i}"] = self.download(gb)[:fan_out].copy()
        value = float(self.download(loss)) / (rows * self.spec.n_output_dims)
        return value, {k: grads[k] for k in sorted(grads, key=lambda s: (int(s[1:]), s[0]))}

    # -- parameters -------------------------------------------------------------------------------
    def _padded(self, flat: Any, offsets: list[int], i: int, is_w: bool) -> np.ndarray:
        fan_in, fan_out, k, n = self.layers[i]
        if is_w:
            return self.download(flat[offsets[i]:offsets[i] + n * k]).reshape(n, k)[:fan_out, :fan_in].copy()
        return self.download(flat[offsets[i]:offsets[i] + n])[:fan_out].copy()

    def _upload_padded(self, flat: Any, offsets: list[int], i: int, value: np.ndarray, is_w: bool) -> None:
        fan_in, fan_out, k, n = self.layers[i]
        if is_w:
            host = np.zeros((n, k), dtype=np.float32)
            host[:fan_out, :fan_in] = value
            flat[offsets[i]:offsets[i] + n * k] = self.cp.asarray(host.reshape(-1))
        else:
            host = np.zeros(n, dtype=np.float32)
            host[:fan_out] = value
            flat[offsets[i]:offsets[i] + n] = self.cp.asarray(host)

    def get_params(self) -> dict[str, np.ndarray]:
        out = {}
        for i in range(self.n_layers):
            out[f"W{i}"] = self._padded(self.w_all, self.w_off, i, True)
            out[f"b{i}"] = self._padded(self.b_all, self.b_off, i, False)
        return out

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        params = check_params(self.spec, params)
        try:
            for i in range(self.n_layers):
                self._upload_padded(self.w_all, self.w_off, i, params[f"W{i}"], True)
                self._upload_padded(self.b_all, self.b_off, i, params[f"b{i}"], False)
        except _device_errors(self.cp) as exc:
            raise LaunchError(f"uploading parameters failed: {exc}") from exc
        for i in range(self.n_layers):  # refresh the fp16 images the kernels read
            self._optimize_layer(i, 2, 0, None, None, 0.0)

    def get_optimizer_state(self) -> dict[str, np.ndarray]:
        state: dict[str, np.ndarray] = {}
        slots = ("m", "v") if self.spec.optimizer.otype == "Adam" else ("velocity",)
        for j, slot in enumerate(slots):
            for i in range(self.n_layers):
                state[f"{slot}.W{i}"] = self._padded(self.slot_w[j], self.w_off, i, True)
                state[f"{slot}.b{i}"] = self._padded(self.slot_b[j], self.b_off, i, False)
        state["step"] = np.array([self.step_count], dtype=np.int64)
        return state

    def set_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        expected = optimizer_state_names(self.spec)
        shapes = {**{f"W{i}": (fo, fi) for i, (fi, fo, _, _) in enumerate(self.layers)},
                  **{f"b{i}": (fo,) for i, (_, fo, _, _) in enumerate(self.layers)}}
        for name in expected:
            if name not in state or np.shape(state[name]) != shapes[name.split(".", 1)[1]]:
                raise InvalidInput(f"optimizer state {name} is missing or has the wrong shape")
        if "step" not in state:
            raise InvalidInput("optimizer state lacks 'step'")
        slots = ("m", "v") if self.spec.optimizer.otype == "Adam" else ("velocity",)
        for j, slot in enumerate(slots):
            for i in range(self.n_layers):
                self._upload_padded(self.slot_w[j], self.w_off, i, np.asarray(state[f"{slot}.W{i}"], np.float32), True)
                self._upload_padded(self.slot_b[j], self.b_off, i, np.asarray(state[f"{slot}.b{i}"], np.float32), False)
        self.step_count = int(np.asarray(state["step"]).reshape(-1)[0])

    def device_bytes(self) -> int:
        arrays = [self.w_all, self.b_all, self.wimage, *self.slot_w, *self.slot_b]
        for ws in self._workspace.values():
            arrays += [v for v in ws.values() if isinstance(v, self.cp.ndarray)]
        return int(sum(a.nbytes for a in arrays))

    def close(self) -> None:
        self._workspace.clear()
        for name in ("w_all", "b_all", "wimage", "slot_w", "slot_b", "dummy"):
            if hasattr(self, name):
                delattr(self, name)


# -- the wgmma model -----------------------------------------------------------------------------
def next_pow2(n: int, least: int) -> int:
    return max(least, 1 << (int(n) - 1).bit_length())


def kmajor_swizzle(k: int) -> int:
    """Swizzle bytes of a K-major fp16 tile with K columns: the widest atom K fills (K >= 16)."""
    return min(128, 2 * k)


def master_offsets(layers: list[tuple[int, int, int, int]]) -> tuple[list[int], list[int]]:
    """Where each layer's fp32 master W (n x k, row-major) and b (n) start in the mma model's
    flat ``w_all`` / ``b_all`` (layers as MmaPlan.layers: fan_in, fan_out, k, n)."""
    w_off, b_off, ow, ob = [], [], 0, 0
    for _, _, k, n in layers:
        w_off.append(ow)
        b_off.append(ob)
        ow += n * k
        ob += n
    return w_off, b_off


def _align(n: int, to: int = WGMMA_ALIGN) -> int:
    return (n + to - 1) // to * to


class WgmmaPlan:
    """Geometry, shared-memory plan, weight-image maps and source of one spec's wgmma forward
    kernel (needs no GPU, no CuPy).

    Widths are padded to powers of two (input K >= 16, hidden N = K >= 16, output N >= 8): the
    layouts module's wgmma operand layouts are defined for those. Each layer's weights form a
    K-major tile of N rows (fan_out) x K cols (fan_in) with the widest swizzle K fills; the
    images sit back to back, each on a 1024-byte boundary.
    """

    def __init__(self, spec: MLPSpec, smem_limit: int = WGMMA_SMEM_LIMIT, warpgroups: int | None = None,
                 stages: int | None = None):
        if spec.precision != "fp16":
            raise SpecError("precision", f"the cuda wgmma variant computes in fp16; got {spec.precision!r}")
        if warpgroups not in (None, 1, 2):
            raise SpecError("warpgroups", f"the wgmma kernel runs 1 or 2 warpgroups per block; got {warpgroups!r}")
        if stages not in (None, 0, 1, 2):
            raise SpecError("stages", f"the wgmma kernel prefetches 0, 1 or 2 input tiles per warpgroup; got {stages!r}")
        self.spec = spec
        self.nin = spec.n_encoded_dims
        self.kin_p = next_pow2(self.nin, 16)
        self.wp = next_pow2(spec.n_neurons, 16)
        self.nout_p = next_pow2(spec.n_output_dims, 8)
        self.n_hidden = spec.n_hidden_layers
        self.swz_in, self.swz_w = kmajor_swizzle(self.kin_p), kmajor_swizzle(self.wp)
        # (fan_in, fan_out, K, N, swizzle bytes, byte offset in the image) per layer
        self.layers = []
        offset = 0
        for i, (fan_in, fan_out) in enumerate(spec.layer_dims):
            k = self.kin_p if i == 0 else self.wp
            n = self.nout_p if i == self.n_hidden else self.wp
            self.layers.append((fan_in, fan_out, k, n, kmajor_swizzle(k), offset))
            offset = _align(offset + n * k * 2)
        self.w_total_bytes = offset
        self.b_offsets = [i * self.wp for i in range(self.n_hidden)] + [self.n_hidden * self.wp]
        self.b_total = self.n_hidden * self.wp + self.nout_p
        self._plan_shared_memory(smem_limit, warpgroups, stages)
        self.source = self._source()

    def _plan_shared_memory(self, limit: int, warpgroups: int | None, stages: int | None) -> None:
        """The first that fits of: resident weights shared by two warpgroups (each with its own
        input tile, and two, one or no next tiles prefetched), by one warpgroup, then one layer's
        weights at a time (one warpgroup: the stage is refilled for every layer of every tile).

        Two prefetched tiles per warpgroup: ncu (run 16) found the forward waiting on memory —
        DRAM at 61-69% of its peak, no eligible warp in 64-68% of the cycles, 16 warps per SM
        with one 64-row input tile in flight per warpgroup. Only where two blocks still fit on
        an SM: M's second ring tile left one block per SM and took 12% off (run 17), S gained 5%.
        """
        self.a_bytes = _align(WGMMA_TILE_ROWS * self.kin_p * 2)
        self.x_bytes = _align(WGMMA_TILE_ROWS * self.nin * 4)
        b_bytes = _align(self.b_total * 4)
        stage = max(_align(n * k * 2) for _, _, k, n, _, _ in self.layers)
        # (weights resident, warpgroups, prefetched input tiles per warpgroup); streamed weights
        # wait for all copies per layer, so a second prefetched tile would not stay in flight there
        choices = [(True, wgs, x) for wgs in (2, 1) for x in (2, 1, 0)]
        choices += [(False, 1, 1), (False, 1, 0)]
        tried = []
        for resident, wgs, x_stages in choices:
            if warpgroups is not None and wgs != warpgroups:
                continue
            if stages is not None and x_stages not in (0, stages):
                continue
            w_bytes = self.w_total_bytes if resident else stage
            total = w_bytes + wgs * self.a_bytes + b_bytes + wgs * x_stages * self.x_bytes + WGMMA_ALIGN
            tried.append(total)
            if x_stages == 2 and stages is None and 2 * (total + 1024) > WGMMA_SMEM_PER_SM:
                continue  # the second ring tile would cost a resident block
            if total <= limit:
                self.w_resident, self.warpgroups, self.input_staged = resident, wgs, x_stages > 0
                self.x_stages = max(x_stages, 1)
                self.sm_a_off = w_bytes
                self.sm_b_off = w_bytes + wgs * self.a_bytes
                self.sm_x_off = self.sm_b_off + b_bytes
                self.smem_bytes = total
                return
        raise SpecError("network.n_neurons",
                        f"the cuda wgmma variant needs {min(tried)} bytes of shared memory for this model "
                        f"({warpgroups or 'any number of'} warpgroups); the limit is {limit}")

    def smem_layouts(self) -> list[L.LinearLayout]:
        """Each layer's weight image: offset (halves) -> (row = n, col = k)."""
        return [L.wgmma_smem_operand(n, k, "K", swz) for _, _, k, n, swz, _ in self.layers]

    def descriptors(self, i: int) -> list[L.WgmmaDescriptor]:
        """The B descriptors (one per k16 step) of layer i, relative to the layer's image."""
        _, _, k, n, swz, _ = self.layers[i]
        return [L.wgmma_smem_descriptor(n, k, "K", swz, col0=16 * s) for s in range(k // 16)]

    def weight_map(self, w_off: list[int], k_master: list[int]) -> np.ndarray:
        """Image half -> index into the fp32 master ``w_all`` (-1: zero padding).

        ``w_off[i]`` is layer i's start in ``w_all`` and ``k_master[i]`` its row length there.
        """
        image = np.full(self.w_total_bytes // 2, -1, dtype=np.int32)
        for i, ((fan_in, fan_out, k, n, _, offset), layout) in enumerate(zip(self.layers, self.smem_layouts())):
            source = np.full((n, k), -1, dtype=np.int32)
            rows, cols = np.meshgrid(np.arange(fan_out), np.arange(fan_in), indexing="ij")
            source[:fan_out, :fan_in] = w_off[i] + rows * k_master[i] + cols
            image[offset // 2: offset // 2 + n * k] = L.pack(source, layout)
        return image

    def bias_map(self, b_off: list[int]) -> np.ndarray:
        """Bias image float -> index into the fp32 master ``b_all`` (-1: zero padding)."""
        image = np.full(self.b_total, -1, dtype=np.int32)
        for i, (_, fan_out, _, _, _, _) in enumerate(self.layers):
            image[self.b_offsets[i]: self.b_offsets[i] + fan_out] = b_off[i] + np.arange(fan_out)
        return image

    def host_images(self, params: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(fp16 weight image as uint16, fp32 bias image) exactly as ``wgmma_pack`` builds them
        on the device from the mma model's padded fp32 masters (for tests and inspection)."""
        mma_layers = MmaPlan(self.spec).layers
        w_off, b_off = master_offsets(mma_layers)
        w_all = np.zeros(sum(n * k for _, _, k, n in mma_layers), dtype=np.float32)
        b_all = np.zeros(sum(n for _, _, _, n in mma_layers), dtype=np.float32)
        for i, (fan_in, fan_out, k, n) in enumerate(mma_layers):
            w_all[w_off[i]: w_off[i] + n * k].reshape(n, k)[:fan_out, :fan_in] = params[f"W{i}"]
            b_all[b_off[i]: b_off[i] + fan_out] = params[f"b{i}"]
        wmap = self.weight_map(w_off, [k for _, _, k, _ in mma_layers])
        bmap = self.bias_map(b_off)
        image = np.where(wmap >= 0, w_all[np.maximum(wmap, 0)], 0).astype(np.float16).view(np.uint16)
        return image, np.where(bmap >= 0, b_all[np.maximum(bmap, 0)], 0).astype(np.float32)

    def _wrappers(self) -> str:
        """The wgmma instructions the kernel issues, as inline-PTX functions (N/2 accumulators)."""

        def wrapper(name: str, n: int, a_from_registers: bool) -> str:
            nd = n // 2
            outs = ", ".join(f'"+f"(d[{i}])' for i in range(nd))
            regs = ", ".join(f"%{i}" for i in range(nd))
            if a_from_registers:
                a_ops, b, p = f"{{%{nd}, %{nd + 1}, %{nd + 2}, %{nd + 3}}}", nd + 4, nd + 5
                ins = '"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d)'
                sig, imm = "float* d, const u32* a, unsigned long long desc_b, int scale_d", "1, 1, 0"
            else:
                a_ops, b, p = f"%{nd}", nd + 1, nd + 2
                ins = '"l"(desc_a), "l"(desc_b), "r"(scale_d)'
                sig, imm = "float* d, unsigned long long desc_a, unsigned long long desc_b, int scale_d", "1, 1, 0, 0"
            return (f"__device__ __forceinline__ void {name}({sig}) {{\n"
                    f'    asm volatile("{{.reg .pred p; setp.ne.b32 p, %{p}, 0;\\n"\n'
                    f'                 "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {{{regs}}}, {a_ops}, %{b}, p, {imm};}}"\n'
                    f"                 : {outs}\n"
                    f"                 : {ins} : \"memory\");\n}}\n")

        return (wrapper("wgmma_ss_n_hidden", self.wp, False) + wrapper("wgmma_rs_n_hidden", self.wp, True)
                + wrapper("wgmma_rs_n_out", self.nout_p, True))

    def _source(self) -> str:
        s = self.spec
        defines = {
            "NIN": self.nin, "KIN_P": self.kin_p, "SWZ_IN": self.swz_in, "WP": self.wp, "SWZ_W": self.swz_w,
            "NHID": self.n_hidden, "NOUT": s.n_output_dims, "NOUT_P": self.nout_p,
            "ACT": ACT_CODES[s.activation], "OUT_ACT": ACT_CODES[s.output_activation],
            "LOSS": LOSS_CODES[s.loss], "HUBER_DELTA": f"{float(np.float32(s.huber_delta))!r}f",
            "W_RESIDENT": int(self.w_resident), "INPUT_STAGED": int(self.input_staged), "WGS": self.warpgroups,
            "W_BYTES0": self.layers[0][2] * self.layers[0][3] * 2,
            "W_OFF1": self.layers[1][5] if self.n_hidden > 1 else 0,
            "W_HID_STRIDE": _align(self.wp * self.wp * 2),
            "W_OFF_OUT": self.layers[-1][5], "W_TOTAL_BYTES": self.w_total_bytes, "B_TOTAL": self.b_total,
            "SM_A_OFF": self.sm_a_off, "A_BYTES": self.a_bytes, "SM_B_OFF": self.sm_b_off,
            "SM_X_OFF": self.sm_x_off, "X_BYTES": self.x_bytes, "X_STAGES": self.x_stages,
            "MIN_BLOCKS": _env_choice(WGMMA_MIN_BLOCKS_ENV, (1, 2, 3, 4), 1),
        }
        head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
        return (head + read_source("cuda/mlp_common.cuh") + read_source("cuda/wgmma_layout.cuh")
                + self._wrappers() + read_source("cuda/mlp_wgmma.cu"))


class CudaWgmmaModel(CudaMmaModel):
    """The wgmma forward kernel on the mma model's parameters; training is the mma variant's.

    The fp16 weight image and fp32 bias image the forward kernel copies into shared memory are
    gathered on the device from the fp32 masters (``wgmma_pack``, through maps built on the
    host) whenever the parameters changed since the last forward.
    """

    variant = "wgmma"

    def __init__(self, spec: MLPSpec, cp, info: dict[str, Any], cache: KernelCache | None):
        forced = _env_choice(WGMMA_WARPGROUPS_ENV, (1, 2), 0)  # measuring 1 against 2; 0: the plan decides
        stages = _env_choice(WGMMA_STAGES_ENV, (0, 1, 2), -1)  # measuring; -1 (unset): the plan decides
        self.wg = WgmmaPlan(spec, smem_limit=info["smem_optin"], warpgroups=forced or None,
                            stages=None if stages < 0 else stages)
        self._wg_stale = True
        super().__init__(spec, cp, info, cache)
        self._wg_module = self._build_wgmma(cache)
        try:
            self.wg_wmap = cp.asarray(self.wg.weight_map(self.w_off, [k for _, _, k, _ in self.layers]))
            self.wg_bmap = cp.asarray(self.wg.bias_map(self.b_off))
            self.wg_wimage = cp.zeros(self.wg.w_total_bytes // 2, dtype=cp.uint16)
            self.wg_bimage = cp.zeros(self.wg.b_total, dtype=cp.float32)
        except _device_errors(cp) as exc:
            raise LaunchError(f"allocating the wgmma weight images failed: {exc}") from exc

    def _build_wgmma(self, cache: KernelCache | None) -> LoadedModule:
        what = f"wgmma kernels for model {self.spec.content_hash()} ({self.describe()})"
        source = self.wg.source

        def build() -> bytes:
            return nvcc_compile(source, WGMMA_NVCC_OPTIONS, what)

        nvcc = find_nvcc()
        compiler = f"nvcc-{nvcc_version(nvcc)}" if nvcc else "nvcc-missing"
        cubin = build() if cache is None else cache.get_or_build(
            build, backend="cuda-wgmma", device="sm_90a", compiler=compiler, options=list(WGMMA_NVCC_OPTIONS),
            source=source)
        try:
            module = LoadedModule(self.cp, cubin, WGMMA_KERNELS)
            fwd = module.kernel("wgmma_forward")
            if self.wg.smem_bytes > 48 * 1024:
                fwd.max_dynamic_shared_size_bytes = self.wg.smem_bytes
        except _device_errors(self.cp) as exc:
            raise LaunchError(f"loading the compiled {what} failed: {exc}") from exc
        threads = WGMMA_THREADS * self.wg.warpgroups
        regs_per_block = math.ceil(max(int(fwd.num_regs), 1) * 32 / 256) * 256 * (threads // 32)
        per_sm = min(self.info["regs_per_sm"] // regs_per_block,
                     self.info["smem_per_sm"] // (self.wg.smem_bytes + 1024), 2048 // threads)
        self.wg_grid = max(1, per_sm) * self.info["sm_count"]
        return module

    def _launch_wgmma(self, name: str, grid, block, args, smem: int = 0) -> None:
        try:
            self._wg_module.kernel(name)(grid, block, args, shared_mem=smem)
        except _device_errors(self.cp) as exc:
            raise LaunchError(f"launching {name} failed: {exc}") from exc

    def _refresh_images(self) -> None:
        if not self._wg_stale:
            return
        n, n_b = self.wg_wimage.size, self.wg_bimage.size
        self._launch_wgmma("wgmma_pack", (math.ceil(max(n, n_b) / 256),), (256,),
                           (self.w_all, self.wg_wmap, self.wg_wimage, np.int32(n), self.b_all, self.wg_bmap,
                            self.wg_bimage, np.int32(n_b)))
        self._wg_stale = False

    def forward(self, x: Any, out_dtype: Any = np.float32) -> Any:
        """fp32 in and out in the kernel; ``out_dtype`` float16 casts the result (the wgmma kernel
        has no fp16-I/O form yet)."""
        cp = self.cp
        half_out = _half_output(out_dtype)
        dx, from_host = self._device_input(x, self.spec.n_input_dims, "input", encode=True)
        rows = dx.shape[0]
        out = cp.empty((rows, self.spec.n_output_dims), dtype=cp.float32)
        if rows:
            if dx.data.ptr % 16:  # cp.async moves 16-byte units: a view at an odd offset is copied
                dx = dx.copy()
            self._refresh_images()
            n_tiles = math.ceil(rows / WGMMA_TILE_ROWS)
            blocks = min(self.wg_grid, math.ceil(n_tiles / self.wg.warpgroups))
            self._launch_wgmma("wgmma_forward", (blocks,), (WGMMA_THREADS * self.wg.warpgroups,),
                               (dx, np.int64(rows), np.int64(n_tiles), out, self.wg_wimage, self.wg_bimage),
                               self.wg.smem_bytes)
        if half_out:
            out = out.astype(cp.float16)
        return self.download(out) if from_host else out

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        super().set_params(params)
        self._wg_stale = True

    def train_step(self, x: Any, y: Any, steps: int = 1) -> np.ndarray:
        self._wg_stale = True  # set first: a step that fails half way may have changed weights
        return super().train_step(x, y, steps)

    def device_bytes(self) -> int:
        return super().device_bytes() + int(sum(a.nbytes for a in (self.wg_wmap, self.wg_bmap, self.wg_wimage,
                                                                      self.wg_bimage)))

    def close(self) -> None:
        super().close()
        for name in ("wg_wmap", "wg_bmap", "wg_wimage", "wg_bimage"):
            if hasattr(self, name):
                delattr(self, name)


# -- the cuBLASLt model (nvmath-python) ----------------------------------------------------------
def cublaslt_availability() -> tuple[bool, str, str]:
    """(usable, reason when not, nvmath version)."""
    try:
        import nvmath
        from nvmath.linalg.advanced import Matmul, MatmulEpilog  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA library it could not load
        return False, f"nvmath-python is not importable ({type(exc).__name__}: {exc})", ""
    return True, "", getattr(nvmath, "__version__", "?")


EW_KERNELS = ("ew_half", "ew_hidden", "ew_output", "ew_loss", "ew_backward", "ew_colsum", "ew_optimize")
COLSUM_ROWS = 1024  # rows per partial sum of ew_colsum (SUM_ROWS in mlp_elementwise.cu)


class CublasLtModel(CompiledModel):
    """Per-layer cuBLASLt matmuls (nvmath-python, planned once per shape) + element-wise kernels.

    Each layer is ``h_{l+1}^T = act(W_l @ h_l^T + b_l)`` (W as A) so that cuBLASLt's bias runs
    along M: ReLU hidden layers use the RELU_BIAS epilog (fp16 out; its bias is the fp16 copy of
    the fp32 master), other hidden layers and the output layer an fp32 result type with the BIAS
    epilog (fp32 bias; no C operand to read) and finish in ``shaders/cuda/mlp_elementwise.cu``.
    Backward: input gradients ``W^T @ delta`` and weight gradients ``h @ delta^T`` (= dW^T, so
    that dW comes out row-major like W) as fp32 matmuls (fp32 zero C), bias gradients by
    ``ew_colsum`` plus a CuPy sum of its partials (fixed order), then the optimizer kernel.

    Layout: every activation, pre-activation and delta is an (features, rows) array in F order,
    i.e. row-major [rows][features] memory. That is the order nvmath gives D whenever a C operand
    is passed (D follows C, and an (M, 1) C counts as column-major) or a bias epilog is used
    (column-major D), so results are used as they come. (Run 7 found the first version, with
    C-order activations, copying every matmul result into C order: a W layer took 6.4 ms in the
    model against 0.35 ms alone.) The fp16 input is the fp32 input cast, and the output and loss
    kernels read [rows][outputs] like the targets and the result. ``_mm`` raises if a result ever
    comes back in another layout rather than copying it.
    """

    backend = "cuda"
    variant = "cublaslt"

    def __init__(self, spec: MLPSpec, cp, info: dict[str, Any], cache: KernelCache | None):
        super().__init__(spec)
        if spec.precision != "fp16":
            raise SpecError("precision", f"the cuda cublaslt variant computes in fp16; got {spec.precision!r}")
        from nvmath.linalg.advanced import Matmul, MatmulEpilog

        from nvmath import CudaDataType

        self._matmul_cls, self._epilog = Matmul, MatmulEpilog
        self._f32_type = CudaDataType.CUDA_R_32F
        self._f32_result: bool | None = None  # fp32 result type + BIAS epilog: untried / works / refused
        self.cp, self.info = cp, info
        self.layers = spec.layer_dims  # (fan_in, fan_out)
        self.n_layers = len(self.layers)
        self.relu_epilog = spec.activation == "ReLU"
        self.store_dact = spec.activation not in DERIVATIVE_FROM_OUTPUT
        self.source = self._source()
        self.arch_digits = f"{info['cc'][0]}{info['cc'][1]}"
        self.options = ("-std=c++17",)
        what = f"cuBLASLt element-wise kernels for model {spec.content_hash()}"

        def build() -> bytes:
            return nvrtc_compile(self.source, self.arch_digits, self.options, what)

        cubin = build() if cache is None else cache.get_or_build(
            build, backend="cuda-cublaslt", device=f"sm_{self.arch_digits}", compiler=f"nvrtc-{_nvrtc_version()}",
            options=list(self.options), source=self.source)
        try:
            self._module = LoadedModule(cp, cubin, EW_KERNELS)
            self.w = [cp.zeros((fo, fi), dtype=cp.float32) for fi, fo in self.layers]
            self.b = [cp.zeros(fo, dtype=cp.float32) for _, fo in self.layers]
            self.w16 = [cp.zeros((fo, fi), dtype=cp.float16) for fi, fo in self.layers]
            self.b16 = [cp.zeros(fo, dtype=cp.float16) for _, fo in self.layers]
            n_slots = 2 if spec.optimizer.otype == "Adam" else 1
            self.slot_w = [[cp.zeros_like(w) for w in self.w] for _ in range(n_slots)]
            self.slot_b = [[cp.zeros_like(b) for b in self.b] for _ in range(n_slots)]
            # fp32 C (zeros) for the backward matmuls: fp16 operands with an fp32 C give an fp32 D
            self.zero_cols = {fi: cp.zeros((fi, 1), dtype=cp.float32) for fi, _ in self.layers}
        except _device_errors(cp) as exc:
            raise LaunchError(f"setting up the cuBLASLt model failed: {exc}") from exc
        self._plans: dict[tuple, Any] = {}
        self.set_params(init_params(spec))

    def _source(self) -> str:
        s, opt = self.spec, self.spec.optimizer

        def f32(v: float) -> str:
            return f"{float(np.float32(v))!r}f"

        defines = {
            "NIN": s.n_encoded_dims, "NOUT": s.n_output_dims, "ACT": ACT_CODES[s.activation],
            "OUT_ACT": ACT_CODES[s.output_activation], "LOSS": LOSS_CODES[s.loss],
            "HUBER_DELTA": f32(s.huber_delta), "STORE_DACT": int(self.store_dact),
            "OPT_ADAM": int(opt.otype == "Adam"), "LR": f32(opt.learning_rate), "BETA1": f32(opt.beta1),
            "BETA2": f32(opt.beta2), "EPS": f32(opt.epsilon), "L2REG": f32(opt.l2_reg),
            "MOMENTUM": f32(opt.momentum),
        }
        head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
        return head + read_source("cuda/mlp_common.cuh") + read_source("cuda/mlp_elementwise.cu")

    # -- plumbing ---------------------------------------------------------------------------------
    def _launch(self, name: str, grid, block, args) -> None:
        try:
            self._module.kernel(name)(grid, block, args)
        except _device_errors(self.cp) as exc:
            raise LaunchError(f"launching {name} failed: {exc}") from exc

    def _mm_bias32(self, key: tuple, w16, h, bias):
        """fp32 ``w16 @ h + bias``: an fp32 result type with the BIAS epilog, so no C is read
        (an fp32 C broadcast along N, the other way to get fp32 out of fp16 operands, took 2.5x
        the time of an fp16 layer in run 12). Where nvmath/cuBLASLt refuse that combination, the
        broadcast C, with a warning naming the reason."""
        if self._f32_result is not False:
            try:
                out = self._mm(key, w16, h, epilog=self._epilog.BIAS, epilog_inputs={"bias": bias},
                               options={"result_type": self._f32_type})
                self._f32_result = True
                return out
            except LaunchError as exc:
                if self._f32_result is True:  # it worked before: this is a real failure
                    raise
                self._f32_result = False
                self._plans.pop(key, None)
                log.warning("cublaslt: fp32 results with the BIAS epilog are refused here (%s); using an fp32 C "
                            "broadcast along N instead", exc)
        return self._mm(key, w16, h, c=bias.reshape(-1, 1))

    def _mm(self, key: tuple, a, b, c=None, epilog=None, epilog_inputs=None, options=None):
        """a @ b (+ c, broadcast along N) through a Matmul planned once per key (shapes fixed);
        the result as nvmath returns it, which must be F-contiguous (see the class docstring)."""
        kind, layer, rows = key
        try:
            mm = self._plans.get(key)
            if mm is None:
                if any(k[2] != rows for k in self._plans):  # plans of one batch size at a time
                    self._free_plans()
                mm = self._matmul_cls(a, b, c=c, beta=None if c is None else 1.0, options=options)
                mm.plan(epilog=epilog, epilog_inputs=epilog_inputs)
                self._plans[key] = mm
            else:
                mm.reset_operands(a=a, b=b, c=c, epilog_inputs=epilog_inputs)
            result = mm.execute()
        except _device_errors(self.cp) as exc:
            raise LaunchError(f"cuBLASLt matmul ({kind}, layer {layer}, {rows} rows) failed: {exc}") from exc
        except Exception as exc:  # nvmath reports unsupported shapes, types or epilogs as ValueError & co.
            raise LaunchError(f"cuBLASLt matmul ({kind}, layer {layer}, {rows} rows) was refused by "
                              f"nvmath-python: {type(exc).__name__}: {exc}") from exc
        out = result[0] if isinstance(result, tuple) else result
        if not out.flags.f_contiguous:  # a copy here would cost more than the matmul itself
            raise LaunchError(f"cuBLASLt matmul ({kind}, layer {layer}, {rows} rows) returned a {out.shape} result "
                              f"with strides {out.strides}; the cublaslt model needs it F-contiguous")
        return out

    def _free_plans(self) -> None:
        for mm in self._plans.values():
            try:
                mm.free()
            except Exception:  # freeing is best effort; the plan is dropped either way
                pass
        self._plans.clear()

    def _forward_t(self, dx, rows: int, train: bool, half_out: bool = False):
        """Output pre-activations z^T (n_out, rows) fp32 (``half_out``: fp16, bias added by the
        matmul), each layer's input h^T, stored derivatives; all F-order (row-major memory)."""
        cp = self.cp
        if dx.dtype == cp.float16:
            h16 = dx
        else:
            h16 = cp.empty(dx.shape, dtype=cp.float16)  # dx is [rows][n_in]: h^T is its F-order view
            self._launch("ew_half", (max(1, math.ceil(dx.size / 1024)),), (256,), (dx, np.int64(dx.size), h16))
        h = h16.T
        hs, dacts = [h], []
        for i in range(self.n_layers - 1):
            fo = self.layers[i][1]
            if self.relu_epilog:
                h = self._mm(("fwd", i, rows), self.w16[i], h, epilog=self._epilog.RELU_BIAS,
                             epilog_inputs={"bias": self.b16[i]})
            else:
                z = self._mm_bias32(("fwd", i, rows), self.w16[i], h, self.b[i])
                h = cp.empty((fo, rows), dtype=cp.float16, order="F")
                dact = cp.empty((fo, rows), dtype=cp.float16, order="F") if (train and self.store_dact) else h
                self._launch("ew_hidden", (math.ceil(z.size / 256),), (256,),
                             (z, np.int64(z.size), h, dact, np.int32(train)))
                dacts.append(dact)
            hs.append(h)
        last = self.n_layers - 1
        if half_out:
            zt = self._mm(("fwd16", last, rows), self.w16[last], h, epilog=self._epilog.BIAS,
                          epilog_inputs={"bias": self.b16[last]})
        else:
            zt = self._mm_bias32(("fwd", last, rows), self.w16[last], h, self.b[last])
        return zt, hs, dacts

    # -- host <-> device ----------------------------------------------------------------------------
    upload = CudaMmaModel.upload
    forward_to_host = CudaMmaModel.forward_to_host
    download = CudaMmaModel.download
    synchronize = CudaMmaModel.synchronize
    _device_input = CudaMmaModel._device_input
    _prepare_batch = CudaMmaModel._prepare_batch

    # -- compute ------------------------------------------------------------------------------------
    def forward(self, x: Any, out_dtype: Any = np.float32) -> Any:
        """See ``CompiledModel.forward``. ``out_dtype`` float16: without an output activation the
        output layer's matmul writes fp16 itself (BIAS epilog, the fp16 bias); fp16 device inputs
        are used as the first layer's operand without a cast."""
        cp = self.cp
        half_out = _half_output(out_dtype)
        dx, from_host = self._device_input(x, self.spec.n_input_dims, "input", encode=True, keep_half=half_out)
        rows = dx.shape[0]
        if not rows:
            out = cp.empty((0, self.spec.n_output_dims), dtype=cp.float16 if half_out else cp.float32)
        elif self.spec.output_activation == "None":
            # z^T in F order is out, C order
            out = self._forward_t(dx, rows, train=False, half_out=half_out)[0].T
        else:
            zt, _, _ = self._forward_t(dx, rows, train=False)  # [rows][n_out] memory, like out
            out = cp.empty((rows, self.spec.n_output_dims), dtype=cp.float32)
            self._launch("ew_output", (math.ceil(zt.size / 256),), (256,), (zt, np.int64(zt.size), out))
            if half_out:
                out = out.astype(cp.float16)
        return self.download(out) if from_host else out

    def _grads(self, dx, dy, rows: int, on_layer) -> Any:
        """Forward, loss, backward; ``on_layer(i, dW, db)`` once per layer, last first."""
        cp = self.cp
        n_out = self.spec.n_output_dims
        zt, hs, dacts = self._forward_t(dx, rows, train=True)
        # zt, dy (rows x n_out, C order), delta and values all hold [rows][n_out]
        delta = cp.empty((n_out, rows), dtype=cp.float16, order="F")
        values = cp.empty((n_out, rows), dtype=cp.float32, order="F")
        grad_scale = np.float32(self.spec.loss_scale / (rows * n_out))
        self._launch("ew_loss", (math.ceil(zt.size / 256),), (256,),
                     (zt, dy, np.int64(zt.size), grad_scale, delta, values))
        loss = values.sum(dtype=cp.float64)
        chunks = math.ceil(rows / COLSUM_ROWS)
        for i in reversed(range(self.n_layers)):
            fi, fo = self.layers[i]
            # dW^T = h @ delta^T, (fi, fo) F-contiguous: its transpose is dW row-major, like W
            dw = self._mm(("wgrad", i, rows), hs[i], delta.T, c=self.zero_cols[fi]).T
            # a CuPy sum over the strided rows axis would run on a handful of blocks
            partial = cp.empty((chunks, fo), dtype=cp.float32)
            self._launch("ew_colsum", (chunks, math.ceil(fo / 32)), (32, 8),  # block (TILE, SUM_LANES)
                         (delta, np.int64(rows), np.int32(fo), partial))
            db = partial.sum(axis=0)
            if i > 0:  # the input gradient uses this layer's weights before the update below
                g = self._mm(("dgrad", i, rows), self.w16[i].T, delta, c=self.zero_cols[fi])
                stored = dacts[i - 1] if self.store_dact else hs[i]
                delta = cp.empty((fi, rows), dtype=cp.float16, order="F")
                self._launch("ew_backward", (math.ceil(g.size / 256),), (256,),
                             (g, stored, np.int64(g.size), delta))
            on_layer(i, dw, db)
        return loss

    def _optimize(self, i: int, mode: int, dw, db, lr_t: float) -> None:
        w, b = self.w[i], self.b[i]
        s1w, s1b = self.slot_w[0][i], self.slot_b[0][i]
        s2w, s2b = self.slot_w[-1][i], self.slot_b[-1][i]
        total = w.size + b.size
        self._launch("ew_optimize", (math.ceil(total / 256),), (256,),
                     (np.int32(mode), np.int32(w.size), np.int32(b.size), w, b,
                      w if dw is None else dw, b if db is None else db, s1w, s1b, s2w, s2b,
                      self.w16[i], self.b16[i], np.float32(lr_t), np.float32(1.0 / self.spec.loss_scale)))

    def train_step(self, x: Any, y: Any, steps: int = 1) -> np.ndarray:
        if steps < 1:
            raise InvalidInput(f"steps must be at least 1; got {steps}")
        dx, dy, rows = self._prepare_batch(x, y)
        opt = self.spec.optimizer
        losses = self.cp.zeros(steps, dtype=self.cp.float64)
        for s in range(steps):
            step = self.step_count + 1
            lr_t = opt.learning_rate * math.sqrt(1 - opt.beta2 ** step) / (1 - opt.beta1 ** step) \
                if opt.otype == "Adam" else opt.learning_rate
            losses[s] = self._grads(dx, dy, rows, lambda i, dw, db: self._optimize(i, 0, dw, db, lr_t))
            self.step_count = step
        return (self.download(losses) / (rows * self.spec.n_output_dims)).astype(np.float32)

    def loss_and_grads(self, x: Any, y: Any) -> tuple[float, dict[str, np.ndarray]]:
        dx, dy, rows = self._prepare_batch(x, y)
        grads: dict[str, np.ndarray] = {}

        def keep(i: int, dw, db) -> None:
            grads[f"W{i}"] = self.download(dw) / np.float32(self.spec.loss_scale)
            grads[f"b{i}"] = self.download(db) / np.float32(self.spec.loss_scale)

        loss = self._grads(dx, dy, rows, keep)
        value = float(self.download(loss)) / (rows * self.spec.n_output_dims)
        return value, {k: grads[k] for k in sorted(grads, key=lambda s: (int(s[1:]), s[0]))}

    # -- parameters ---------------------------------------------------------------------------------
    def get_params(self) -> dict[str, np.ndarray]:
        out = {}
        for i in range(self.n_layers):
            out[f"W{i}"] = self.download(self.w[i])
            out[f"b{i}"] = self.download(self.b[i])
        return out

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        params = check_params(self.spec, params)
        try:
            for i in range(self.n_layers):
                self.w[i][...] = self.cp.asarray(params[f"W{i}"])
                self.b[i][...] = self.cp.asarray(params[f"b{i}"])
        except _device_errors(self.cp) as exc:
            raise LaunchError(f"uploading parameters failed: {exc}") from exc
        for i in range(self.n_layers):
            self._optimize(i, 2, None, None, 0.0)

    def _slot_names(self) -> tuple[str, ...]:
        return ("m", "v") if self.spec.optimizer.otype == "Adam" else ("velocity",)

    def get_optimizer_state(self) -> dict[str, np.ndarray]:
        state: dict[str, np.ndarray] = {}
        for j, slot in enumerate(self._slot_names()):
            for i in range(self.n_layers):
                state[f"{slot}.W{i}"] = self.download(self.slot_w[j][i])
                state[f"{slot}.b{i}"] = self.download(self.slot_b[j][i])
        state["step"] = np.array([self.step_count], dtype=np.int64)
        return state

    def set_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        for name in optimizer_state_names(self.spec):
            slot, param = name.split(".", 1)
            j = self._slot_names().index(slot)
            i = int(param[1:])
            target = self.slot_w[j][i] if param[0] == "W" else self.slot_b[j][i]
            if name not in state or np.shape(state[name]) != target.shape:
                raise InvalidInput(f"optimizer state {name} is missing or has the wrong shape")
            target[...] = self.cp.asarray(np.asarray(state[name], dtype=np.float32))
        if "step" not in state:
            raise InvalidInput("optimizer state lacks 'step'")
        self.step_count = int(np.asarray(state["step"]).reshape(-1)[0])

    def device_bytes(self) -> int:
        arrays = [*self.w, *self.b, *self.w16, *self.b16]
        for slots in (*self.slot_w, *self.slot_b):
            arrays += slots
        return int(sum(a.nbytes for a in arrays))

    def close(self) -> None:
        self._free_plans()
        for name in ("w", "b", "w16", "b16", "slot_w", "slot_b", "zero_cols"):
            if hasattr(self, name):
                delattr(self, name)


# -- the backend ---------------------------------------------------------------------------------
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

        try:
            cp = _cupy()
        except BackendUnavailable as exc:
            return all_unavailable(exc.reason)
        try:
            count = cp.cuda.runtime.getDeviceCount()
        except Exception as exc:  # no driver, no device, broken install: all the same to the user
            return all_unavailable(f"no CUDA device is usable: {exc}")
        if count == 0:
            return all_unavailable("no CUDA device is present")
        try:
            info = device_info(cp)
            nvrtc_version = _nvrtc_version()
            api = (f"driver {_version_text(cp.cuda.runtime.driverGetVersion())}, runtime "
                   f"{_version_text(cp.cuda.runtime.runtimeGetVersion())}, NVRTC {nvrtc_version}, "
                   f"CuPy {cp.__version__}")
        except Exception as exc:
            return all_unavailable(f"querying the CUDA device failed: {type(exc).__name__}: {exc}")
        cc = info["cc"]
        common = {"device": info["name"], "api_version": api}
        details = {"compute_capability": f"{cc[0]}.{cc[1]}", "multiprocessors": info["sm_count"]}
        mma_shape = [MMAShape(16, 8, 16, scope="warp")]

        # wgmma: compute capability 9.0, then (only when asked for: slower than mma on small models)
        # nvcc builds a wgmma kernel and a child process runs it with the right result
        wg_shapes = [MMAShape(64, n, 16, scope="warpgroup") for n in (8, 16, 32, 64, 128, 256)]
        if cc != (9, 0):
            wg = ProbeRow("cuda", "wgmma", False, reason=f"wgmma needs compute capability 9.0 (sm_90a); "
                          f"this GPU is {cc[0]}.{cc[1]}", details=dict(details), **common)
        elif os.environ.get(WGMMA_ENV) != "1":
            wg = ProbeRow("cuda", "wgmma", False, reason=WGMMA_OFF, details=dict(details), **common)
        else:
            ok, why = _nvcc_runs_wgmma()
            wg = ProbeRow("cuda", "wgmma", ok, reason="" if ok else f"the sm_90a wgmma check failed: {why}",
                          details={**details, "nvcc": find_nvcc() or "missing"},
                          mma_shapes=wg_shapes if ok else [], **common)
        if cc >= (8, 0):
            mma = ProbeRow("cuda", "mma", True, mma_shapes=mma_shape,
                           details={**details, "max_width": MMA_MAX_WIDTH}, **common)
        else:
            mma = ProbeRow("cuda", "mma", False, reason=f"mma.sync m16n8k16 kernels need compute capability "
                           f"8.0 or newer; this GPU is {cc[0]}.{cc[1]}", details=dict(details), **common)
        lt_ok, lt_reason, lt_version = cublaslt_availability()
        lt = ProbeRow("cuda", "cublaslt", lt_ok, reason=lt_reason,
                      details={**details, "nvmath": lt_version}, **common)
        return [wg, mma, lt]

    @staticmethod
    def _wgmma_fits(spec: MLPSpec) -> bool:
        try:
            WgmmaPlan(spec)
        except SpecError:
            return False
        return True

    def compile(self, spec: MLPSpec, variant: str | None = None, cache: Any = None) -> CompiledModel:
        rows = {r.variant: r for r in self.probe()}
        if variant is not None and variant not in rows:
            raise SpecError("variant", f"the cuda backend has variants {', '.join(VARIANTS)}; got {variant!r}")
        if variant is None:  # wgmma where enabled and the model fits it; mma takes every width 16-256
            variant = "wgmma" if rows["wgmma"].available and self._wgmma_fits(spec) else "mma"
        row = rows[variant]
        if not row.available:
            raise BackendUnavailable(f"cuda:{variant}", row.reason)
        cp = _cupy()
        info = device_info(cp)
        if cache is None:
            cache = KernelCache()
        if variant == "mma":
            return CudaMmaModel(spec, cp, info, cache)
        if variant == "wgmma":
            return CudaWgmmaModel(spec, cp, info, cache)
        return CublasLtModel(spec, cp, info, cache)


__all__ = ["CudaBackend", "CudaMmaModel", "CudaWgmmaModel", "CublasLtModel", "MmaPlan", "WgmmaPlan", "VARIANTS",
           "nvrtc_compile", "nvcc_compile", "b_image_index"]
