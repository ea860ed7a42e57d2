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
import threading
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

from mmad.backends.contract import (
    CompiledModel, Dataset, check_finite_rows, check_host_output, fill_dataset, check_rows, check_rows_shape,
    output_dtype,
)
from mmad.errors import BackendUnavailable, CompileError, DeviceMemoryFull, InvalidInput, LaunchError, NonFiniteInput
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
    "forward", "forward_group", "forward_to_host", "train_step", "train_epochs", "loss_and_grads", "forward_train",
    "backward", "get_params", "set_params",
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
        self._staging: PinnedStaging | None = None  # forward_to_host's, made on first use

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
            if encoded:  # the raw rows go up (fewer bytes than encoded ones) and are encoded there
                return self._encode_on_device(self.upload(host)), True
            if host.dtype == np.float16:  # half the bytes over PCIe, no cast on either side
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
            x = self._encode_on_device(x)
        return x, False

    def _encode_on_device(self, x: Any) -> Any:
        """The spec's encoding (no grids: those models encode their own) of device fp32 rows, as
        fp32 rows, by the device encoding kernels (:mod:`.encodings`, built on first use)."""
        encoder = getattr(self, "_device_encoder", None)
        if encoder is None:
            from mmad.backends.cuda.encodings import DeviceEncoder

            encoder = self._device_encoder = DeviceEncoder(self.spec, self.cp, self.arch_digits)
        return encoder.encode_rows(x)

    def forward_group(self, pairs: list[tuple[Any, Any]], nonfinite: Any = None) -> None:
        """See ``CompiledModel.forward_group``: a forward and, with ``nonfinite``, a finiteness
        check (:func:`flag_nonfinite`) launched per pair; a variant with a group kernel does better."""
        cp = self.cp
        for i, (x, out) in enumerate(pairs):
            if nonfinite is not None:
                if x.flags.c_contiguous and x.data.ptr % 16 == 0:  # the one-launch check reads 16-byte vectors
                    flag_nonfinite(cp, x, nonfinite[i:i + 1])
                else:
                    nonfinite[i:i + 1] = cp.logical_not(cp.isfinite(x).all())
            self.forward_into(x, out)

    def _prepare_batch(self, x: Any, y: Any) -> tuple[Any, Any, int]:
        dx, _ = self._device_input(x, self.spec.n_input_dims, "input", encode=True)
        dy, _ = self._device_input(y, self.spec.n_output_dims, "target", encode=False)
        if dy.shape[0] != dx.shape[0]:
            raise InvalidInput(f"target has {dy.shape[0]} rows but input has {dx.shape[0]}")
        if dx.shape[0] == 0:
            raise InvalidInput("a training batch needs at least one row")
        return dx, dy, dx.shape[0]

    def forward_to_host(self, x: np.ndarray, out: np.ndarray, executor: Any = None,
                        check_finite: bool = False) -> None:
        """``forward`` of host rows into the host array ``out``, in ``out``'s dtype: fp16 rows go
        up as fp16 and an fp16 ``out`` is produced on the device, so no side casts and half the
        bytes cross the bus. Requests of at least ``PIPELINE_MIN_BYTES`` take the pipelined
        page-locked path (:class:`PinnedStaging`), which checks ``check_finite`` on the device
        (a flag kernel over each uploaded chunk: the host check of 65,536 FP16 rows of model M
        costs a compute thread ~1.4 ms a request on an H100);
        smaller ones one plain copy each way, which costs less than the pipeline's setup, and
        check on the host. Encoded models take ``forward``'s host path (encoded on the host,
        then in fp32)."""
        out = check_host_output(out, np.shape(x)[0], self.spec.n_output_dims)
        if not self.spec.encoding.passthrough:  # forward encodes host rows itself
            if check_finite:
                check_finite_rows(np.asarray(x))
            np.copyto(out, self.forward(x, out_dtype=out.dtype))
            return
        if not isinstance(x, np.ndarray):
            x = check_rows(x, self.spec.n_input_dims, "input", keep_half=out.dtype == np.float16)
        x = check_rows_shape(x, self.spec.n_input_dims, "input")
        # fp16 rows stay fp16 only when the output is fp16 too (the fp16-I/O kernel); otherwise
        # the kernels read fp32, and the cast happens in the host copy into the staging buffer
        in_dtype = np.dtype(np.float16 if x.dtype == np.float16 and out.dtype == np.float16 else np.float32)
        if x.shape[0] * (x.shape[1] * in_dtype.itemsize + out.shape[1] * out.itemsize) >= PIPELINE_MIN_BYTES:
            try:
                self._pipeline().run(self, x, out, in_dtype, executor, check_finite)
            except device_errors(self.cp) as exc:
                raise LaunchError(f"the pipelined forward of {x.shape[0]} rows failed: {exc}") from exc
            return
        if check_finite:
            check_finite_rows(x)
        dx, _ = self._device_input(x, self.spec.n_input_dims, "input", encode=False,
                                   keep_half=out.dtype == np.float16)
        result = self.forward(dx, out_dtype=out.dtype)
        try:
            result.get(out=out)
        except device_errors(self.cp) as exc:
            raise LaunchError(f"copying the output from the device failed: {exc}") from exc

    def _pipeline(self) -> "PinnedStaging":
        """This model's staging buffers and streams, made on first use on the current device
        (the device a caller made current, so never a fixed device 0)."""
        staging = self._staging
        if staging is None or staging.device != self.cp.cuda.Device().id:
            staging = self._staging = PinnedStaging(self.cp)
        return staging

    # -- datasets on the device ------------------------------------------------------------------
    def _dataset_input_layout(self, x_dtype: Any) -> tuple[int, np.dtype]:
        """(columns, dtype) of a held dataset's inputs: the encoded input, fp32 where an encoding
        was applied on the host, else in the dtype given."""
        encoded = not self.spec.encoding.passthrough
        return self.spec.n_encoded_dims, np.dtype(np.float32 if encoded else x_dtype)

    def _dataset_inputs(self, cx: np.ndarray, xd: np.dtype) -> np.ndarray:
        """A chunk of a dataset's inputs as the device holds them (``_dataset_input_layout``)."""
        if not self.spec.encoding.passthrough:
            return self.encode(np.asarray(cx, dtype=np.float32))
        return np.ascontiguousarray(cx, dtype=xd)

    def dataset_bytes(self, rows: int, x_dtype: Any, y_dtype: Any) -> int:
        cols, xd = self._dataset_input_layout(x_dtype)
        return rows * (cols * xd.itemsize + self.spec.n_output_dims * np.dtype(y_dtype).itemsize)

    def free_device_bytes(self) -> int | None:
        cp = self.cp
        free, _total = cp.cuda.runtime.memGetInfo()
        return int(free) + int(cp.get_default_memory_pool().free_bytes())  # the pool's cached blocks are free too

    def put_dataset(self, chunks, rows: int, x_dtype: Any, y_dtype: Any) -> Dataset:
        """The dataset in device memory, allocated once and filled chunk by chunk (inputs as
        ``_dataset_inputs`` makes them: encoded on the host first where the model has an encoding;
        fp16 kept as fp16)."""
        cp = self.cp
        if not 0 < rows < 2**31:
            raise InvalidInput(f"a dataset holds 1 to {2**31 - 1} rows; got {rows}")
        cols, xd = self._dataset_input_layout(x_dtype)
        yd = np.dtype(y_dtype)
        try:
            x = cp.empty((rows, cols), dtype=xd)
            y = cp.empty((rows, self.spec.n_output_dims), dtype=yd)
        except cp.cuda.memory.OutOfMemoryError as exc:
            raise DeviceMemoryFull(f"the dataset ({self.dataset_bytes(rows, x_dtype, y_dtype) / 2**30:.2f} GiB) "
                                   "does not fit in the cuda device's free memory") from exc

        def write(at: int, cx: np.ndarray, cy: np.ndarray) -> None:
            hx = self._dataset_inputs(cx, xd)
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


