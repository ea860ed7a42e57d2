"""``POST /v2/models/{m}/infer``: the inference hot path, and the middleware that reaches it
without FastAPI's routing."""

from __future__ import annotations

import time

import numpy as np
from fastapi import Request, Response

from mmad.errors import InvalidInput, MMADError, ModelNotReady, NonFiniteInput, NotReady
from mmad.server.binary import (
    WIRE_DTYPES, binary_response_buffer, check_response_size, encode_infer_response, requested_outputs,
)
from mmad.engine.runtime import Runtime
from mmad.server.errors import internal_error_response, mmad_error_response, status_for
from mmad.engine.metrics import UNKNOWN_MODEL
from mmad.engine.region_forwards import describe
from mmad.engine.registry import INPUT, OUTPUT
from mmad.engine.shm import COPY_INLINE_BYTES, ShmTensor, copy_bytes
from mmad.engine.store import check_model_name
from mmad.server.tensors import (
    INLINE_TENSOR_VALUES, accepted_encoding, compress, model_tensors, nonfinite_input, parse_tensors, tensor_response,
)

INLINE_COMPRESS_BYTES = 64 * 1024


async def infer_request(request: Request, rt: Runtime, model: str, version: str | None) -> Response:
    registry, stats, served = rt.registry, None, None
    rt.metrics.process_infers.inc()
    check_model_name(model)
    # series only for models that exist: labelled before the lookup, any name a client made up
    # added series for good (45k names: RSS +73 MiB, a 3 s scrape)
    labels = (UNKNOWN_MODEL, registry.backend_label)
    t0 = time.perf_counter_ns()
    try:
        entry = registry.get(model)
        labels = (model, registry.backend_label)
        rt.metrics.requests.labels(*labels, "infer").inc()
        stats = entry.stats  # failures of a known model count in its statistics, not-ready included
        entry = registry.get_ready(model)
        if version is not None:
            registry.check_version(model, version)
        served = version or registry.latest_version(model)  # from here on Triton's families count it
        parsed = await parse_tensors(rt, request)
        names = {INPUT: entry.spec.n_input_dims}
        check_finite = False  # left to the forward
        sources = list(parsed.shm_inputs.values())
        on_device = any(t.on_device for t in sources)
        small = sum(t.size for t in parsed.tensors.values()) <= INLINE_TENSOR_VALUES
        if small:  # read from its region now (a few KiB); a large one once it is known to run here
            for source in sources:
                source.load()
        if on_device:  # a CUDA region's input: checked finite on the device, in device_forward
            x = model_tensors(entry, parsed, names, True, check_finite=False)[INPUT]
        elif small:
            x = model_tensors(entry, parsed, names, keep_fp16=True)[INPUT]
        else:
            # a large tensor's finiteness is checked by its forward: on the device on a GPU backend,
            # where it costs no host time (on the H100 host the host check of 65,536 FP16 rows took a
            # compute thread ~1.4 ms, longer than the forward); a refused input's output is never sent
            x = model_tensors(entry, parsed, names, True, check_finite=False)[INPUT]
            check_finite = not entry.config.allow_nonfinite
        try:
            outputs = requested_outputs(parsed, (OUTPUT,))
            header = {"model_name": model, "model_version": served}
            if parsed.id is not None:
                header["id"] = parsed.id
            out_shape = (x.shape[0], entry.spec.n_output_dims)
            check_response_size(outputs, out_shape, rt.settings.max_response_bytes)
            body, out, targets = None, None, None
            if len(outputs) == 1 and outputs[0].binary:  # the forward writes (and casts) into the response
                body, header_length, out = binary_response_buffer(header, outputs[0], out_shape)
            if parsed.uses_shm:
                targets = shm_outputs(parsed, outputs, out_shape)
                on_device = on_device or any(t.on_device for _, t in targets)
                if len(outputs) == 1 and targets and not on_device:  # the forward writes (and casts) into the
                    out = targets[0][1].array  # output's buffer, written into its region once computed
            t1 = time.perf_counter_ns()
            region_targets = [t for _, t in targets or []]
            remote = rt.region_forwards  # a worker's: the primary runs forwards between regions
            if (remote is not None and version is None
                    and remote.takes(sources, region_targets, outputs)):
                await remote.forward(model, describe(parsed.shm_inputs[INPUT], shape=list(x.shape)),
                                     [describe(t, name=o.name) for o, t in targets], not entry.config.allow_nonfinite)
                out = shape_only(out_shape, region_targets[0].array.dtype)
                queue_ns, compute_ns = 0, time.perf_counter_ns() - t1
                registry.record_batch(entry, x.shape[0], 1, compute_ns)
            else:
                if not small:
                    await copy_regions(rt, sources, ShmTensor.load)
                if on_device:
                    if version is not None:
                        raise InvalidInput("CUDA shared memory runs the live model; leave out the version")
                    if out is None and any(o.shm is None for o in outputs):
                        out = np.empty(out_shape, dtype=np.float32)
                    out = await registry.run(device_forward, entry, x, sources, region_targets, out)
                    queue_ns, compute_ns = 0, time.perf_counter_ns() - t1
                    registry.record_batch(entry, x.shape[0], 1, compute_ns)
                elif version is None:
                    batcher = entry.batcher  # None once an unload that began while the body was read finished
                    if batcher is None:
                        raise ModelNotReady(model)
                    result = await batcher.submit(x, out, check_finite)
                    out, queue_ns, compute_ns = result.output, result.queue_ns, result.compute_ns
                else:
                    out = await registry.run(registry.forward_pinned, entry, version, x,
                                             np.empty(out_shape, dtype=np.float32) if out is None else out,
                                             check_finite)
                    queue_ns, compute_ns = 0, time.perf_counter_ns() - t1
                    registry.record_batch(entry, x.shape[0], 1, compute_ns, version)
                if region_targets and not on_device:
                    for target in region_targets:
                        if target.array is not out:
                            np.copyto(target.array, out, casting="same_kind")
                await copy_regions(rt, region_targets, ShmTensor.store)
            t2 = time.perf_counter_ns()
            if body is None:
                outs = [(o, out) for o in outputs]
                # outputs written into shared memory leave only their JSON entries to encode
                if out.size <= INLINE_TENSOR_VALUES or all(o.shm is not None for o in outputs):
                    body, header_length = encode_infer_response(header, outs)
                else:
                    body, header_length = await registry.run(encode_infer_response, header, outs)
        except NonFiniteInput as exc:
            raise nonfinite_input(INPUT) from exc
    except MMADError as exc:
        if stats is not None:
            with stats.lock:
                stats.fail.add(time.perf_counter_ns() - t0)
        if served is not None:
            rt.metrics.inference.request_failed(entry, served)
        if labels[0] is UNKNOWN_MODEL:
            rt.metrics.requests.labels(*labels, "infer").inc()
        rt.metrics.failures.labels(*labels, "infer", str(status_for(exc))).inc()
        raise
    t3 = time.perf_counter_ns()
    with stats.lock:
        stats.inference_count += x.shape[0]
        stats.last_inference_ms = int(time.time() * 1000)
        stats.success.add(t3 - t0)
        stats.queue.add(queue_ns)
        stats.compute_input.add(t1 - t0)
        stats.compute_infer.add(compute_ns)
        stats.compute_output.add(t3 - t2)
    rt.metrics.queue_seconds.labels(*labels).observe(queue_ns / 1e9)
    rt.metrics.inference.request_succeeded(entry, served, t3 - t0, queue_ns, t1 - t0, compute_ns, t3 - t2)
    encoding = accepted_encoding(request.headers.get("accept-encoding"))
    if encoding is not None:  # as Triton: the whole body, Inference-Header-Content-Length uncompressed
        if len(body) <= INLINE_COMPRESS_BYTES:
            body = compress(body, encoding)
        else:
            body = await registry.run(compress, body, encoding)
    return tensor_response(body, header_length, encoding)


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


