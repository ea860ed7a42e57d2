"""One inference request through the engine, whatever front end parsed it: its tensors checked
against the model (once), the forward (the live model's batcher, a pinned version, the replica on
the GPU of its CUDA shared-memory regions, or, in a serving worker, the primary's region
forwards), shared-memory regions read and written, and the model's statistics and Triton's
metric families counted. A front end parses its transport's request into a
:class:`ParsedRequest` and encodes what comes back."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmad.backends.numerics import all_finite
from mmad.engine.api import WIRE_DTYPES
from mmad.engine.region_forwards import describe
from mmad.engine.registry import INPUT, ModelEntry
from mmad.engine.runtime import Runtime
from mmad.engine.shm import COPY_INLINE_BYTES, SharedMemoryRegistry, ShmTensor, copy_bytes
from mmad.errors import InvalidInput, ModelNotReady

# Work on a small tensor runs inline on the event loop: a hop to the compute threads costs more
# than the work, and under load the hops queue behind each other and behind the batches (GIL
# hand-offs).
INLINE_TENSOR_VALUES = 16 * 1024


@dataclass
class ParsedRequest:
    """A parsed inference request: its JSON header (or what a front end made of its message) and
    its tensors by name (float views of the body, or of shared memory)."""

    header: dict[str, Any]
    tensors: dict[str, np.ndarray]
    binary_inputs: bool = False
    parameters: dict[str, Any] = field(default_factory=dict)
    shm: SharedMemoryRegistry | None = None  # for outputs that name a region
    uses_shm: bool = False  # some input or output names a shared-memory region
    shm_inputs: dict[str, ShmTensor] = field(default_factory=dict)  # input name -> its view of its region
    # input name -> (datatype, shape, shared_memory_* parameters): a region not yet resolved
    shm_refs: dict[str, tuple[str, tuple[int, ...], dict[str, Any]]] = field(default_factory=dict)

    @property
    def id(self) -> str | None:
        return self.header.get("id")  # a string: parse_infer_request refuses anything else


@dataclass
class OutputChoice:
    name: str
    binary: bool
    datatype: str
    shm: dict[str, Any] | None = None  # the output's shared_memory_* parameters, when it names a region


# the most bytes one FP32 value takes in a JSON response ("-1.2345678e-38" and a comma): the
# bound is checked before the forward, when only the count of values is known
JSON_VALUE_BYTES = 16


def check_response_size(outputs: list[OutputChoice], shape: tuple[int, ...], limit: int) -> None:
    """Refuse, before any work, a response larger than ``limit`` bytes (JSON outputs at their
    largest): a 61 MiB FP16 request could otherwise ask for a 520 MiB JSON response."""
    values = math.prod(shape)
    size = sum(values * (WIRE_DTYPES[o.datatype].itemsize if o.binary else JSON_VALUE_BYTES) for o in outputs
               if o.shm is None)
    if size <= limit:
        return
    mib = 1024 * 1024
    if all(o.binary for o in outputs):
        hint = "send fewer rows per request, or ask for FP16 outputs (parameters.output_datatype)"
        what = f"{size / mib:.1f} MiB of binary data"
    else:
        binary = values * 4
        hint = (f"ask for binary output (parameters.binary_data_output: true, {binary / mib:.1f} MiB as FP32) "
                "or send fewer rows per request")
        what = f"up to {size / mib:.1f} MiB ({values} values as JSON)"
    raise ResponseTooLarge(f"the response would be {what} for output shape {list(shape)}; the limit is "
                           f"{limit / mib:.1f} MiB (max_response_bytes); {hint}")


class ResponseTooLarge(InvalidInput):
    """A request valid in itself whose response would pass ``max_response_bytes`` (400)."""


def model_tensors(entry: ModelEntry, request: ParsedRequest, names: dict[str, int],
                  keep_fp16: bool = False, check_finite: bool = True) -> dict[str, np.ndarray]:
    """The request's tensors as float32 [rows, cols], all with the same rows, finite unless allowed.

    ``keep_fp16``: FP16 tensors stay float16 views of the body (the forward casts them chunk by chunk).
    ``check_finite=False``: the caller checks finiteness (:func:`check_finite_input`).
    """
    unknown = sorted(set(request.tensors) - set(names))
    if unknown:
        raise InvalidInput(f"unknown input {unknown[0]!r}; model {entry.name!r} takes {', '.join(names)}")
    out, rows = {}, None
    for name, cols in names.items():
        if name not in request.tensors:
            raise InvalidInput(f"input {name!r} is missing")
        array = request.tensors[name]
        if array.ndim != 2 or array.shape[1] != cols or array.shape[0] < 1:
            raise InvalidInput(f"input {name!r} must have shape [rows >= 1, {cols}]; got {list(array.shape)}")
        if rows is not None and array.shape[0] != rows:
            raise InvalidInput(f"input {name!r} has {array.shape[0]} rows; {INPUT} has {rows}")
        rows = array.shape[0]
        if not (keep_fp16 and array.dtype == np.float16):
            array = array.astype(np.float32, copy=False)
        if check_finite:
            check_finite_input(entry, name, array)
        out[name] = array
    return out


def check_finite_input(entry: ModelEntry, name: str, array: np.ndarray) -> None:
    if not entry.config.allow_nonfinite and not all_finite(array):
        raise nonfinite_input(name)


def nonfinite_input(name: str) -> InvalidInput:
    return InvalidInput(f"input {name!r} holds NaN or Inf (set config.allow_nonfinite to allow them)")


async def copy_regions(rt: Runtime, tensors: list[ShmTensor], copy) -> None:
    """``copy`` (``ShmTensor.load`` or ``.store``) of each system-region tensor: on the event loop
    when small, else on a compute thread."""
    size = copy_bytes(tensors)
    if not size:
        return
    if size <= COPY_INLINE_BYTES:
        for t in tensors:
            copy(t)
        return
    await rt.registry.run(lambda: [copy(t) for t in tensors])


def shape_only(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A read-only array of ``shape`` and ``dtype`` over one zero element (what the response of
    outputs written elsewhere needs): cheaper than ``np.broadcast_to``."""
    return np.ndarray(shape, dtype, buffer=bytes(dtype.itemsize), strides=(0,) * len(shape))