PIPELINE_MIN_BYTES = 1 << 20  # host bytes in + out from which forward_to_host pipelines
PIPELINE_DEPTH = 4  # chunks in flight: staged in, on the device, and copied out at once
PIPELINE_CHUNKS = 2  # a request is cut into about this many chunks (H100, 65,536 FP16 rows of M: 0.34 ms
# page-locked and 1.45 ms pageable against 0.49 and 3.05 ms with 8 chunks) ...
CHUNK_BYTES = (256 << 10, 8 << 20)  # ... of this many input bytes at least and at most
_HOST_TO_DEVICE, _DEVICE_TO_HOST = 1, 2  # cudaMemcpyKind
_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost: page-locked or cudaHostRegister'ed host memory


def is_page_locked(cp, a: np.ndarray) -> bool:
    """Whether every byte of the C-contiguous host array ``a`` lies in page-locked memory
    (cudaHostAlloc'ed, or a range registered with cudaHostRegister): such memory is copied to
    and from directly, without a staging copy. The first and the last byte are asked about,
    since an array may not straddle a registered range's end."""
    if a.nbytes == 0 or not a.flags.c_contiguous:
        return False
    try:
        return all(cp.cuda.runtime.pointerGetAttributes(ptr).type == _MEMORY_TYPE_HOST
                   for ptr in (a.ctypes.data, a.ctypes.data + a.nbytes - 1))
    except cp.cuda.runtime.CUDARuntimeError:  # drivers before CUDA 11 refuse pageable pointers
        return False


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every device's context


