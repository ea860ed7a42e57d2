"""The backend contract: what every backend package or module under ``mmad/backends/`` provides.

A backend module exposes one class derived from :class:`Backend`:

* ``probe()`` → one :class:`ProbeRow` per variant (``cuda``: wgmma / mma / cublaslt,
  ``vulkan``: coopmat2 / coopmat / simt, ``wgpu`` and ``cpu``: one each). It never raises and never
  crashes the process: an unusable stack is a row with ``available=False`` and a ``reason``.
* ``compile(spec, variant=None, cache=None, device=0)`` → a :class:`CompiledModel` specialised
  for the spec's widths, activations and precision, on device ``device`` (an index into
  ``devices()``); ``variant=None`` picks the best usable variant.
* ``devices()`` → one :class:`DeviceInfo` per device the backend can place models on (every
  CUDA device, every Vulkan physical device of the chosen kind; the cpu backend has one, or
  ``MMAD_CPU_DEVICES`` virtual ones).
* ``data_parallel(replicas)`` → a :class:`DataParallel` trainer over replicas of one model on
  different devices (NCCL on cuda; :class:`HostDataParallel`, host arrays, elsewhere).

A :class:`CompiledModel` owns its device buffers (weights, fp32 masters, optimizer moments)
and keeps them on the device between calls. Parameters cross the host boundary only through
``get_params``/``set_params`` (unpadded fp32 arrays, named ``W{i}`` with shape
``(fan_out, fan_in)`` and ``b{i}`` with shape ``(fan_out,)``, input layer first, then a grid
encoding's table ``grid{k}``: see :func:`param_shapes`).

Numerics every backend follows (docs/design.md, "Numerics"): the encoded input is rounded to the
compute type (fp16/bf16) before the first product; every product accumulates in fp32; bias and
activation are applied to the fp32 accumulator and the result rounded to the compute type for
the next layer; the last layer's output stays fp32. Backward multiplies the loss gradient by
``spec.loss_scale``, rounds each layer's gradient to the compute type, accumulates weight
gradients in fp32 and divides by the loss scale before the optimizer step on fp32 masters.

Backward from an outside gradient (what a PyTorch module needs, :mod:`mmad.torch`):
``forward_train(x)`` returns the outputs and a :class:`ForwardContext`, ``backward(ctx, dL_dy,
want_input_grad)`` the gradients of the parameters (named as ``get_params``) and, when asked,
d loss / d input, with the numerics of training: ``dL_dy`` is multiplied by the loss scale, each
layer's delta rounded to the compute type, d loss / d encoded input (delta_0 · W_0) rounded to
the compute type as tiny-cuda-nn's network hands it to its encoding, then every gradient divided
by the loss scale. Device arrays in, device arrays out, enqueued on ``stream`` without waiting.
"""

from __future__ import annotations

import abc
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable

import numpy as np

from mmad.backends.numerics import (
    EpochPosition, all_finite, check_epoch_run, encode as encode_inputs, epoch_rows, step_learning_rate,
)
from mmad.errors import BackendUnavailable, InvalidInput, NonFiniteInput, SpecError
from mmad.spec import MLPSpec

# Auto-selection order, highest first; software devices (lavapipe, a CPU WebGPU adapter)
# are never chosen automatically (see ``ProbeRow.software``).
PRIORITY = {
    ("cuda", "wgmma"): 100,
    ("cuda", "wgmma+mma"): 95,
    ("cuda", "mma"): 90,
    ("cuda", "mma-f16acc"): 85,
    ("cuda", "cublaslt"): 80,
    ("cuda", "wgmma+cublaslt"): 79,
    ("cuda", "mma-f16acc+cublaslt"): 78,
    ("vulkan", "coopmat2"): 68,  # below coopmat: taken only when named (measured slower on the H200)
    ("vulkan", "coopmat"): 70,
    ("vulkan", "simt"): 50,
    ("wgpu", "default"): 40,
    ("cpu", "numpy"): 0,
}


