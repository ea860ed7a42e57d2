"""wgpu backend: the MLP in WGSL through wgpu-py, on any WebGPU adapter (Vulkan, Metal, D3D12, GL).

One variant, ``default``. Per model spec the backend generates one WGSL module
(``shaders/wgsl/mlp_common.wgsl`` plus generated code) holding:

* ``fwd_infer`` / ``fwd_train``: the fused forward pass, all layers in one dispatch. A workgroup
  owns ``R`` rows; the activations of those rows live in workgroup memory, each layer's weights
  are staged in workgroup memory in chunks of ``KC`` reduction rows (the whole layer when it fits
  the adapter's ``max-compute-workgroup-storage-size``, streamed otherwise). The first layer reads
  inputs the host encoded, except a grid's columns, which it interpolates from raw inputs
  (``_kernel_input``). ``fwd_train`` also keeps each layer's
  input (compute type) and pre-activation (fp32) for the backward pass.
* ``loss_grad`` / ``loss_reduce``: per-element loss and its gradient (× loss scale, × output
  activation derivative, rounded), the mean loss reduced in a fixed order.
* ``bwd``: the fused backward pass through the layers, activation derivatives taken from the
  stored pre-activations.
* ``wgrad_<i>``: weight and bias gradients of layer i as a split-K GEMM over the rows;
  ``grad_reduce`` sums the splits in order (deterministic, no atomics).
* grid encodings (HashGrid, DenseGrid, TiledGrid): the first layer's load interpolates the
  tables, ``bwd`` runs on into d loss / d encoded input, and ``grid_keys_<k>`` / ``grid_sort*`` /
  ``grid_gather_<k>`` turn tcnn's atomic scatter into the tables' gradient as a sort of the table
  reads and a gather (WGSL has no float atomics; wgsl._grid_wgsl). The tables follow the MLP's
  parameters in the flat buffers; Adam's per-value step counts are in ``gsteps``.
* ``optimize``: Adam or SGD on fp32 masters, refreshing the compute-type weight copy; with
  tcnn's EMA wrapper also the average (``ema``) and its compute-type copy (``ema_wc``), which
  ``fwd_infer`` binds where other models bind ``master`` and ``wc`` (training keeps the raw ones).

Numerics follow ``backends/contract.py``: fp16 models store activations and weights as ``f16``
when the adapter has ``shader-f16``; without it they are stored as f32 holding fp16-rounded
values (``pack2x16float``/``unpack2x16float``). bf16 is always emulated in f32 storage (bit
rounding to nearest even); fp32 models round nothing. Every product accumulates in f32.

Batches of any size run in row chunks; each chunk binds its slice of the input/target/output
arrays, so no buffer binding exceeds the adapter's limits. Launch parameters live in one uniform
buffer of 256-byte slots addressed with dynamic offsets, so a whole multi-step training run is
one submission.
"""

from __future__ import annotations

import hashlib
import os
import threading
import weakref
from typing import Any

import numpy as np

from mmad.backends import numerics as nm
from mmad.backends.contract import (
    Backend, CompiledModel, ProbeRow, check_device_index, check_params, check_rows, init_params, optimizer_slots, output_dtype,
)
from mmad.errors import BackendUnavailable, CompileError, InvalidInput, LaunchError, SpecError
from mmad.backends.webgpu.wgsl import SORT_BLOCK, ceil_div, generate_wgsl, make_plan
from mmad.spec import MLPSpec

SLOT_BYTES = 256           # uniform slot stride (>= every adapter's uniform offset alignment)
UNIFORM_SLOTS = 1024
STEP_SLOTS = 256           # losses[0:256] per step, losses[256] the running chunk sum
MAX_EW_WORKGROUPS = 4096   # element-wise kernels stride over their range with at most this many
LAYOUT_VERSION = 1

# limits the backend asks for (the adapter's own values, not WebGPU's defaults)
_LIMITS = ("max-storage-buffer-binding-size", "max-buffer-size", "max-compute-workgroup-storage-size",
           "max-storage-buffers-per-shader-stage", "max-compute-invocations-per-workgroup",
           "max-compute-workgroup-size-x", "max-compute-workgroups-per-dimension",
           "max-dynamic-uniform-buffers-per-pipeline-layout")
_INTERESTING_FEATURES = ("shader-f16", "subgroup", "subgroup-barrier", "shader-f64", "shader-int64",
                         "timestamp-query", "pipeline-cache", "immediates", "shader-float32-atomic",
                         "cooperative-matrix")
# wgpu-native's experimental cooperative matrices (8x8 f32 only: Metal simdgroup matrices on Apple7+,
# Vulkan where the device offers 8x8x8 f32): the probe says whether the adapter offers them
COOPMAT_FEATURE = "cooperative-matrix"


def _sort_items(reads: int) -> int:
    """The bitonic sort's length for ``reads`` table reads: the next power of two, at least one
    workgroup-memory block."""
    return max(SORT_BLOCK, 1 << (reads - 1).bit_length())


def _kernel_group(kernel: str) -> str:
    """The bindings' name of an entry point: ``wgrad_2`` binds as ``wgrad``, ``grid_keys_0`` as ``grid_keys``."""
    for group in ("wgrad", "grid_keys", "grid_gather"):
        if kernel.startswith(group + "_"):
            return group
    return kernel


def _import_wgpu():
    try:
        import wgpu  # noqa: PLC0415 - optional stack, imported on use
    except ImportError as exc:
        raise BackendUnavailable("wgpu", f"the wgpu package is not installed ({exc}); pip install wgpu") from exc
    return wgpu


