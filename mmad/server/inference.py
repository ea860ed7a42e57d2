"""``POST /v2/models/{m}/infer``: the inference hot path. The HTTP request is parsed into the
engine's :class:`~mmad.engine.api.InferRequest`, run by the engine (:class:`~mmad.engine.inprocess.InProcessEngine`,
which checks its tensors against the model, once), and its response encoded; the middleware
here reaches it without FastAPI's routing."""

from __future__ import annotations

import numpy as np
from fastapi import Request, Response

from mmad.engine.api import WIRE_DTYPES, InferenceClient, InferInput, InferRequest, InferResponse, RequestedOutput, ShmRef
from mmad.engine.inference import INLINE_TENSOR_VALUES, OutputChoice, ParsedRequest, shape_only
from mmad.engine.metrics import UNKNOWN_MODEL
from mmad.engine.registry import OUTPUT
from mmad.engine.runtime import Runtime
from mmad.errors import MMADError, NotReady
from mmad.server.binary import binary_response_buffer, encode_infer_response, requested_outputs
from mmad.server.errors import internal_error_response, mmad_error_response, status_for
from mmad.server.tensors import accepted_encoding, compress, parse_tensors, tensor_response

INLINE_COMPRESS_BYTES = 64 * 1024


def _shm_ref(params: dict) -> ShmRef:
    """A tensor's ``shared_memory_*`` parameters as the engine's reference (the engine checks them)."""
    return ShmRef(params["shared_memory_region"], params.get("shared_memory_offset", 0),
                  params.get("shared_memory_byte_size"))


def engine_request(parsed: ParsedRequest, outputs: list[OutputChoice], model: str, version: str | None
                   ) -> InferRequest:
    inputs = [InferInput(name, "FP16" if array.dtype == np.float16 else "FP32", array.shape, data=array)
              for name, array in parsed.tensors.items()]
    inputs += [InferInput(name, datatype, shape, shm=_shm_ref(params))
               for name, (datatype, shape, params) in parsed.shm_refs.items()]
    asked = [RequestedOutput(o.name, o.datatype, o.binary, None if o.shm is None else _shm_ref(o.shm)) for o in outputs]
    return InferRequest(model, inputs, asked, version, parsed.id, parsed.parameters)


class ResponseBody:
    """The response's body when the forward wrote its one binary output into it: the engine's
    output allocator (:data:`~mmad.engine.api.OutputAllocator`) for this request."""

    def __init__(self, model: str, request_id: str | None):
        self.model, self.id = model, request_id
        self.body: memoryview | None = None
        self.header_length = 0

    def header(self, served: str) -> dict:
        header = {"model_name": self.model, "model_version": served}
        if self.id is not None:
            header["id"] = self.id
        return header

    def __call__(self, served: str, output: RequestedOutput, shape: tuple[int, ...]) -> np.ndarray | None:
        if not output.binary:
            return None  # JSON data: the engine's array, encoded once computed
        self.body, self.header_length, tensor = binary_response_buffer(
            self.header(served), OutputChoice(output.name, True, output.datatype), shape)
        return tensor


async def encode(rt: Runtime, response: InferResponse, outputs: list[OutputChoice], allocated: ResponseBody
                 ) -> tuple[bytes | memoryview, int | None]:
    if allocated.body is not None:
        return allocated.body, allocated.header_length
    outs = [(choice, out.data if out.data is not None else shape_only(out.shape, WIRE_DTYPES[out.datatype]))
            for choice, out in zip(outputs, response.outputs)]
    header = allocated.header(response.version)
    # outputs written into shared memory leave only their JSON entries to encode
    if all(out.data is None or out.data.size <= INLINE_TENSOR_VALUES for out in response.outputs):
        return encode_infer_response(header, outs)
    return await rt.registry.run(encode_infer_response, header, outs)


async def infer_request(request: Request, engine: InferenceClient, rt: Runtime, model: str, version: str | None
                        ) -> Response:
    """The HTTP request parsed (JSON or binary body, shared-memory references), run by the
    engine, and its response encoded (a binary output written by the forward into the body)."""
    backend = rt.registry.backend_label
    try:
        parsed = await parse_tensors(rt, request, resolve_shm=False)
        outputs = requested_outputs(parsed, (OUTPUT,))
        infer = engine_request(parsed, outputs, model, version)
        infer.allocate = allocated = ResponseBody(model, parsed.id)
        response = await engine.infer(infer)
        body, header_length = await encode(rt, response, outputs, allocated)
    except MMADError as exc:
        # series only for models that exist: a name a client made up would add series for good
        # (45k names: RSS +73 MiB, a 3 s scrape)
        labels = (model if model in rt.registry.models else UNKNOWN_MODEL, backend)
        rt.metrics.requests.labels(*labels, "infer").inc()
        rt.metrics.failures.labels(*labels, "infer", str(status_for(exc))).inc()
        raise
    rt.metrics.requests.labels(model, backend, "infer").inc()
    encoding = accepted_encoding(request.headers.get("accept-encoding"))
    if encoding is not None:  # as Triton: the whole body, Inference-Header-Content-Length uncompressed
        if len(body) <= INLINE_COMPRESS_BYTES:
            body = compress(body, encoding)
        else:
            body = await rt.registry.run(compress, body, encoding)
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

    def __init__(self, app, runtime: Runtime, engine: InferenceClient):
        self.app = app
        self.rt = runtime
        self.engine = engine

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
                        response = await infer_request(request, self.engine, self.rt, model, None)
                    except MMADError as exc:
                        response = mmad_error_response(request, exc)
                    except Exception as exc:  # noqa: BLE001 - a bug: a 500 that says so, as FastAPI's handler gives
                        response = internal_error_response(request, exc)
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)