@dataclass(frozen=True)
class MMAShape:
    """One matrix-multiply-accumulate shape a device offers (M×N×K, A·B + C → result)."""

    m: int
    n: int
    k: int
    a_type: str = "f16"
    b_type: str = "f16"
    c_type: str = "f32"
    result_type: str = "f32"
    scope: str = "subgroup"

    def __str__(self) -> str:
        return f"{self.m}x{self.n}x{self.k} {self.a_type}*{self.b_type}+{self.c_type}->{self.result_type}"


@dataclass
class ProbeRow:
    """What one backend variant can do here, or why not."""

    backend: str
    variant: str
    available: bool
    device: str = ""
    api_version: str = ""
    reason: str = ""
    software: bool = False
    mma_shapes: list[MMAShape] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def priority(self) -> int:
        return PRIORITY.get((self.backend, self.variant), 10)

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "variant": self.variant, "available": self.available,
            "device": self.device, "api_version": self.api_version, "reason": self.reason,
            "software": self.software, "priority": self.priority,
            "mma_shapes": [str(s) for s in self.mma_shapes], "details": self.details,
        }


@dataclass
class DeviceInfo:
    """One device a backend can place models on: its index (``compile(device=...)``), name and
    memory (bytes; None where the backend cannot tell)."""

    index: int
    name: str
    memory_total: int | None = None
    memory_free: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "memory_total": self.memory_total,
                "memory_free": self.memory_free}


@dataclass
class Dataset:
    """A training set held for one model by its backend: ``x`` as the training step reads it
    (encoded already where the backend encodes ahead) and ``y``, each float16 or float32 as sent,
    on the device where the backend trains from device memory (``on_device``)."""

    x: Any
    y: Any
    rows: int
    nbytes: int
    on_device: bool


@dataclass
class ForwardContext:
    """What ``forward_train`` keeps for ``backward``: the rows, the parameters' version it ran
    on (``backward`` refuses a context whose parameters have changed since) and the backend's
    own state (its saved activations, or what its backward kernels recompute them from)."""

    model_id: int
    version: tuple[int, int]
    rows: int
    state: Any = None