def _native_version(wgpu) -> str:
    try:
        from wgpu.backends import wgpu_native  # noqa: PLC0415
        return getattr(wgpu_native, "__version__", "?")
    except Exception:  # noqa: BLE001 - only for a version string
        return "?"


def _is_software(info: dict) -> bool:
    text = " ".join(str(info.get(k, "")) for k in ("vendor", "device", "description")).lower()
    return info.get("adapter_type") == "CPU" or any(s in text for s in ("llvmpipe", "lavapipe", "swiftshader", "warp"))


# -- device arrays --------------------------------------------------------------------------
class WgpuArray:
    """A float32 (rows x cols) array in a wgpu storage buffer."""

    def __init__(self, buffer: Any, shape: tuple[int, int], device: Any):
        self.buffer = buffer
        self.shape = shape
        self.dtype = np.dtype(np.float32)
        self.device = device
        self.bind_groups: dict[tuple, Any] = {}  # per (model, kernel, chunk): its slice's bind group

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * 4

    def __repr__(self) -> str:
        return f"WgpuArray(shape={self.shape}, dtype=float32)"


# -- the compiled model ---------------------------------------------------------------------
_BUFFER_BINDINGS = ("wc", "master", "grad", "mom1", "mom2", "hbuf", "zbuf", "dbuf", "wpart", "lpart", "losses",
                    "ema", "ema_wc", "dinbuf", "skey", "sid", "gweight", "gsteps")
# group-0 bindings each kernel uses (binding 0, the launch uniform, is in all of them)
_KERNEL_BINDINGS = {
    "fwd_infer": ("wc", "master"),
    "fwd_train": ("wc", "master", "hbuf", "zbuf"),
    "loss_grad": ("zbuf", "dbuf", "lpart"),
    "loss_reduce": ("lpart", "losses"),
    "bwd": ("wc", "zbuf", "dbuf"),
    "wgrad": ("hbuf", "dbuf", "wpart"),
    "grad_reduce": ("grad", "wpart"),
    "optimize": ("wc", "master", "grad", "mom1", "mom2"),
    # grid encodings' tables (wgsl._grid_wgsl): the reads sorted by table row, then gathered
    "grid_keys": ("skey", "sid", "gweight"),
    "grid_sort": ("skey", "sid"),
    "grid_sort_block": ("skey", "sid"),
    "grid_merge_block": ("skey", "sid"),
    "grid_gather": ("skey", "sid", "gweight", "dinbuf", "grad"),
}
_EMA_BINDINGS = ("ema", "ema_wc")  # what optimize binds besides, with tcnn's EMA wrapper
# fwd_infer of an EMA model reads the average through the bindings of the training weights
_EMA_INFERENCE = {"wc": "ema_wc", "master": "ema"}
LAUNCH_BYTES = 56  # the WGSL Launch struct
_KERNEL_IO = {"fwd_infer": ("x_in", "y_out"), "fwd_train": ("x_in",), "loss_grad": ("targets",), "grid_keys": ("x_in",)}
_IO_BINDING = {"x_in": 0, "y_out": 1, "targets": 2}