def host_register(cp, buffer: Any) -> Callable[[], None]:
    """Page-lock a host buffer in place (cudaHostRegister), so that ``forward_to_host`` copies
    from and to arrays in it directly (:func:`is_page_locked`); returns the unregister call,
    which must run before the buffer's memory is freed or unmapped."""
    view = np.frombuffer(buffer, np.uint8)
    ptr, size = view.ctypes.data, view.nbytes
    del view  # no export of the buffer may outlive this call (an mmap refuses to close under one)
    cp.cuda.runtime.hostRegister(ptr, size, _HOST_REGISTER_PORTABLE)
    return lambda: cp.cuda.runtime.hostUnregister(ptr)


def chunk_rows(rows: int, row_bytes: int) -> int:
    """Rows per pipeline chunk: a power of two (a few distinct shapes, so shape-keyed plans
    such as cuBLASLt's are reused across requests) cutting the request into about
    ``PIPELINE_CHUNKS`` pieces of ``CHUNK_BYTES`` input bytes, a multiple of ``ROW_GRANULE``."""
    lo, hi = (max(ROW_GRANULE, b // row_bytes) for b in CHUNK_BYTES)
    want = 1 << max(0, math.ceil(math.log2(max(1, rows / PIPELINE_CHUNKS))))
    n = min(max(want, lo), hi)
    return max(ROW_GRANULE, n // ROW_GRANULE * ROW_GRANULE)


class TableUploads:
    """Small host tables (a group forward's descriptors) copied to the device on the current
    stream without the host waiting: a ring of page-locked and device buffers. ``upload`` hands
    out the next slot; the caller marks it ``used`` once the launch that reads it is queued, and
    a slot is written again only after that launch is done (its event), so neither a pending
    copy's host bytes nor a running kernel's table is overwritten. (A pageable copy, what
    ``cupy.asarray`` does, makes the host wait for it.)"""

    SLOTS = 4

    def __init__(self, cp):
        self.cp = cp
        self._slots: list[list[Any]] = []  # [bytes held, page-locked view, device buffer, event or None]
        self._next = 0
        self._used: list[Any] | None = None  # the slot of the last upload

    def upload(self, table: np.ndarray) -> Any:
        """A device uint8 buffer holding ``table``'s bytes once the current stream gets there."""
        cp = self.cp
        if len(self._slots) < self.SLOTS:
            self._slots.append([0, None, None, None])
        i = self._next
        self._next = (i + 1) % self.SLOTS
        slot = self._slots[i]
        if slot[3] is not None:
            slot[3].synchronize()
        nbytes = table.nbytes
        if slot[0] < nbytes:
            held = max(nbytes, 4096)
            slot[:3] = held, np.frombuffer(cp.cuda.alloc_pinned_memory(held), np.uint8, held), cp.empty(held, cp.uint8)
        slot[1][:nbytes] = np.ascontiguousarray(table).view(np.uint8).reshape(-1)
        cp.cuda.runtime.memcpyAsync(slot[2].data.ptr, slot[1].ctypes.data, nbytes, _HOST_TO_DEVICE,
                                    cp.cuda.get_current_stream().ptr)
        self._used = slot
        return slot[2]

    def used(self) -> None:
        """The last uploaded table's launch is queued: its slot waits for it before reuse."""
        if self._used[3] is None:
            self._used[3] = self.cp.cuda.Event(disable_timing=True)
        self._used[3].record()


class PinnedStaging:
    """Page-locked staging buffers and streams of one model's ``forward_to_host``, kept across
    requests (grown when a request needs larger ones) and used by one call at a time (the
    model's callers hold its lock).

    A request is cut into chunks of ``chunk_rows`` rows; chunk i runs on slot i % DEPTH: an
    executor thread copies (and casts) its rows into the slot's page-locked input buffer; the
    slot's stream uploads them, runs ``forward`` on a full chunk (every chunk has one shape: the
    tail's extra rows are computed and never read back), and downloads the chunk's rows into
    the slot's page-locked output buffer; another executor thread waits for that download and
    copies the rows into ``out``. So the host copies of several chunks run on several threads
    while the copy engines and the kernels work on others. A pageable copy is itself a
    single-threaded host copy plus a page-locked one inside the driver, so one-chunk staging
    measures no faster; the host copies spread over threads
    and overlapped with the bus are what this buys. An input or output that is already
    page-locked (a registered shared-memory region) skips its host copy.
    """

    DEPTH = PIPELINE_DEPTH

    def __init__(self, cp):
        self.cp = cp
        self.device = cp.cuda.Device().id
        self.streams = [cp.cuda.Stream(non_blocking=True) for _ in range(self.DEPTH)]
        self._host: dict[tuple[str, int], tuple[int, Any]] = {}  # (in|out, slot) -> (bytes, page-locked memory)

    def buffer(self, kind: str, slot: int, dtype: np.dtype, shape: tuple[int, int]) -> np.ndarray:
        nbytes = math.prod(shape) * dtype.itemsize
        held, mem = self._host.get((kind, slot), (0, None))
        if held < nbytes:
            mem = self.cp.cuda.alloc_pinned_memory(nbytes)
            self._host[kind, slot] = (nbytes, mem)
        return np.frombuffer(mem, dtype, math.prod(shape)).reshape(shape)

    def run(self, model: "CudaModel", x: np.ndarray, out: np.ndarray, in_dtype: np.dtype, executor: Any,
            check_finite: bool = False) -> None:
        cp = self.cp
        rows, n_in, n_out = x.shape[0], x.shape[1], out.shape[1]
        step = chunk_rows(rows, n_in * in_dtype.itemsize)
        spans = [(lo, min(lo + step, rows)) for lo in range(0, rows, step)]
        slots = range(min(self.DEPTH, len(spans)))
        direct_in = x.dtype == in_dtype and is_page_locked(cp, x)
        direct_out = is_page_locked(cp, out)
        # allocated here, on the model's device, not on the executor's threads
        in_bufs = None if direct_in else [self.buffer("in", s, in_dtype, (step, n_in)) for s in slots]
        out_bufs = None if direct_out else [self.buffer("out", s, out.dtype, (step, n_out)) for s in slots]
        submit = executor.submit if executor is not None else _run_now
        nonfinite = cp.zeros(1, dtype=cp.uint32) if check_finite else None  # set by any chunk
        staged: dict[int, Future] = {}  # chunk -> its copy into its slot's input buffer
        unstaged: dict[int, Future] = {}  # chunk -> its copy out of its slot's output buffer
        downloaded: list[Any] = []  # events of downloads straight into a page-locked ``out``

        def stage_in(i: int, slot_free: Any = None) -> np.ndarray:
            lo, hi = spans[i]
            if slot_free is not None:  # the slot's previous chunk must have gone up first
                with cp.cuda.Device(self.device):
                    slot_free.synchronize()
            buf = in_bufs[i % self.DEPTH]
            np.copyto(buf[:hi - lo], x[lo:hi], casting="same_kind")  # the cast to fp32, if any, fused
            return buf

        def stage_out(i: int, done: Any) -> None:
            lo, hi = spans[i]
            with cp.cuda.Device(self.device):
                done.synchronize()
            np.copyto(out[lo:hi], out_bufs[i % self.DEPTH][:hi - lo])

        if not direct_in:  # the first chunks' host copies start before any launch
            for i in slots:
                staged[i] = submit(stage_in, i)
        try:
            for i, (lo, hi) in enumerate(spans):
                slot, n = i % self.DEPTH, hi - lo
                stream = self.streams[slot]
                if i - self.DEPTH in unstaged:  # the slot's output buffer must have been read out
                    unstaged.pop(i - self.DEPTH).result()
                with stream:
                    dx = cp.empty((step, n_in), dtype=in_dtype)
                    src = x[lo:hi] if direct_in else staged.pop(i).result()
                    cp.cuda.runtime.memcpyAsync(dx.data.ptr, src.ctypes.data, n * n_in * in_dtype.itemsize,
                                                _HOST_TO_DEVICE, stream.ptr)
                    if nonfinite is not None:
                        flag_nonfinite(cp, dx[:n], nonfinite)
                    if not direct_in and i + self.DEPTH < len(spans):  # the slot's next chunk may be staged
                        staged[i + self.DEPTH] = submit(stage_in, i + self.DEPTH, stream.record())
                    result = cp.ascontiguousarray(model.forward(dx, out_dtype=out.dtype))
                    if result.dtype != out.dtype:  # the bytes below are copied as they are
                        raise LaunchError(f"forward gave {result.dtype} rows for a {out.dtype} output buffer")
                    dst = out[lo:hi] if direct_out else out_bufs[slot]
                    cp.cuda.runtime.memcpyAsync(dst.ctypes.data, result.data.ptr, n * n_out * out.itemsize,
                                                _DEVICE_TO_HOST, stream.ptr)
                    done = stream.record()
                if direct_out:
                    downloaded.append(done)
                else:
                    unstaged[i] = submit(stage_out, i, done)
            for future in unstaged.values():
                future.result()
            for done in downloaded:
                done.synchronize()
            if nonfinite is not None and nonfinite.get()[0]:  # every stream is done: no race
                raise NonFiniteInput()
        finally:
            # after a failure, nothing may still be writing a staging buffer or ``out``
            for future in [*staged.values(), *unstaged.values()]:
                future.cancel() or future.exception()
            for stream in self.streams:
                try:
                    stream.synchronize()
                except device_errors(cp):
                    pass  # the failure that got us here is the one raised


FLAG_NONFINITE_SOURCE = r"""
template <typename Bits, unsigned int Exponent>
__device__ void flag_nonfinite(const Bits* x, unsigned long long n, unsigned int* flag) {
    // a thread tests one 16-byte vector (the last thread of the array its scalar tail): one
    // wide load in flight per thread, so the pass runs at memory speed, not load latency
    constexpr int per = 16 / sizeof(Bits);
    union { uint4 w; Bits b[per]; } v;
    unsigned long long first = (blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x) * per;
    bool found = false;
    if (first + per <= n) {
        v.w = reinterpret_cast<const uint4*>(x)[first / per];
        for (int k = 0; k < per; ++k) found |= (v.b[k] & Exponent) == Exponent;
    } else {
        for (unsigned long long i = first; i < n; ++i) found |= (x[i] & Exponent) == Exponent;
    }
    if (__syncthreads_or(found) && threadIdx.x == 0) atomicOr(flag, 1u);
}
extern "C" __global__ void mmad_flag_nonfinite_f16(const unsigned short* x, unsigned long long n, unsigned int* flag) {
    flag_nonfinite<unsigned short, 0x7C00u>(x, n, flag);
}
extern "C" __global__ void mmad_flag_nonfinite_f32(const unsigned int* x, unsigned long long n, unsigned int* flag) {
    flag_nonfinite<unsigned int, 0x7F800000u>(x, n, flag);
}
"""
FLAG_THREADS = 256
_FLAG_KERNELS: dict[tuple[int, str], Any] = {}  # (device, kernel name) -> the function (compiled per device)


def flag_nonfinite(cp, a: Any, flag: Any) -> None:
    """Set the device word ``flag`` to 1 when the contiguous fp16 or fp32 device array ``a`` holds
    NaN or Inf, on the current stream (an exponent test on the bits; one raw launch, which
    costs the host less than a CuPy reduction: this runs once per pipeline chunk). ``a`` starts
    at an allocation's start (16-byte aligned), as a pipeline chunk's upload buffer does."""
    name = "mmad_flag_nonfinite_f16" if a.dtype == np.float16 else "mmad_flag_nonfinite_f32"
    key = (cp.cuda.Device().id, name)
    kernel = _FLAG_KERNELS.get(key)
    if kernel is None:  # looked up once: get_function asks the driver each time
        module = cp.RawModule(code=FLAG_NONFINITE_SOURCE, options=("-std=c++17",))
        kernel = _FLAG_KERNELS[key] = module.get_function(name)
    vectors = -(-a.size // (16 // a.itemsize))
    blocks = max(1, -(-vectors // FLAG_THREADS))
    kernel((blocks,), (FLAG_THREADS,), (a, np.uint64(a.size), flag))


def _run_now(fn, *args):
    """``executor.submit`` without an executor: run at once, a done future back."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except BaseException as exc:
        future.set_exception(exc)
    return future


for _name in DEVICE_METHODS:  # CudaModel's own and those it inherits from the contract
    setattr(CudaModel, _name, _on_model_device(getattr(CudaModel, _name)))


def cached_cubin(cache: Any, build, *, backend: str, device: str, compiler: str, options: tuple[str, ...],
                 source: str) -> bytes:
    """A cubin from the kernel cache (keyed by everything that shapes it), built on a miss."""
    if cache is None:
        return build()
    return cache.get_or_build(build, backend=backend, device=device, compiler=compiler, options=list(options),
                              source=source)


def in_background(fn: Callable[[], bytes], name: str) -> Future:
    """``fn()`` on a thread of its own, its result or exception in the future returned. NVRTC
    compiles without the GIL (CuPy's compileProgram), so a module builds beside the one being
    built now and beside the requests being served. Not on ``cache.compile_pool``: a model is
    often built on a pool thread, and whoever then trains it waits for this future; queued
    behind busy pool threads that wait the same way, it would never run. A daemon thread: a
    process exiting does not wait for a compile nobody will use."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