class CompiledModel(abc.ABC):
    """A model compiled for one backend variant; owns device buffers until ``close()``.

    A backend provides: ``forward``, ``train_step``, ``loss_and_grads``, ``get_params`` /
    ``set_params``, ``_read_slot`` / ``_write_slots`` (the optimizer's per-parameter arrays),
    and, when its arrays live on a device, ``upload`` / ``download`` / ``synchronize`` /
    ``is_device_array``. The contract owns the bookkeeping: the step count and the learning
    rate of the next step, the optimizer state's names, shapes and validation, the input
    encoding, the output dtype choice.
    """

    backend: ClassVar[str]
    variant: str
    device_index: int = 0  # the backend's device (``Backend.devices()``) holding the buffers
    # the dispatcher's Decision when the backend chose the variant by measurement (mmad.backends.dispatch)
    dispatch: Any = None
    # whether the variant keeps an EMA slot and infers from it (tcnn's EMA optimizer wrapper)
    supports_ema: ClassVar[bool] = False

    def __init__(self, spec: MLPSpec):
        if spec.optimizer.ema is not None and not self.supports_ema:
            where = f"the {self.backend} backend's {getattr(self, 'variant', 'default')} variant"
            raise SpecError("optimizer", f"the EMA optimizer wrapper is not implemented on {where}; drop the EMA "
                                         "wrapper or use the cpu, vulkan, wgpu or cuda mma backend")
        self.spec = spec
        self.step_count = 0
        self.params_version = 0  # bumped by every set_params: ForwardContext.version with step_count

    # -- compute --------------------------------------------------------------------------
    @abc.abstractmethod
    def forward(self, x: Any, out_dtype: Any = np.float32) -> Any:
        """Outputs (rows × n_output_dims) for raw inputs (rows × n_input_dims, fp16/fp32).

        Host arrays in → host array out; device arrays in → device array out (no copy back).
        ``out_dtype`` is float32 (default) or float16 (rounded once from the fp32 result;
        :func:`output_dtype` checks it). The input encoding is applied by ``encode``.
        """

    def forward_into(self, x: Any, out: Any) -> None:
        """``forward(x)`` written into ``out`` (an array on the same side, rows × n_output_dims, in
        its dtype): what a forward between two device regions needs. A backend whose kernel can
        write ``out`` itself skips the copy made here."""
        out[...] = self.forward(x, out_dtype=out.dtype)

    def forward_group(self, pairs: list[tuple[Any, Any]], nonfinite: Any = None) -> None:
        """``forward_into(x, out)`` for every pair, launched as one unit of work where the backend
        can (the daemon's group of forwards between shared-memory regions). ``nonfinite``: an
        array of words on the pairs' side, one per pair, zeroed by the caller; word i is set to 1
        when pair i's input holds NaN or Inf (its output is then unspecified). Nothing waits
        for the device: the caller synchronizes."""
        for i, (x, out) in enumerate(pairs):
            if nonfinite is not None and not all_finite(x):
                nonfinite[i] = 1
            self.forward_into(x, out)

    @abc.abstractmethod
    def train_step(self, x: Any, y: Any, steps: int = 1) -> np.ndarray:
        """``steps`` optimizer steps on the batch (x, y); returns each step's loss (fp32).

        Each step's learning rate is ``next_step_rate()``; ``step_count`` grows by one a step.
        """

    @abc.abstractmethod
    def loss_and_grads(self, x: Any, y: Any) -> tuple[float, dict[str, np.ndarray]]:
        """Loss and unscaled fp32 gradients of every parameter, without an optimizer step."""

    # -- backward from an outside gradient ------------------------------------------------------
    def forward_train(self, x: Any, out_dtype: Any = np.float32, stream: Any = None) -> tuple[Any, ForwardContext]:
        """``forward(x)`` on the training parameters (never an EMA average) and what ``backward``
        needs of it. ``stream``: the backend's stream handle to enqueue on (cuda: a
        ``cudaStream_t`` as an int, e.g. torch's current stream; None: the current one); nothing
        waits for the device."""
        raise InvalidInput(f"the {self.backend} backend's {self.variant} variant has no backward from an outside "
                           "gradient; use the cpu backend or the cuda mma variant")

    def backward(self, ctx: ForwardContext, dL_dy: Any, want_input_grad: bool = False,
                 stream: Any = None) -> tuple[Any, dict[str, Any]]:
        """(d loss / d input or None, d loss / d every parameter) for ``dL_dy`` (rows ×
        n_output_dims, float16/32, on the side of ``forward_train``'s input) at ``ctx``'s forward.
        The gradients are unscaled fp32 arrays named and shaped as ``get_params`` (the cpu
        backend's float64 numerics: float64), d loss / d input rows × n_input_dims fp32; device
        arrays where the forward's input was one, enqueued on ``stream`` without waiting."""
        raise InvalidInput(f"the {self.backend} backend's {self.variant} variant has no backward from an outside "
                           "gradient; use the cpu backend or the cuda mma variant")

    def _forward_context(self, rows: int, state: Any) -> ForwardContext:
        return ForwardContext(id(self), (self.step_count, self.params_version), rows, state)

    def check_forward_context(self, ctx: Any, dL_dy: Any) -> None:
        """``ctx`` is this model's ``forward_train`` on the parameters it holds now, ``dL_dy`` its
        rows × n_output_dims; a clear error otherwise."""
        if not isinstance(ctx, ForwardContext) or ctx.model_id != id(self):
            raise InvalidInput("backward needs the context forward_train of this model returned")
        if ctx.version != (self.step_count, self.params_version):
            raise InvalidInput("the model's parameters changed after forward_train: run forward_train again "
                               "before backward")
        shape = tuple(np.shape(dL_dy))
        if shape != (ctx.rows, self.spec.n_output_dims):
            raise InvalidInput(f"dL_dy (the output's gradient) must have shape [{ctx.rows}, {self.spec.n_output_dims}] "
                               f"as forward_train's output; got {list(shape)}")

    def apply_gradients(self, grads: dict[str, np.ndarray]) -> None:
        """One optimizer step with the given (unscaled, fp32, named like ``get_params``)
        gradients: what :class:`~mmad.backends.parallel.HostDataParallel` applies on every
        replica after summing theirs. Backends that train data-parallel another way need not."""
        raise InvalidInput(f"the {self.backend} backend's {self.variant} variant cannot apply gradients "
                           "computed elsewhere, so it cannot train data-parallel over several devices")

    def forward_to_host(self, x: np.ndarray, out: np.ndarray, executor: Executor | None = None,
                        check_finite: bool = False) -> None:
        """``forward(x)`` for host arrays, written into the host array ``out`` in its dtype.

        ``out`` is rows × n_output_dims, float16 or float32 (e.g. a view of a response buffer).
        A backend may use ``executor``'s threads for host-side work; this default ignores it.
        ``check_finite``: raise :class:`~mmad.errors.NonFiniteInput` when ``x`` holds NaN or
        Inf (``out`` may have been written by then); a backend that copies to a device checks
        the rows there, where it costs no host time.
        """
        out = check_host_output(out, np.shape(x)[0], self.spec.n_output_dims)
        if check_finite:
            check_finite_rows(np.asarray(x))
        np.copyto(out, self.download(self.forward(x, out_dtype=out.dtype)), casting="same_kind")

    def encode(self, x: np.ndarray) -> np.ndarray:
        """The spec's input encoding of host rows (float32): every backend encodes here, on the
        host, before the upload (``numerics.encode`` is the one definition)."""
        if self.spec.encoding.passthrough:
            return np.ascontiguousarray(x, dtype=np.float32)
        return np.ascontiguousarray(encode_inputs(self.spec.encoding, x), dtype=np.float32)

    # -- training from a held dataset --------------------------------------------------------
    def dataset_bytes(self, rows: int, x_dtype: Any, y_dtype: Any) -> int:
        """Bytes ``put_dataset`` will hold for ``rows`` rows of these dtypes."""
        return rows * (self.spec.n_input_dims * np.dtype(x_dtype).itemsize
                       + self.spec.n_output_dims * np.dtype(y_dtype).itemsize)

    def free_device_bytes(self) -> int | None:
        """Memory free now where ``put_dataset`` allocates (None: this backend cannot tell)."""
        return None

    def put_dataset(self, chunks: Iterable[tuple[np.ndarray, np.ndarray]], rows: int,
                    x_dtype: Any, y_dtype: Any) -> Dataset:
        """Hold a dataset arriving as (x, y) chunks of ``rows`` rows in all (host arrays, the
        given dtypes): allocated once, filled chunk by chunk. This default keeps host arrays."""
        x = np.empty((rows, self.spec.n_input_dims), dtype=x_dtype)
        y = np.empty((rows, self.spec.n_output_dims), dtype=y_dtype)

        def write(at: int, cx: np.ndarray, cy: np.ndarray) -> None:
            x[at:at + len(cx)], y[at:at + len(cy)] = cx, cy

        fill_dataset(chunks, rows, write)
        return Dataset(x, y, rows, x.nbytes + y.nbytes, on_device=False)

    def take_rows(self, a: Any, rows: np.ndarray) -> Any:
        """The rows ``rows`` of a dataset array (host or device, as ``put_dataset`` keeps it)."""
        return a[rows]

    def train_epochs(self, data: Dataset, batch: int, steps: int, position: EpochPosition) -> np.ndarray:
        """``steps`` optimizer steps on consecutive batches of ``data`` in the order of
        ``position`` (advanced past them); returns each step's loss. Backends that draw the
        batches on the device override this; this one gathers each batch and calls ``train_step``."""
        check_epoch_run(data, batch, steps)
        losses = np.empty(steps, dtype=np.float32)
        for s in range(steps):
            rows = epoch_rows(position.seed, position.epoch, data.rows, position.cursor, batch)
            losses[s] = self.train_step(self.take_rows(data.x, rows), self.take_rows(data.y, rows), 1)[0]
            position.advance(data.rows, batch)
        return losses

    # -- parameters -----------------------------------------------------------------------
    @abc.abstractmethod
    def get_params(self) -> dict[str, np.ndarray]:
        """fp32 master parameters, unpadded (``W{i}``: fan_out × fan_in, ``b{i}``)."""

    @abc.abstractmethod
    def set_params(self, params: dict[str, np.ndarray]) -> None:
        """Replace every parameter (validated by :func:`check_params`); resets nothing else."""

    # -- optimizer state: the names, shapes, step count and checks live here --------------
    @abc.abstractmethod
    def _read_slot(self, slot: int) -> dict[str, np.ndarray]:
        """The optimizer's ``slot``-th array per parameter (``optimizer_slots(spec)[slot]``),
        fp32, unpadded, named like ``get_params``."""

    @abc.abstractmethod
    def _write_slots(self, slots: list[dict[str, np.ndarray]], step: int) -> None:
        """Replace every slot (validated: one dict per ``optimizer_slots`` entry, fp32 arrays of
        the parameters' shapes) and whatever the device keeps of the step count."""

    def next_step_rate(self) -> float:
        """The learning rate of the next optimizer step (Adam's bias correction included)."""
        return step_learning_rate(self.spec.optimizer, self.step_count + 1)

    def step_rates(self, steps: int) -> np.ndarray:
        """The learning rates of the next ``steps`` optimizer steps (``next_step_rate`` onwards),
        float32: the table the device-side training loops index by their step counter."""
        first = self.step_count + 1
        return np.array([step_learning_rate(self.spec.optimizer, first + k) for k in range(steps)], np.float32)

    def get_optimizer_state(self) -> dict[str, np.ndarray]:
        """Optimizer state as named fp32 arrays (``m.W0``, ``v.W0``, ... or ``velocity.W0``)
        plus ``step`` (shape (1,), int64)."""
        state = {f"{slot}.{name}": value for j, slot in enumerate(optimizer_slots(self.spec))
                 for name, value in self._read_slot(j).items()}
        state["step"] = np.array([self.step_count], dtype=np.int64)
        return state

    def set_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore what ``get_optimizer_state`` returned (every name checked first)."""
        slots, step = check_optimizer_state(self.spec, state)
        self._write_slots(slots, step)
        self.step_count = step

    # -- host <-> device ------------------------------------------------------------------
    def is_device_array(self, x: Any) -> bool:
        """Whether ``x`` is this backend's device array (host backends: never)."""
        return False

    def upload(self, x: np.ndarray) -> Any:
        """Copy a host array to the device (returns the backend's device array)."""
        return np.ascontiguousarray(x)

    def download(self, a: Any) -> np.ndarray:
        """Copy a device array (from ``upload`` or ``forward``) back to the host."""
        return np.asarray(a)

    def synchronize(self) -> None:
        """Wait for every submitted launch to finish."""

    def device_bytes(self) -> int:
        """Bytes of device memory this model holds (for leak checks and metrics)."""
        return 0

    def close(self) -> None:
        """Free the device buffers; the model is unusable afterwards."""

    def __enter__(self) -> "CompiledModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- shared validation ----------------------------------------------------------------
    def check_input(self, x: np.ndarray, name: str = "input") -> np.ndarray:
        return check_rows(x, self.spec.n_input_dims, name)

    def check_target(self, y: np.ndarray, rows: int) -> np.ndarray:
        y = check_rows(y, self.spec.n_output_dims, "target")
        if y.shape[0] != rows:
            raise InvalidInput(f"target has {y.shape[0]} rows but input has {rows}")
        return y


