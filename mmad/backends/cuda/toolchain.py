"""The CUDA toolchain and device plumbing every cuda variant shares.

Compilers (NVRTC through CuPy for the mma and element-wise kernels; nvcc for the sm_90a wgmma
kernels, which NVRTC crashed on), cubin loading, device facts, and :class:`CudaModel`: the
host<->device side of a compiled model (uploads, downloads, input checks, encodings, launches)
that the variants build on. Imports without CuPy: ``cupy_module()`` then says why nothing runs.
"""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any

import numpy as np

from mmad.backends.contract import (
    CompiledModel, Dataset, check_host_output, fill_dataset, check_rows, check_rows_shape, output_dtype,
)
from mmad.errors import BackendUnavailable, CompileError, DeviceMemoryFull, InvalidInput, LaunchError
from mmad.spec import MLPSpec

ROW_GRANULE = 128  # rows are padded to this; a multiple of every kernel's rows per warp-tile


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
        raise CompileError("the nvcc-built kernels", f"{nvcc} --version failed: {exc}") from exc
    match = re.search(r"V(\d+\.\d+\.\d+)", done.stdout)
    return match.group(1) if match else (done.stdout.strip().splitlines() or ["unknown"])[-1]


def nvcc_compile(source: str, options: tuple[str, ...], what: str) -> bytes:
    """Compile CUDA C++ to a cubin with nvcc; CompileError with the log on failure."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise CompileError(what, "nvcc was not found (PATH, CUDA_HOME, CUDA_PATH, /usr/local/cuda); "
                                 f"{what} are built with nvcc only", source)
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


def cupy_module():
    """The cupy module, or BackendUnavailable saying why not."""
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailable("cuda", f"CuPy is not installed ({exc})") from exc
    except Exception as exc:  # a broken CUDA install can fail at import time
        raise BackendUnavailable("cuda", f"CuPy failed to import: {type(exc).__name__}: {exc}") from exc
    return cupy


def nvrtc_version() -> str:
    from cupy_backends.cuda.libs import nvrtc

    return "%d.%d" % tuple(nvrtc.getVersion())


def device_errors(cp) -> tuple[type[BaseException], ...]:
    return (cp.cuda.driver.CUDADriverError, cp.cuda.runtime.CUDARuntimeError,
            cp.cuda.memory.OutOfMemoryError)


def version_text(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def nvrtc_compile(source: str, arch: str, options: tuple[str, ...], what: str) -> bytes:
    """Compile CUDA C++ to a cubin with NVRTC (through CuPy); CompileError with the log on failure.

    ``arch`` is the compute capability as digits ("90"); CuPy adds ``-arch=sm_<arch>``.
    """
    cp = cupy_module()
    from cupy.cuda import compiler

    try:
        compiled = compiler.compile_using_nvrtc(source, options=tuple(options), arch=arch,
                                                filename="mmad_kernel.cu")
    except compiler.CompileException as exc:
        log = exc.get_message() if hasattr(exc, "get_message") else str(exc)
        raise CompileError(what, log, source) from exc
    except device_errors(cp) as exc:
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


# the methods that touch a model's device memory: each runs with the model's device current
# (CuPy keeps the current device per thread, and the daemon's threads serve models on every GPU)
DEVICE_METHODS = (
    "forward", "forward_to_host", "train_step", "train_epochs", "loss_and_grads", "get_params", "set_params",
    "get_optimizer_state", "set_optimizer_state", "put_dataset", "free_device_bytes", "take_rows", "upload",
    "download", "synchronize", "device_bytes", "close",
)


def _on_model_device(method):
    @functools.wraps(method)
    def on_device(self, *args, **kwargs):
        with self.cuda_device:
            return method(self, *args, **kwargs)

    on_device.on_model_device = True
    return on_device


class CudaModel(CompiledModel):
    """The host<->device side shared by every cuda variant: CuPy arrays in and out, the input
    encoding, uploads that keep fp16 as fp16, launches whose failures become ``LaunchError``.

    A model lives on the device current when it is constructed (``CudaBackend.compile`` makes
    its ``device`` current); every method of ``DEVICE_METHODS``, in this class and in each
    variant's, makes that device current for its call."""

    backend = "cuda"

    def __init__(self, spec: MLPSpec, cp, info: dict[str, Any]):
        super().__init__(spec)
        self.cp = cp
        self.info = info
        self.arch_digits = f"{info['cc'][0]}{info['cc'][1]}"
        self.arch = f"sm_{self.arch_digits}"
        self.device_index = int(cp.cuda.Device().id)
        self.cuda_device = cp.cuda.Device(self.device_index)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in DEVICE_METHODS:
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "on_model_device", False):
                setattr(cls, name, _on_model_device(method))

    def is_device_array(self, x: Any) -> bool:
        return isinstance(x, self.cp.ndarray)

    def upload(self, x: np.ndarray) -> Any:
        try:
            return self.cp.asarray(np.ascontiguousarray(x, dtype=np.float32))
        except device_errors(self.cp) as exc:
            raise LaunchError(f"copying {np.shape(x)} to the device failed: {exc}") from exc

    def download(self, a: Any) -> np.ndarray:
        try:
            return self.cp.asnumpy(a)
        except device_errors(self.cp) as exc:
            raise LaunchError(f"copying from the device failed: {exc}") from exc

    def synchronize(self) -> None:
        try:
            self.cp.cuda.get_current_stream().synchronize()
        except device_errors(self.cp) as exc:
            raise LaunchError(f"a CUDA kernel failed: {exc}") from exc

    def _device_input(self, x: Any, cols: int, name: str, encode: bool,
                      keep_half: bool = False) -> tuple[Any, bool]:
        """(device fp32 C-contiguous rows x encoded cols, whether x came from the host); with
        ``keep_half``, an fp16 array without an encoding to apply stays fp16."""
        cp = self.cp
        encoded = encode and not self.spec.encoding.passthrough
        if not isinstance(x, cp.ndarray):
            host = check_rows(x, cols, name, keep_half=keep_half and not encoded)
            if encoded:
                host = self.encode(host)
            elif host.dtype == np.float16:  # half the bytes over PCIe, no cast on either side
                try:
                    return self.cp.asarray(host), True
                except device_errors(self.cp) as exc:
                    raise LaunchError(f"copying {host.shape} to the device failed: {exc}") from exc
            return self.upload(host), True
        x = check_rows_shape(x, cols, name)
        if keep_half and x.dtype == cp.float16 and not encoded:
            x = cp.ascontiguousarray(x)
            # the kernels read 4-byte pairs and cuBLASLt plans assume aligned operands
            return (x.copy() if x.data.ptr % 16 else x), False
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        if encoded:
            x = self.upload(self.encode(self.download(x)))
        return x, False

    def _prepare_batch(self, x: Any, y: Any) -> tuple[Any, Any, int]:
        dx, _ = self._device_input(x, self.spec.n_input_dims, "input", encode=True)
        dy, _ = self._device_input(y, self.spec.n_output_dims, "target", encode=False)
        if dy.shape[0] != dx.shape[0]:
            raise InvalidInput(f"target has {dy.shape[0]} rows but input has {dx.shape[0]}")
        if dx.shape[0] == 0:
            raise InvalidInput("a training batch needs at least one row")
        return dx, dy, dx.shape[0]

    def forward_to_host(self, x: np.ndarray, out: np.ndarray, executor: Any = None) -> None:
        """``forward`` of host rows into the host array ``out``, in ``out``'s dtype: fp16 rows go
        up as fp16 and an fp16 ``out`` is produced on the device, so no side casts and half the
        bytes cross the bus. (Chunked page-locked staging measured slower on the H100: the host
        copy into the staging buffer costs what the driver's own pageable copy does; it pays only
        once the request and response buffers are themselves page-locked, docs/gpu-notes-cuda.md.)
        Encoded models take ``forward``'s host path (encoded on the host, then in fp32)."""
        out = check_host_output(out, np.shape(x)[0], self.spec.n_output_dims)
        if not self.spec.encoding.passthrough:  # forward encodes host rows itself
            np.copyto(out, self.forward(x, out_dtype=out.dtype))
            return
        dx, _ = self._device_input(x, self.spec.n_input_dims, "input", encode=False,
                                   keep_half=out.dtype == np.float16)
        result = self.forward(dx, out_dtype=out.dtype)
        try:
            result.get(out=out)
        except device_errors(self.cp) as exc:
            raise LaunchError(f"copying the output from the device failed: {exc}") from exc

    # -- datasets on the device ------------------------------------------------------------------
    def dataset_bytes(self, rows: int, x_dtype: Any, y_dtype: Any) -> int:
        x_item = np.dtype(x_dtype).itemsize if self.spec.encoding.passthrough else 4  # encoded: fp32
        return rows * (self.spec.n_encoded_dims * x_item + self.spec.n_output_dims * np.dtype(y_dtype).itemsize)

    def free_device_bytes(self) -> int | None:
        cp = self.cp
        free, _total = cp.cuda.runtime.memGetInfo()
        return int(free) + int(cp.get_default_memory_pool().free_bytes())  # the pool's cached blocks are free too

    def put_dataset(self, chunks, rows: int, x_dtype: Any, y_dtype: Any) -> Dataset:
        """The dataset in device memory, allocated once and filled chunk by chunk (inputs
        encoded on the host first where the model has an encoding; fp16 kept as fp16)."""
        cp = self.cp
        if not 0 < rows < 2**31:
            raise InvalidInput(f"a dataset holds 1 to {2**31 - 1} rows; got {rows}")
        encoded = not self.spec.encoding.passthrough
        xd = np.dtype(np.float32 if encoded else x_dtype)
        yd = np.dtype(y_dtype)
        try:
            x = cp.empty((rows, self.spec.n_encoded_dims), dtype=xd)
            y = cp.empty((rows, self.spec.n_output_dims), dtype=yd)
        except cp.cuda.memory.OutOfMemoryError as exc:
            raise DeviceMemoryFull(f"the dataset ({self.dataset_bytes(rows, x_dtype, y_dtype) / 2**30:.2f} GiB) "
                                   "does not fit in the cuda device's free memory") from exc

        def write(at: int, cx: np.ndarray, cy: np.ndarray) -> None:
            hx = self.encode(np.asarray(cx, dtype=np.float32)) if encoded else np.ascontiguousarray(cx, dtype=xd)
            x[at:at + len(hx)].set(hx)
            y[at:at + len(hx)].set(np.ascontiguousarray(cy, dtype=yd))

        try:
            fill_dataset(chunks, rows, write)
        except device_errors(cp) as exc:
            raise LaunchError(f"copying the dataset to the device failed: {exc}") from exc
        return Dataset(x, y, rows, int(x.nbytes + y.nbytes), on_device=True)

    def take_rows(self, a: Any, rows: np.ndarray) -> Any:
        return a[self.cp.asarray(rows)]

    def _launch_from(self, module: "LoadedModule", name: str, grid, block, args, smem: int = 0) -> None:
        try:
            module.kernel(name)(grid, block, args, shared_mem=smem)
        except device_errors(self.cp) as exc:
            raise LaunchError(f"launching {name} failed: {exc}") from exc

    def _half_out(self, out_dtype: Any) -> bool:
        return output_dtype(out_dtype) == np.float16

    def _rows_padded(self, rows: int) -> int:
        return math.ceil(rows / ROW_GRANULE) * ROW_GRANULE


for _name in DEVICE_METHODS:  # CudaModel's own and those it inherits from the contract
    setattr(CudaModel, _name, _on_model_device(getattr(CudaModel, _name)))


def cached_cubin(cache: Any, build, *, backend: str, device: str, compiler: str, options: tuple[str, ...],
                 source: str) -> bytes:
    """A cubin from the kernel cache (keyed by everything that shapes it), built on a miss."""
    if cache is None:
        return build()
    return cache.get_or_build(build, backend=backend, device=device, compiler=compiler, options=list(options),
                              source=source)