def shm_outputs(parsed, outputs, shape: tuple[int, ...]) -> list[tuple[object, ShmTensor]]:
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


def device_forward(entry, x, sources: list[ShmTensor], targets: list[ShmTensor], out: np.ndarray | None):
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


class InferFastPath:
    """ASGI middleware: ``POST /v2/models/{m}/infer`` straight to its handler.

    Infer is the hot path, and FastAPI's routing (a match against every route), dependency
    resolution and middleware stack cost more CPU than the work of a small request. This
    calls the same handler (:func:`infer_request`) with the same error mapping (mmad's tree, and
    a 500 for anything else); every other path, and infer pinned to a version, goes through
    FastAPI. It sits in front of FastAPI's own middleware (:class:`~mmad.server.app.MMADApp`),
    behind the body cap only. The route below stays declared for the OpenAPI schema
    (docs/service-performance.md has the measurements).
    """

    PREFIX, SUFFIX = "/v2/models/", "/infer"

    def __init__(self, app, runtime: Runtime):
        self.app = app
        self.rt = runtime

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            if path.startswith(self.PREFIX) and path.endswith(self.SUFFIX):
                model = path[len(self.PREFIX):-len(self.SUFFIX)]
                if model and "/" not in model:
                    request = Request(scope, receive)
                    try:
                        if not self.rt.ready:
                            raise NotReady("the daemon is starting or stopping")
                        response = await infer_request(request, self.rt, model, None)
                    except MMADError as exc:
                        response = mmad_error_response(request, exc)
                    except Exception as exc:  # noqa: BLE001 - a bug: a 500 that says so, as FastAPI's handler gives
                        response = internal_error_response(request, exc)
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)