class Backend(abc.ABC):
    """One compute stack (cpu, cuda, vulkan, wgpu)."""

    name: ClassVar[str]

    @abc.abstractmethod
    def probe(self) -> list[ProbeRow]:
        """One row per variant; never raises."""

    @abc.abstractmethod
    def compile(self, spec: MLPSpec, variant: str | None = None, cache: Any = None,
                device: int = 0, batch_rows: int | None = None) -> CompiledModel:
        """Compile ``spec`` (best usable variant when ``variant`` is None) on ``device``.
        ``batch_rows``: the batch the model will mostly run, where a backend measures its
        variants to choose one (cuda: :mod:`mmad.backends.dispatch`); ignored elsewhere."""

    def devices(self) -> list[DeviceInfo]:
        """The devices models can be placed on, index order; memory read now. This default: one,
        named by the first usable probe row."""
        row = next((r for r in self.probe() if r.available), None)
        return [DeviceInfo(0, row.device if row is not None else self.name)]

    def data_parallel(self, replicas: list[CompiledModel]) -> Any:
        """A :class:`~mmad.backends.parallel.DataParallel` trainer over ``replicas`` (one model
        compiled on several devices, identical weights). This default sums the replicas'
        gradients on the host (``loss_and_grads``, ``apply_gradients``)."""
        from mmad.backends.parallel import HostDataParallel

        return HostDataParallel(replicas)

    def pin_host_memory(self, buffer: Any) -> Callable[[], None] | None:
        """Page-lock a long-lived host buffer (a shared-memory region's mapping) so that copies to
        and from the device read and write it directly; returns the call that undoes it, or
        None where this backend copies nothing to a device (this default). Raises on failure."""
        return None

    def page_locked_allocator(self) -> Callable[[int], np.ndarray] | None:
        """``alloc(nbytes) -> uint8 array`` of page-locked host memory, for the daemon's request
        and response bodies (the host ends of device copies), or None where this backend copies
        nothing to a device (this default)."""
        return None

    def cuda_ipc_opener(self) -> Callable[[bytes, int, int], Any] | None:
        """``open(raw_handle, device_id, byte_size)``: a CUDA IPC handle of another process's
        allocation opened as a region the daemon reads and writes (Triton's CUDA shared memory),
        or None where this backend opens none (this default)."""
        return None

    def region_group_slot(self, device: int, size: int) -> Any:
        """A slot for one group of up to ``size`` forwards between shared-memory regions on
        ``device`` (``mmad serve --workers``: the primary runs its workers' region forwards):
        ``launching()`` (a context the group is launched in), ``start()``, ``upload(k, host)``,
        ``output(k, shape, dtype)``, ``download(device_array, host)``, ``words`` (a finiteness
        word per forward, for ``forward_group``), ``finish(count)``, ``wait()`` (the words on the
        host) and ``device``. Backends that serve no regions from a device have none (this default)."""
        raise BackendUnavailable(f"the {self.name} backend runs no forwards between shared-memory regions")

    def close(self) -> None:
        """Release the device and anything the probe opened."""