def shm_outputs(parsed: ParsedRequest, outputs: list[OutputChoice], shape: tuple[int, ...]
                ) -> list[tuple[OutputChoice, ShmTensor]]:
    """(output, its view of its region) for each output that names a shared-memory region; the
    region must hold at least the output's bytes in its datatype, and none of them may be bytes
    an input is read from (the forward writes outputs while it still reads inputs)."""
    targets = [(o, parsed.shm.tensor(f"output {o.name!r}", o.shm, WIRE_DTYPES[o.datatype], shape, o.datatype,
                                     at_least=True))
               for o in outputs if o.shm is not None]
    for o, target in targets:
        for name, source in parsed.shm_inputs.items():
            if target.overlaps(source):
                raise InvalidInput(f"output {o.name!r} would be written over input {name!r}: both lie in bytes "
                                   f"{max(target.offset, source.offset)} to "
                                   f"{min(target.offset + target.nbytes, source.offset + source.nbytes) - 1} of "
                                   f"shared memory region {target.region!r}; give the output bytes of its own")
    return targets


def device_forward(entry: ModelEntry, x: Any, sources: list[ShmTensor], targets: list[ShmTensor], out: np.ndarray | None):
    """The forward of the model's replica on the GPU of the request's CUDA shared-memory
    regions: the input read on the device where it lies (uploaded first if it came from the body or a system
    region), checked finite there, the output written on the device into each CUDA region, and
    copied to the host only into ``out`` (the response buffer) or a system region's buffer (the
    caller writes it into the region). Returns ``out``, or the device result (its shape is all the
    response needs) when nothing is on the host."""
    device_targets = [t for t in targets if t.on_device]
    on_device = [t for t in [*sources, *device_targets] if t.on_device]
    device = on_device[0].device
    for t in on_device:
        if t.device != device:
            raise InvalidInput(f"shared memory regions {on_device[0].region!r} and {t.region!r} are on different "
                               f"GPUs ({device} and {t.device}); one request's regions must share a GPU")
    replica = next((r for r in entry.replicas if r.device == device), None)
    if replica is None:  # the replica on the regions' GPU reads and writes them in place
        raise InvalidInput(f"shared memory region {on_device[0].region!r} is on GPU {device} but model "
                           f"{entry.name!r} runs on GPU{'s' if len(entry.replicas) > 1 else ''} "
                           f"{', '.join(str(r.device) for r in entry.replicas)}")
    with replica.lock:
        model = replica.model
        if model is None:
            raise ModelNotReady(entry.name)
        dx = x if model.is_device_array(x) else model.upload(x)
        from_region = any(s.on_device for s in sources)  # (inputs from the host were checked on arrival)
        if from_region and not entry.config.allow_nonfinite and not bool(np.isfinite(dx).all()):
            raise InvalidInput(f"input {INPUT!r} holds NaN or Inf (set config.allow_nonfinite to allow them)")
        dtype = device_targets[0].array.dtype if device_targets else (out.dtype if out is not None else np.float32)
        result = model.forward(dx, out_dtype=dtype)
        for t in device_targets:
            t.array[...] = result  # a copy on the device (and a cast where the datatypes differ)
        host = [t.array for t in targets if not t.on_device] + ([out] if out is not None else [])
        if host:
            downloaded = model.download(result)
            for h in host:
                np.copyto(h, downloaded, casting="same_kind")
        model.synchronize()  # the client reads its region once the response is sent
    return out if out is not None else result