class _Recorder:
    """Dispatches of one submission plus the uniform slots they read."""

    def __init__(self, model: "WgpuModel"):
        self.model = model
        self.slots = np.zeros((UNIFORM_SLOTS, SLOT_BYTES // 4), dtype=np.uint32)
        self.used = 0
        self.encoder = None
        self.pass_ = None

    def slot(self, n_rows: int, *, rows_per_split: int = 0, first: bool = False, last: bool = False,
             loss_slot: int = 0, inv_count: float = 0.0, lr_t: float = 0.0, n_splits: int = 0,
             n_loss_wg: int = 0, ema: tuple[float, float] = (0.0, 0.0), lr_base: float = 0.0,
             sort: tuple[int, int, int] = (0, 0, 0)) -> int:
        """A uniform slot holding these launch parameters; its offset. The offset is good for
        dispatches recorded before the next ``slot`` call that flushes a full buffer (the slots
        are rewritten from 0 after a flush): record the dispatches a slot serves before taking more."""
        if self.used == UNIFORM_SLOTS:
            self.flush()
        index = self.used
        self.used += 1
        row = self.slots[index]
        row[0:4] = (n_rows, rows_per_split, int(first) | (int(last) << 1), loss_slot)
        row[4:6] = np.array([inv_count, lr_t], dtype=np.float32).view(np.uint32)
        row[6:8] = (n_splits, n_loss_wg)
        row[8:11] = np.array(ema + (lr_base,), dtype=np.float32).view(np.uint32)
        row[11:14] = sort  # sort_n, sort_j, sort_k
        return index * SLOT_BYTES

    def dispatch(self, kernel: str, offset: int, groups: tuple[int, int, int], io_group: Any = None) -> None:
        if self.pass_ is None:
            self.encoder = self.model.device.create_command_encoder()
            self.pass_ = self.encoder.begin_compute_pass()
        m = self.model
        self.pass_.set_pipeline(m.pipelines[kernel])
        self.pass_.set_bind_group(0, m.model_groups[kernel], [offset])
        if io_group is not None:
            self.pass_.set_bind_group(1, io_group, [])
        self.pass_.dispatch_workgroups(*groups)

    def flush(self) -> None:
        if self.pass_ is None:
            return
        m = self.model
        try:
            self.pass_.end()
            m.device.queue.write_buffer(m.buffers["uniform"], 0, self.slots[:self.used].tobytes())
            m.device.queue.submit([self.encoder.finish()])
        except Exception as exc:
            raise LaunchError(f"wgpu submission failed: {exc}") from exc
        self.pass_ = self.encoder = None
        self.used = 0


class WgpuModel(CompiledModel):
    backend = "wgpu"
    variant = "default"
    supports_ema = True

    def __init__(self, spec: MLPSpec, device: Any, adapter_info: dict, limits: dict[str, int], native_f16: bool,
                 cache: Any = None, module_cache: dict | None = None, max_stage_rows: int = 4096):
        super().__init__(spec)
        self.device = device
        self.native_f16 = native_f16 and spec.precision == "fp16"
        self.storage = "f16" if self.native_f16 else "f32"
        self.plan = make_plan(spec, limits, 2 if self.native_f16 else 4, max_stage_rows)
        # grid tables under Adam keep a step count per value (tcnn's param_steps), in ``gsteps``
        self._grid_adam = bool(self.plan.grids) and spec.optimizer.otype == "Adam"
        self.source = generate_wgsl(spec, self.plan, self.native_f16)
        if cache is not None:
            # the generated WGSL is this backend's cached artefact (wgpu-native compiles it in-process)
            device_name = f"{adapter_info.get('device', '')} {adapter_info.get('backend_type', '')}"
            self.source = cache.get_or_build(lambda: self.source.encode(), backend="wgpu", device=device_name,
                                             compiler=f"wgpu-native {_native_version(_import_wgpu())}",
                                             options={"storage": self.storage, "layout": LAYOUT_VERSION},
                                             source=self.source).decode()
        self._lock = threading.Lock()
        self._closed = False
        self.pipelines, self.layouts = self._build_pipelines(module_cache)
        self.buffers: dict[str, Any] = {}
        self._alloc()
        self.model_groups = {k: self._model_group(k) for k in self.pipelines}
        self._scratch: dict[str, WgpuArray] = {}
        self._pool: dict[int, list] = {}
        zeros = {name: np.zeros_like(value) for name, value in init_params(spec).items()}
        self._write_slots([zeros] * len(optimizer_slots(spec)), 0)
        self.set_params(init_params(spec))  # after the slots: it sets an EMA average too

    # -- set-up ---------------------------------------------------------------------------
    def _build_pipelines(self, module_cache: dict | None):
        import wgpu  # noqa: PLC0415

        key = hashlib.sha256(self.source.encode()).hexdigest()
        cached = module_cache.get(key) if module_cache is not None else None
        if cached is not None:
            return cached
        try:
            module = self.device.create_shader_module(code=self.source)
        except Exception as exc:
            raise CompileError("the wgpu MLP module (WGSL)", str(exc), self.source) from exc
        storage = {"type": wgpu.BufferBindingType.storage}
        uniform = {"type": wgpu.BufferBindingType.uniform, "has_dynamic_offset": True,
                   "min_binding_size": LAUNCH_BYTES}
        binding_index = {name: i + 1 for i, name in enumerate(_BUFFER_BINDINGS)}
        pipelines, layouts = {}, {}
        kernels = [k for k in _KERNEL_BINDINGS if not k.startswith(("wgrad", "grid_"))]
        kernels += [f"wgrad_{i}" for i in range(self.plan.n_layers)]
        if self.plan.grids:
            kernels += ["grid_sort", "grid_sort_block", "grid_merge_block"]
            kernels += [f"grid_{kind}_{g.index}" for g in self.plan.grids for kind in ("keys", "gather")]
        for kernel in kernels:
            group = _kernel_group(kernel)
            entries = [{"binding": 0, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": uniform}]
            entries += [{"binding": binding_index[n], "visibility": wgpu.ShaderStage.COMPUTE, "buffer": storage}
                        for n in self._bindings(group)]
            groups = [self.device.create_bind_group_layout(entries=entries)]
            io = _KERNEL_IO.get(group, ())
            if io:
                groups.append(self.device.create_bind_group_layout(entries=[
                    {"binding": _IO_BINDING[n], "visibility": wgpu.ShaderStage.COMPUTE,
                     "buffer": {"type": wgpu.BufferBindingType.storage if n == "y_out"
                                else wgpu.BufferBindingType.read_only_storage}} for n in io]))
            try:
                layout = self.device.create_pipeline_layout(bind_group_layouts=groups)
                pipelines[kernel] = self.device.create_compute_pipeline(
                    layout=layout, compute={"module": module, "entry_point": kernel})
            except Exception as exc:
                raise CompileError(f"the wgpu pipeline {kernel!r}", str(exc), self.source) from exc
            layouts[kernel] = groups
        if module_cache is not None:
            module_cache[key] = (pipelines, layouts)
        return pipelines, layouts

    def _buffer(self, name: str, nbytes: int, extra_usage: int = 0) -> Any:
        import wgpu  # noqa: PLC0415

        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST | extra_usage
        try:
            buf = self.device.create_buffer(size=max(16, (nbytes + 15) // 16 * 16), usage=usage, label=name)
        except Exception as exc:
            raise LaunchError(f"wgpu could not allocate {nbytes} bytes for {name}: {exc}") from exc
        self.buffers[name] = buf
        return buf

    def _alloc(self) -> None:
        import wgpu  # noqa: PLC0415

        plan, cb = self.plan, (2 if self.native_f16 else 4)
        p = plan.p_all  # the MLP's parameters, then the grid tables'
        self._buffer("wc", p * cb)
        for name in ("master", "grad", "mom1", "mom2"):
            self._buffer(name, p * 4)
        if self.spec.optimizer.ema is not None:
            self._buffer("ema", p * 4)
            self._buffer("ema_wc", p * cb)
        if self._grid_adam:  # Adam's step count per grid table value (tcnn's param_steps)
            self._buffer("gsteps", (plan.p_all - plan.p) * 4)
        self._scratch_rows = self._scratch_splits = 0
        self._alloc_training_scratch(256, 1)
        self._buffer("lpart", MAX_EW_WORKGROUPS * 4)
        self._buffer("losses", (STEP_SLOTS + 1) * 4)
        try:
            self.buffers["uniform"] = self.device.create_buffer(
                size=UNIFORM_SLOTS * SLOT_BYTES, usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
        except Exception as exc:
            raise LaunchError(f"wgpu could not allocate the uniform buffer: {exc}") from exc

    def _alloc_training_scratch(self, rows: int, splits: int) -> None:
        """(Re)allocate the per-chunk training buffers for ``rows`` rows and ``splits`` splits."""
        plan, cb = self.plan, (2 if self.native_f16 else 4)
        for name in ("hbuf", "zbuf", "dbuf", "wpart", "dinbuf", "skey", "sid", "gweight"):
            old = self.buffers.pop(name, None)
            if old is not None:
                old.destroy()
        self._buffer("hbuf", rows * sum(plan.kp) * cb)
        self._buffer("zbuf", rows * sum(plan.op) * 4)
        self._buffer("dbuf", rows * sum(plan.op) * cb)
        self._buffer("wpart", splits * plan.p * 4)
        if plan.grids:  # d loss / d encoded input, and every table read of a chunk for the sort
            self._buffer("dinbuf", rows * plan.kp[0] * cb)
            for name in ("skey", "sid", "gweight"):
                self._buffer(name, _sort_items(rows * plan.max_lookups) * 4)
        self._scratch_rows, self._scratch_splits = rows, splits

    def _ensure_training_scratch(self, rows: int, splits: int) -> None:
        # grown on demand: a model that only serves inference never holds the training scratch
        if rows > self._scratch_rows or splits > self._scratch_splits:
            self._alloc_training_scratch(max(rows, self._scratch_rows), max(splits, self._scratch_splits))
            self.model_groups = {k: self._model_group(k) for k in self.pipelines}

    def _bindings(self, group: str) -> tuple[str, ...]:
        """The group-0 buffers kernel group ``group`` binds (by their binding's name)."""
        names = _KERNEL_BINDINGS[group]
        if group == "optimize" and self.spec.optimizer.ema is not None:
            names += _EMA_BINDINGS
        if group == "optimize" and self._grid_adam:
            names += ("gsteps",)
        if group == "bwd" and self.plan.grids:  # the backward also writes d loss / d encoded input
            names += ("dinbuf",)
        return names

    def _model_group(self, kernel: str) -> Any:
        binding_index = {name: i + 1 for i, name in enumerate(_BUFFER_BINDINGS)}
        group = _kernel_group(kernel)
        swap = _EMA_INFERENCE if kernel == "fwd_infer" and self.spec.optimizer.ema is not None else {}
        entries = [{"binding": 0, "resource": {"buffer": self.buffers["uniform"], "offset": 0, "size": LAUNCH_BYTES}}]
        entries += [{"binding": binding_index[n], "resource": {"buffer": self.buffers[swap.get(n, n)], "offset": 0,
                                                               "size": self.buffers[swap.get(n, n)].size}}
                    for n in self._bindings(group)]
        try:
            return self.device.create_bind_group(layout=self.layouts[kernel][0], entries=entries)
        except Exception as exc:
            raise LaunchError(f"wgpu bind group for {kernel}: {exc}") from exc

    def _io_group(self, kernel: str, start: int, rows: int, arrays: dict[str, WgpuArray]) -> Any:
        # cached on the last array (a forward's output), so it lives exactly as long as that array
        holder = list(arrays.values())[-1]
        key = (id(self), kernel, start, rows) + tuple(id(a) for a in arrays.values())
        group = holder.bind_groups.get(key)
        if group is None:
            entries = [{"binding": _IO_BINDING[n], "resource": {"buffer": a.buffer, "offset": start * a.shape[1] * 4,
                                                                 "size": rows * a.shape[1] * 4}}
                       for n, a in arrays.items()]
            try:
                group = self.device.create_bind_group(layout=self.layouts[kernel][1], entries=entries)
            except Exception as exc:
                raise LaunchError(f"wgpu bind group for {kernel} rows {start}..{start + rows}: {exc}") from exc
            holder.bind_groups[key] = group
        return group

    # -- host <-> device ------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise LaunchError("this wgpu model was closed")

    def upload(self, x: Any) -> WgpuArray:
        self._check_open()
        a = np.asarray(x)
        if a.ndim == 1:
            a = a.reshape(-1, 1)
        if a.ndim != 2:
            raise InvalidInput(f"upload expects a 2-D array; got shape {list(a.shape)}")
        a = np.ascontiguousarray(a, dtype=np.float32)
        arr = self._new_array(a.shape)
        self._write(arr, a)
        return arr

    def _new_array(self, shape: tuple[int, int], pooled: bool = False) -> WgpuArray:
        """A device array; ``pooled`` ones hand their buffer back to the model when collected
        (forward outputs: a loop of ``y = forward(x)`` then allocates nothing)."""
        import wgpu  # noqa: PLC0415

        nbytes = max(16, (shape[0] * shape[1] * 4 + 15) // 16 * 16)
        free = self._pool.get(nbytes) if pooled else None
        if free:
            buf = free.pop()
        else:
            usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
            try:
                buf = self.device.create_buffer(size=nbytes, usage=usage)
            except Exception as exc:
                raise LaunchError(f"wgpu could not allocate {nbytes} bytes: {exc}") from exc
        arr = WgpuArray(buf, (int(shape[0]), int(shape[1])), self.device)
        if pooled:
            weakref.finalize(arr, self._pool.setdefault(nbytes, []).append, buf)
        return arr

    def _write(self, arr: WgpuArray, a: np.ndarray) -> None:
        if a.size:
            try:
                self.device.queue.write_buffer(arr.buffer, 0, a)
            except Exception as exc:
                raise LaunchError(f"wgpu upload failed: {exc}") from exc

    def download(self, a: Any) -> np.ndarray:
        if not isinstance(a, WgpuArray):
            return np.asarray(a)
        self._check_open()
        if a.nbytes == 0:
            return np.zeros(a.shape, dtype=np.float32)
        return self._read(a.buffer, a.nbytes, np.float32).reshape(a.shape)

    def _read(self, buffer: Any, nbytes: int, dtype) -> np.ndarray:
        try:
            raw = self.device.queue.read_buffer(buffer, 0, nbytes)
        except Exception as exc:
            raise LaunchError(f"wgpu download failed: {exc}") from exc
        return np.frombuffer(raw, dtype=dtype).copy()

    def synchronize(self) -> None:
        # a 4-byte read-back waits for all submitted work (wgpu-py 0.32's
        # on_submitted_work_done_sync does not match wgpu-native 29's callback signature)
        self._check_open()
        self._read(self.buffers["losses"], 4, np.float32)

    def _scratch_array(self, name: str, a: np.ndarray) -> WgpuArray:
        """A model-owned device array holding ``a`` (reused while the shape stays the same)."""
        arr = self._scratch.get(name)
        if arr is None or arr.shape != a.shape:
            arr = self._new_array(a.shape)
            self._scratch[name] = arr
        self._write(arr, a)
        return arr

    def _device_rows(self, a: Any, cols: int, name: str, encode: bool = False) -> tuple[WgpuArray, bool]:
        """(the rows on the device, whether they came as a device array); with ``encode``, the
        kernel input (``_kernel_input``): the host's part of the input encoding applied first, so
        inputs that need none (a grid alone, or Identity) stay on the device."""
        on_host = encode and self._encodes_on_host
        if isinstance(a, WgpuArray):
            if a.device is not self.device:
                raise InvalidInput(f"{name} lives on another wgpu device")
            if a.shape[1] != cols:
                raise InvalidInput(f"{name} must have shape [rows, {cols}]; got {list(a.shape)}")
            if on_host:
                return self._scratch_array(f"{name}.encoded", self._kernel_input(self.download(a))), True
            return a, True
        host = check_rows(a, cols, name)
        return self._scratch_array(name, self._kernel_input(host) if on_host else host), False

    @property
    def _encodes_on_host(self) -> bool:
        if self.plan.grids:
            return bool(self.plan.host_parts)
        return not self.spec.encoding.passthrough

    def _kernel_input(self, x: np.ndarray) -> np.ndarray:
        """What the kernels read for host rows ``x``: without grids the encoded input (``encode``);
        with grids the raw input followed by the host-encoded parameter-free parts (the kernels
        interpolate the grid columns from the raw dims, encodings.grid_input_layout)."""
        if not self.plan.grids:
            return self.encode(x)
        return nm.grid_kernel_input(self.spec.encoding, x)

    # -- compute --------------------------------------------------------------------------
    def forward(self, x: Any, out_dtype: Any = np.float32) -> Any:
        dtype = output_dtype(out_dtype)
        self._check_open()
        with self._lock:
            xa, on_device = self._device_rows(x, self.spec.n_input_dims, "input", encode=True)
            rows = xa.shape[0]
            y = self._new_array((rows, self.spec.n_output_dims), pooled=True) if on_device else \
                self._scratch_out((rows, self.spec.n_output_dims))
            if rows:
                rec = _Recorder(self)
                step = self.plan.fwd_chunk_rows
                for start in range(0, rows, step):
                    n = min(step, rows - start)
                    group = self._io_group("fwd_infer", start, n, {"x_in": xa, "y_out": y})
                    rec.dispatch("fwd_infer", rec.slot(n), (ceil_div(n, self.plan.rows), 1, 1), group)
                rec.flush()
            if on_device:
                if dtype != np.float32:
                    raise InvalidInput("the wgpu backend's device outputs are float32: download, then cast")
                return y
            return self.download(y).astype(dtype, copy=False)

    def _scratch_out(self, shape: tuple[int, int]) -> WgpuArray:
        arr = self._scratch.get("output")
        if arr is None or arr.shape != shape:
            arr = self._new_array(shape)
            self._scratch["output"] = arr
        return arr

    def _record_step(self, rec: _Recorder, xa: WgpuArray, ya: WgpuArray, loss_slot: int, lr_t: float,
                     optimize: bool, ema: tuple[float, float] = (0.0, 0.0), lr_base: float = 0.0) -> None:
        plan = self.plan
        rows = xa.shape[0]
        chunk = min(plan.chunk_rows, (rows + 255) // 256 * 256)
        n_splits = max(1, min(plan.n_splits_max, chunk // 256))
        rows_per_split = ceil_div(ceil_div(chunk, n_splits), 16) * 16
        self._ensure_training_scratch(chunk, n_splits)
        inv_count = 1.0 / (rows * self.spec.n_output_dims)
        loss_wg = min(MAX_EW_WORKGROUPS, ceil_div(chunk * plan.op[-1], 256))
        ew_wg = min(MAX_EW_WORKGROUPS, ceil_div(plan.p, 256))
        opt_wg = min(MAX_EW_WORKGROUPS, ceil_div(plan.p_all, 256))
        starts = list(range(0, rows, chunk))
        for c, start in enumerate(starts):
            n = min(chunk, rows - start)
            first, last = c == 0, c == len(starts) - 1
            launch = dict(rows_per_split=rows_per_split, first=first, last=last, loss_slot=loss_slot,
                          inv_count=inv_count, lr_t=lr_t, n_splits=n_splits, n_loss_wg=loss_wg, ema=ema,
                          lr_base=lr_base)
            off = rec.slot(n, **launch)
            tiles = ceil_div(n, plan.rows)
            rec.dispatch("fwd_train", off, (tiles, 1, 1), self._io_group("fwd_train", start, n, {"x_in": xa}))
            rec.dispatch("loss_grad", off, (loss_wg, 1, 1), self._io_group("loss_grad", start, n, {"targets": ya}))
            rec.dispatch("loss_reduce", off, (1, 1, 1))
            rec.dispatch("bwd", off, (tiles, 1, 1))
            for i in range(plan.n_layers):
                rec.dispatch(f"wgrad_{i}", off, (ceil_div(plan.kp[i] + 1, 64), ceil_div(plan.op[i], 64), n_splits))
            rec.dispatch("grad_reduce", off, (ew_wg, 1, 1))
            for grid in plan.grids:
                self._record_grid_gradient(rec, xa, start, n, grid.index, first)
            if plan.grids:  # the sort's slots may have filled the uniform buffer: ``off`` is stale after a flush
                off = rec.slot(n, **launch)
            if last and optimize:
                rec.dispatch("optimize", off, (opt_wg, 1, 1))

    def _record_grid_gradient(self, rec: _Recorder, xa: WgpuArray, start: int, n: int, k: int, first: bool) -> None:
        """grid{k}'s table gradient for the chunk's rows (after ``bwd`` wrote d loss / d encoded
        input): its table reads, their bitonic sort by table row, the gather into ``grad``
        (wgsl._grid_wgsl). Set on the step's first chunk, added after. The sort's passes of
        distance below SORT_BLOCK run in workgroup memory, a dispatch per merge size; the longer
        ones a global dispatch each."""
        grid = self.plan.grids[k]
        items = _sort_items(n * grid.lookups)
        off = rec.slot(n, first=first, sort=(items, 0, 0))
        rec.dispatch(f"grid_keys_{k}", off, (min(MAX_EW_WORKGROUPS, ceil_div(items, 256)), 1, 1),
                     self._io_group(f"grid_keys_{k}", start, n, {"x_in": xa}))
        pairs_wg = min(MAX_EW_WORKGROUPS, ceil_div(items // 2, 256))
        blocks = (items // SORT_BLOCK, 1, 1)
        rec.dispatch("grid_sort_block", rec.slot(n, sort=(items, 0, 0)), blocks)
        size = 2 * SORT_BLOCK
        while size <= items:
            distance = size // 2
            while distance >= SORT_BLOCK:
                rec.dispatch("grid_sort", rec.slot(n, sort=(items, distance, size)), (pairs_wg, 1, 1))
                distance //= 2
            rec.dispatch("grid_merge_block", rec.slot(n, sort=(items, 0, size)), blocks)
            size *= 2
        rec.dispatch(f"grid_gather_{k}", rec.slot(n, first=first, sort=(items, 0, 0)),  # a fresh slot: see flush
                     (min(MAX_EW_WORKGROUPS, ceil_div(grid.entries, 256)), 1, 1))

    def _train_inputs(self, x: Any, y: Any) -> tuple[WgpuArray, WgpuArray]:
        xa, _ = self._device_rows(x, self.spec.n_input_dims, "input", encode=True)
        ya, _ = self._device_rows(y, self.spec.n_output_dims, "target")
        if xa.shape[0] != ya.shape[0]:
            raise InvalidInput(f"target has {ya.shape[0]} rows but input has {xa.shape[0]}")
        if xa.shape[0] == 0:
            raise InvalidInput("training needs at least one row")
        return xa, ya

    def train_step(self, x: Any, y: Any, steps: int = 1) -> np.ndarray:
        self._check_open()
        if steps < 1:
            raise InvalidInput(f"steps must be at least 1; got {steps}")
        with self._lock:
            xa, ya = self._train_inputs(x, y)
            losses = np.empty(steps, dtype=np.float32)
            done = 0
            while done < steps:
                batch = min(STEP_SLOTS, steps - done)
                rec = _Recorder(self)
                for s in range(batch):
                    self._record_step(rec, xa, ya, s, self.next_step_rate(), optimize=True, ema=self._next_ema_factors(),
                                      lr_base=nm.step_base_rate(self.spec.optimizer, self.step_count + 1))
                    self.step_count += 1
                rec.flush()
                losses[done:done + batch] = self._read(self.buffers["losses"], batch * 4, np.float32)
                done += batch
            return losses

    def _next_ema_factors(self) -> tuple[float, float]:
        ema = self.spec.optimizer.ema
        return (0.0, 0.0) if ema is None else nm.ema_factors(ema, self.step_count + 1)

    def loss_and_grads(self, x: Any, y: Any) -> tuple[float, dict[str, np.ndarray]]:
        self._check_open()
        with self._lock:
            xa, ya = self._train_inputs(x, y)
            rec = _Recorder(self)
            self._record_step(rec, xa, ya, 0, 0.0, optimize=False)
            rec.flush()
            loss = float(self._read(self.buffers["losses"], 4, np.float32)[0])
            grad = self._read(self.buffers["grad"], self.plan.p_all * 4, np.float32) / np.float32(self.spec.loss_scale)
            return loss, self._unpack(grad)

    # -- parameters -----------------------------------------------------------------------
    def _pack(self, params: dict[str, np.ndarray]) -> np.ndarray:
        flat = np.zeros(self.plan.p_all, dtype=np.float32)
        for i, (fan_in, fan_out) in enumerate(self.spec.layer_dims):
            w = flat[self.plan.woff[i]:self.plan.woff[i] + self.plan.op[i] * self.plan.kp[i]]
            w.reshape(self.plan.op[i], self.plan.kp[i])[:fan_out, :fan_in] = params[f"W{i}"]
            flat[self.plan.boff[i]:self.plan.boff[i] + fan_out] = params[f"b{i}"]
        for grid in self.plan.grids:  # the tables follow the MLP, row-major as tcnn lays them out
            flat[grid.offset:grid.offset + grid.entries * grid.features] = params[f"grid{grid.index}"].ravel()
        return flat

    def _unpack(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        out = {}
        for i, (fan_in, fan_out) in enumerate(self.spec.layer_dims):
            w = flat[self.plan.woff[i]:self.plan.woff[i] + self.plan.op[i] * self.plan.kp[i]]
            out[f"W{i}"] = np.ascontiguousarray(w.reshape(self.plan.op[i], self.plan.kp[i])[:fan_out, :fan_in])
            out[f"b{i}"] = flat[self.plan.boff[i]:self.plan.boff[i] + fan_out].copy()
        for grid in self.plan.grids:
            values = flat[grid.offset:grid.offset + grid.entries * grid.features]
            out[f"grid{grid.index}"] = values.reshape(grid.entries, grid.features).copy()
        return out

    def _write_buffer(self, name: str, data: np.ndarray) -> None:
        try:
            self.device.queue.write_buffer(self.buffers[name], 0, np.ascontiguousarray(data))
        except Exception as exc:
            raise LaunchError(f"wgpu upload of {name} failed: {exc}") from exc

    def get_params(self) -> dict[str, np.ndarray]:
        self._check_open()
        with self._lock:
            return self._unpack(self._read(self.buffers["master"], self.plan.p_all * 4, np.float32))

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        self._check_open()
        flat = self._pack(check_params(self.spec, params))
        with self._lock:
            self._write_weights("master", "wc", flat)
            if self.spec.optimizer.ema is not None:  # inference serves the weights just set, as on cpu
                self._write_weights("ema", "ema_wc", flat)

    def _write_weights(self, master: str, compute: str, flat: np.ndarray) -> None:
        """fp32 values to ``master`` and their compute-type copy to ``compute``."""
        self._write_buffer(master, flat)
        if self.native_f16:
            self._write_buffer(compute, flat.astype(np.float16))
        else:
            self._write_buffer(compute, nm.round_to(self.spec.precision, flat).astype(np.float32))

    def _slot_buffers(self) -> list[str]:
        moments = ["mom1", "mom2"] if self.spec.optimizer.otype == "Adam" else ["mom1"]
        return moments + (["ema"] if self.spec.optimizer.ema is not None else [])

    def _read_slot(self, slot: int) -> dict[str, np.ndarray]:
        self._check_open()
        with self._lock:
            return self._unpack(self._read(self.buffers[self._slot_buffers()[slot]], self.plan.p_all * 4, np.float32))

    def _write_slots(self, slots: list[dict[str, np.ndarray]], step: int) -> None:
        self._check_open()
        with self._lock:
            for buf, values in zip(self._slot_buffers(), slots):
                if buf == "ema":  # a restored average is what inference serves
                    self._write_weights("ema", "ema_wc", self._pack(values))
                else:
                    self._write_buffer(buf, self._pack(values))

    def get_optimizer_state(self) -> dict[str, np.ndarray]:
        """The contract's state plus, for grid tables under Adam, ``steps.grid{k}``: each value's
        own step count (uint32), as the cpu backend keeps it."""
        state = super().get_optimizer_state()
        if self._grid_adam:
            with self._lock:
                steps = self._read(self.buffers["gsteps"], (self.plan.p_all - self.plan.p) * 4, np.uint32)
            for grid in self.plan.grids:
                begin = grid.offset - self.plan.p
                state[f"steps.grid{grid.index}"] = steps[begin:begin + grid.entries * grid.features].reshape(
                    grid.entries, grid.features)
        return state

    def set_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore what ``get_optimizer_state`` returned. A state without ``steps.grid{k}`` (written
        by a backend that keeps none) counts the optimizer's steps for every value Adam has moved
        (v ≠ 0), as the cpu backend does."""
        super().set_optimizer_state(state)
        if not self._grid_adam:
            return
        steps = np.zeros(self.plan.p_all - self.plan.p, np.uint32)
        for grid in self.plan.grids:
            values = nm.grid_steps_from_state(state, f"grid{grid.index}", (grid.entries, grid.features),
                                              self.step_count)
            begin = grid.offset - self.plan.p
            steps[begin:begin + values.size] = values.ravel()
        with self._lock:
            self._write_buffer("gsteps", steps)

    def device_bytes(self) -> int:
        return sum(b.size for b in self.buffers.values()) + sum(a.buffer.size for a in self._scratch.values())

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pooled = [b for bufs in self._pool.values() for b in bufs]
            for buf in list(self.buffers.values()) + [a.buffer for a in self._scratch.values()] + pooled:
                buf.destroy()
            self.buffers.clear()
            self._scratch.clear()
            self._pool.clear()
            self.model_groups = {}


# -- the backend ----------------------------------------------------------------------------
class WgpuBackend(Backend):
    name = "wgpu"

    def __init__(self, native_f16: bool | None = None, max_stage_rows: int | None = None):
        # native_f16=False stores fp16 models in f32 with emulated rounding even when the adapter
        # has shader-f16 (to test that path); None uses f16 whenever the adapter offers it
        self.native_f16 = native_f16
        # weight rows staged per chunk: None = whole layers on hardware, 16 on CPU adapters
        self.max_stage_rows = max_stage_rows
        self._adapter = None
        self._device = None
        self._modules: dict[str, Any] = {}  # WGSL hash -> (pipelines, layouts), per device
        self._lock = threading.Lock()

    def _get_adapter(self):
        if self._adapter is None:
            wgpu = _import_wgpu()
            power = os.environ.get("MMAD_WGPU_POWER", "high-performance")
            adapter = wgpu.gpu.request_adapter_sync(power_preference=power)
            if adapter is None:
                raise BackendUnavailable("wgpu", "wgpu found no adapter (no Vulkan/Metal/D3D12/GL driver)")
            self._adapter = adapter
        return self._adapter

    def probe(self) -> list[ProbeRow]:
        try:
            wgpu = _import_wgpu()
            adapter = self._get_adapter()
            info = dict(adapter.info)
            features = sorted(str(f) for f in adapter.features)
            limits = {k: int(adapter.limits[k]) for k in _LIMITS if k in adapter.limits}
        except BackendUnavailable as exc:
            return [ProbeRow("wgpu", "default", False, reason=exc.reason)]
        except Exception as exc:  # noqa: BLE001 - a probe never raises
            return [ProbeRow("wgpu", "default", False, reason=f"wgpu adapter request failed: {exc}")]
        software = _is_software(info)
        f16 = "shader-f16" in features
        details = {
            "adapter_type": info.get("adapter_type", ""), "backend_type": info.get("backend_type", ""),
            "vendor": info.get("vendor", ""), "driver": info.get("description", ""),
            "f16": f16, "subgroup": "subgroup" in features,
            "storage": "f16" if f16 else "f32 (fp16 rounding emulated with pack2x16float)",
            "features": [f for f in features if f in _INTERESTING_FEATURES],
            "limits": limits, "wgpu_py": wgpu.__version__,
            "cooperative_matrix": ("offered (8x8 f32), not used: the wgpu kernels have no cooperative-matrix form"
                                   if COOPMAT_FEATURE in features else f"{COOPMAT_FEATURE} not offered by this adapter"),
        }
        reason = "software adapter (CPU): used only when forced with MMAD_BACKEND=wgpu" if software else ""
        return [ProbeRow("wgpu", "default", True, device=f"{info.get('device', '?')} ({info.get('backend_type', '?')})",
                         api_version=f"wgpu-native {_native_version(wgpu)}", reason=reason, software=software,
                         details=details)]

    def _get_device(self):
        if self._device is None:
            adapter = self._get_adapter()
            features = [f for f in ("shader-f16",) if f in adapter.features]
            limits = {k: adapter.limits[k] for k in _LIMITS if k in adapter.limits}
            try:
                self._device = adapter.request_device_sync(required_features=features, required_limits=limits)
            except Exception as exc:
                raise BackendUnavailable("wgpu", f"wgpu device request failed: {exc}") from exc
        return self._device

    def compile(self, spec: MLPSpec, variant: str | None = None, cache: Any = None, device: int = 0,
                batch_rows: int | None = None) -> WgpuModel:
        if variant not in (None, "default"):
            raise SpecError("variant", f"the wgpu backend has one variant, 'default'; got {variant!r}")
        check_device_index(device, 1, "wgpu")  # one adapter: the one the probe chose
        with self._lock:
            device = self._get_device()
            adapter = self._adapter
            native_f16 = "shader-f16" in device.features and self.native_f16 is not False
            limits = {k: int(device.limits[k]) for k in _LIMITS if k in device.limits}
            info = dict(adapter.info)
            stage_rows = self.max_stage_rows or (16 if _is_software(info) else 4096)
            return WgpuModel(spec, device, info, limits, native_f16, cache, self._modules, stage_rows)

    def close(self) -> None:
        self._modules.clear()
        self._device = None
        self._adapter = None


__all__ = ["WgpuBackend", "WgpuModel", "WgpuArray", "generate_wgsl", "make_plan"]