# -- helpers every backend uses -------------------------------------------------------------
def check_finite_rows(x: np.ndarray) -> None:
    """``forward_to_host``'s host-side ``check_finite``."""
    if not all_finite(x):
        raise NonFiniteInput()


def output_dtype(out_dtype: Any) -> np.dtype:
    """``forward``'s ``out_dtype`` as float16 or float32; anything else is a clear error."""
    dt = np.dtype(out_dtype)
    if dt not in (np.float16, np.float32):
        raise InvalidInput(f"out_dtype (the output type) must be float16 or float32; got {dt}")
    return dt


def check_rows_shape(x: Any, cols: int, name: str) -> Any:
    """``x`` (a host or a device array) as rows × cols of float16/32/64; clear errors otherwise."""
    if x.ndim == 1 and cols == 1:
        x = x.reshape(-1, 1)
    if x.ndim != 2 or x.shape[1] != cols:
        raise InvalidInput(f"{name} must have shape [rows, {cols}]; got {list(x.shape)}")
    if x.dtype not in (np.float32, np.float16, np.float64):
        raise InvalidInput(f"{name} must be floating-point numbers (float32 or float16); "
                           f"got {_elements(np.dtype(x.dtype))}")
    return x


def check_rows(x: Any, cols: int, name: str, keep_half: bool = False) -> np.ndarray:
    """A C-contiguous (rows × cols) float32 view or copy of ``x`` (float16 kept as it is with
    ``keep_half``); clear errors otherwise."""
    try:
        x = np.asarray(x)
    except (ValueError, TypeError) as exc:  # ragged nested lists
        raise InvalidInput(f"{name} must be rows of {cols} numbers; its rows have different lengths") from exc
    x = check_rows_shape(x, cols, name)
    if keep_half and x.dtype == np.float16:
        return np.ascontiguousarray(x)
    return np.ascontiguousarray(x, dtype=np.float32)


