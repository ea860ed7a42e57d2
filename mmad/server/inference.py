"""``POST /v2/models/{m}/infer``: the inference hot path (HTTP parsed and encoded here, run by the
engine), and the middleware that reaches it without FastAPI's routing."""

from __future__ import annotations

import time

from fastapi import Request, Response

from mmad.engine.inference import (
    INLINE_TENSOR_VALUES, check_response_size, count_failure, count_success, model_tensors,
    nonfinite_input, run_forward, shm_outputs,
)
from mmad.engine.metrics import UNKNOWN_MODEL
from mmad.engine.registry import INPUT, OUTPUT
from mmad.engine.runtime import Runtime
from mmad.engine.store import check_model_name
from mmad.errors import MMADError, NonFiniteInput, NotReady
from mmad.server.binary import binary_response_buffer, encode_infer_response, requested_outputs
from mmad.server.errors import internal_error_response, mmad_error_response, status_for
from mmad.server.tensors import accepted_encoding, compress, parse_tensors, tensor_response

INLINE_COMPRESS_BYTES = 64 * 1024


async def infer_request(request: Request, rt: Runtime, model: str, version: str | None) -> Response:
    """The HTTP request parsed (JSON or binary body, shared-memory references), run by the
    engine (:func:`mmad.engine.inference.run_forward`), and its response encoded."""
    registry, known, served = rt.registry, None, None
    rt.metrics.process_infers.inc()
    check_model_name(model)
    # series only for models that exist: labelled before the lookup, any name a client made up
    # added series for good (45k names: RSS +73 MiB, a 3 s scrape)
    labels = (UNKNOWN_MODEL, registry.backend_label)
    t0 = time.perf_counter_ns()
    try:
        known = registry.get(model)
        labels = (model, registry.backend_label)
        rt.metrics.requests.labels(*labels, "infer").inc()
        entry = registry.get_ready(model)  # failures of a known model count in its statistics, not-ready included
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
            # where it costs no host time (on an H100 the host check of 65,536 FP16 rows takes a
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
            body, out, targets = None, None, []
            if len(outputs) == 1 and outputs[0].binary:  # the forward writes (and casts) into the response
                body, header_length, out = binary_response_buffer(header, outputs[0], out_shape)
            if parsed.uses_shm:
                targets = shm_outputs(parsed, outputs, out_shape)
                on_device = on_device or any(t.on_device for _, t in targets)
                if len(outputs) == 1 and targets and not on_device:  # the forward writes (and casts) into the
                    out = targets[0][1].array  # output's buffer, written into its region once computed
            t1 = time.perf_counter_ns()
            out, queue_ns, compute_ns = await run_forward(rt, entry, version, x, parsed, outputs, targets, out,
                                                          check_finite, load_inputs=not small)
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
        count_failure(rt, known, served, t0)
        if labels[0] is UNKNOWN_MODEL:
            rt.metrics.requests.labels(*labels, "infer").inc()
        rt.metrics.failures.labels(*labels, "infer", str(status_for(exc))).inc()
        raise
    t3 = time.perf_counter_ns()
    count_success(rt, entry, served, x.shape[0], t0, t1, t2, t3, queue_ns, compute_ns)
    encoding = accepted_encoding(request.headers.get("accept-encoding"))
    if encoding is not None:  # as Triton: the whole body, Inference-Header-Content-Length uncompressed
        if len(body) <= INLINE_COMPRESS_BYTES:
            body = compress(body, encoding)
        else:
            body = await registry.run(compress, body, encoding)
    return tensor_response(body, header_length, encoding)


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