async def run_forward(rt: Runtime, entry: ModelEntry, version: str | None, x: np.ndarray, parsed: ParsedRequest,
                      outputs: list[OutputChoice], targets: list[tuple[OutputChoice, ShmTensor]],
                      out: np.ndarray | None, check_finite: bool, load_inputs: bool = False) -> tuple[Any, int, int]:
    """The forward of ``x`` (INPUT's checked rows) into
    ``out`` where one is given (the response buffer, or the one output's region), and into each
    output region of ``targets``: (the output rows, queue ns, compute ns).

    A serving worker's request whose tensors all lie in regions of one kind goes to the primary
    (:mod:`mmad.engine.region_forwards`); one with a CUDA region runs on the replica on the
    regions' GPU; else the live model's batcher, or the compiled copy of a pinned ``version``.
    ``load_inputs``: the system regions' inputs are read here first where the forward runs in
    this process (else the caller has read them)."""
    registry = rt.registry
    sources = list(parsed.shm_inputs.values())
    region_targets = [t for _, t in targets]
    on_device = any(t.on_device for t in [*sources, *region_targets])
    t1 = time.perf_counter_ns()
    remote = rt.region_forwards  # a worker's: the primary runs forwards between regions
    if remote is not None and version is None and remote.takes(sources, region_targets, outputs):
        await remote.forward(entry.name, describe(parsed.shm_inputs[INPUT], shape=list(x.shape)),
                             [describe(t, name=o.name) for o, t in targets], not entry.config.allow_nonfinite)
        compute_ns = time.perf_counter_ns() - t1
        registry.record_batch(entry, x.shape[0], 1, compute_ns)
        return shape_only((x.shape[0], entry.spec.n_output_dims), region_targets[0].array.dtype), 0, compute_ns
    if load_inputs:
        await copy_regions(rt, sources, ShmTensor.load)
    if on_device:
        if version is not None:
            raise InvalidInput("CUDA shared memory runs the live model; leave out the version")
        if out is None and any(o.shm is None for o in outputs):
            out = np.empty((x.shape[0], entry.spec.n_output_dims), dtype=np.float32)
        out = await registry.run(device_forward, entry, x, sources, region_targets, out)
        queue_ns, compute_ns = 0, time.perf_counter_ns() - t1
        registry.record_batch(entry, x.shape[0], 1, compute_ns)
    elif version is None:
        batcher = entry.batcher  # None once an unload that began while the request was read finished
        if batcher is None:
            raise ModelNotReady(entry.name)
        result = await batcher.submit(x, out, check_finite)
        out, queue_ns, compute_ns = result.output, result.queue_ns, result.compute_ns
    else:
        if out is None:
            out = np.empty((x.shape[0], entry.spec.n_output_dims), dtype=np.float32)
        out = await registry.run(registry.forward_pinned, entry, version, x, out, check_finite)
        queue_ns, compute_ns = 0, time.perf_counter_ns() - t1
        registry.record_batch(entry, x.shape[0], 1, compute_ns, version)
    if not on_device:
        for target in region_targets:
            if target.array is not out:
                np.copyto(target.array, out, casting="same_kind")
    await copy_regions(rt, region_targets, ShmTensor.store)  # each system region's output written
    return out, queue_ns, compute_ns


def count_failure(rt: Runtime, entry: ModelEntry | None, served: str | None, t0: int) -> None:
    """A failed request of a known model (``entry``; not-ready included) in its statistics, and
    in Triton's families once its version was known (``served``)."""
    if entry is None:
        return
    with entry.stats.lock:
        entry.stats.fail.add(time.perf_counter_ns() - t0)
    if served is not None:
        rt.metrics.inference.request_failed(entry, served)


def count_success(rt: Runtime, entry: ModelEntry, served: str, rows: int, t0: int, t1: int, t2: int, t3: int,
                  queue_ns: int, compute_ns: int) -> None:
    """A request answered: ``t0`` received, ``t1`` its input ready, ``t2`` its forward done, ``t3``
    its response ready (perf_counter ns)."""
    stats = entry.stats
    with stats.lock:
        stats.inference_count += rows
        stats.last_inference_ms = int(time.time() * 1000)
        stats.success.add(t3 - t0)
        stats.queue.add(queue_ns)
        stats.compute_input.add(t1 - t0)
        stats.compute_infer.add(compute_ns)
        stats.compute_output.add(t3 - t2)
    rt.metrics.queue_histogram(entry.name, rt.registry.backend_label).observe(queue_ns / 1e9)
    rt.metrics.inference.request_succeeded(entry, served, t3 - t0, queue_ns, t1 - t0, compute_ns, t3 - t2)