def _elements(dtype: np.dtype) -> str:
    """What an array holds, in words (not NumPy's type codes)."""
    kind = dtype.kind
    if kind in "US":
        return "text"
    if kind == "b":
        return "true/false values"
    if kind == "O":
        return "values that are not all numbers (None, or rows of different lengths)"
    if kind in "iu":
        return f"integers ({dtype.name})"
    return f"{dtype.name} values"


def fill_dataset(chunks: Iterable[tuple[Any, Any]], rows: int, write) -> None:
    """``write(at, x, y)`` for each non-empty (x, y) chunk, ``at`` the row it starts at; the chunks
    must hold exactly ``rows`` rows, x and y alike (``put_dataset``'s one bookkeeping)."""
    at = 0
    for cx, cy in chunks:
        n = np.shape(cx)[0]
        if np.shape(cy)[0] != n:
            raise InvalidInput(f"a chunk's target has {np.shape(cy)[0]} rows but its input has {n}")
        if at + n > rows:
            raise InvalidInput(f"the dataset's chunks hold more than the {rows} rows announced")
        if n:
            write(at, cx, cy)
        at += n
    if at != rows:
        raise InvalidInput(f"the dataset's chunks hold {at} rows, not the {rows} announced")


def check_device_index(device: Any, count: int, backend: str) -> int:
    """``device`` as an index among the backend's ``count`` devices; a clear error otherwise."""
    if isinstance(device, bool) or not isinstance(device, (int, np.integer)) or not 0 <= device < count:
        have = "device 0" if count == 1 else f"devices 0 to {count - 1}"
        raise InvalidInput(f"device {device!r} does not exist: the {backend} backend has {have}")
    return int(device)


def check_host_output(out: Any, rows: int, cols: int) -> np.ndarray:
    """``out`` as a writable C-contiguous (rows × cols) float16/float32 host array, else a clear error."""
    if not isinstance(out, np.ndarray) or out.shape != (rows, cols) or out.dtype not in (np.float16, np.float32):
        raise InvalidInput(f"output buffer must be a float16 or float32 array of shape [{rows}, {cols}]; got "
                           f"{type(out).__name__} {list(np.shape(out))} {getattr(out, 'dtype', '')}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidInput("output buffer must be C-contiguous and writable")
    return out


def check_params(spec: MLPSpec, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Validate a full parameter set against the spec; returns fp32 C-contiguous copies.

    Every value must be finite in the spec's precision too: a weight of 3e38 in an fp16 model is
    Inf once the kernels round it, and every output it reaches is Inf or NaN."""
    expected = param_shapes(spec)
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected), key=str)
    if missing or extra:
        def listed(names: list) -> str:  # a file of 200,000 names gets a message of five
            more = f" and {len(names) - 5} more" if len(names) > 5 else ""
            return f"[{', '.join(repr(str(n)[:40]) for n in names[:5])}{more}]"
        raise InvalidInput(f"parameters do not match the model: missing {listed(missing)}, unexpected {listed(extra)}")
    # the largest finite number of each precision (bfloat16: fp32's exponent, 8 bits of mantissa)
    largest = {"fp16": float(np.finfo(np.float16).max), "bf16": float.fromhex("0x1.fep127")}.get(
        spec.precision, float(np.finfo(np.float32).max))
    out = {}
    for name, shape in expected.items():
        value = np.asarray(params[name])
        if value.shape != shape:
            raise InvalidInput(f"parameter {name} must have shape {list(shape)}; got {list(value.shape)}")
        value = np.array(value, dtype=np.float32, order="C")
        if not np.isfinite(value).all():
            raise InvalidInput(f"parameter {name} holds NaN or Inf")
        peak = float(np.abs(value).max(initial=0.0))
        if peak > largest:
            raise InvalidInput(f"parameter {name} holds {peak:.6g}, beyond the largest {spec.precision} number "
                               f"({largest:.6g}): this {spec.precision} model would compute Inf from it")
        out[name] = value
    return out


def param_shapes(spec: MLPSpec) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape: ``W{i}`` (fan_out, fan_in) and ``b{i}`` (fan_out,) per layer, then
    ``grid{k}`` (rows, n_features_per_level) per grid encoding part (``MLPSpec.grid_shapes``)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for i, (fan_in, fan_out) in enumerate(spec.layer_dims):
        shapes[f"W{i}"] = (fan_out, fan_in)
        shapes[f"b{i}"] = (fan_out,)
    shapes.update(spec.grid_shapes)
    return shapes


GRID_INIT_SCALE = 1e-4  # tcnn's GridEncoding::initialize_params: uniform in ±1e-4


def init_params(spec: MLPSpec) -> dict[str, np.ndarray]:
    """Deterministic initial parameters from the seed: identical on every backend.

    Weights uniform in ±sqrt(6 / (fan_in + fan_out)) (tiny-cuda-nn's choice), biases zero,
    drawn layer by layer from NumPy's PCG64 (bit-identical across platforms); then each grid
    table uniform in ±1e-4 (tcnn's), drawn after the layers (tcnn's order: network, then
    encoding) so that a grid leaves the layers' draws as they are without one.
    """
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    params: dict[str, np.ndarray] = {}
    for i, (fan_in, fan_out) in enumerate(spec.layer_dims):
        scale = np.sqrt(6.0 / (fan_in + fan_out))
        params[f"W{i}"] = rng.uniform(-scale, scale, size=(fan_out, fan_in)).astype(np.float32)
        params[f"b{i}"] = np.zeros(fan_out, dtype=np.float32)
    for name, shape in spec.grid_shapes.items():
        params[name] = rng.uniform(-GRID_INIT_SCALE, GRID_INIT_SCALE, size=shape).astype(np.float32)
    return params


def optimizer_slots(spec: MLPSpec) -> tuple[str, ...]:
    """The optimizer's per-parameter arrays: Adam's moments ``m``, ``v``; SGD's ``velocity``;
    then, with an EMA wrapper, ``ema`` (the averaged weights inference uses)."""
    slots = ("m", "v") if spec.optimizer.otype == "Adam" else ("velocity",)
    return slots + ("ema",) if spec.optimizer.ema is not None else slots


def optimizer_state_names(spec: MLPSpec) -> list[str]:
    """Names of the optimizer's per-parameter arrays (``m.W0``, ``v.W0``, ... or ``velocity.W0``)."""
    return [f"{slot}.{name}" for slot in optimizer_slots(spec) for name in param_shapes(spec)]


def check_optimizer_state(spec: MLPSpec, state: dict[str, Any]) -> tuple[list[dict[str, np.ndarray]], int]:
    """(one dict of fp32 arrays per optimizer slot, the step) from a state dict; clear errors."""
    shapes = param_shapes(spec)
    slots = []
    for slot in optimizer_slots(spec):
        values = {}
        for name, shape in shapes.items():
            key = f"{slot}.{name}"
            if key not in state or np.shape(state[key]) != shape:
                raise InvalidInput(f"optimizer state {key} is missing or has the wrong shape")
            values[name] = np.array(state[key], dtype=np.float32, order="C")
        slots.append(values)
    if "step" not in state or np.size(state["step"]) != 1:
        raise InvalidInput("optimizer state lacks 'step'")
    step = int(np.asarray(state["step"]).reshape(-1)[0])
    if not 0 <= step < 2**31:
        raise InvalidInput(f"optimizer step {step} is out of range")
    return slots, step
