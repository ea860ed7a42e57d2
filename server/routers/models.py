"""Models: OIP v2 metadata, ready and infer, plus mmad's create/replace, delete, versions, weights."""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Request, Response

from mmad.errors import InvalidInput, MMADError, PayloadTooLarge, SpecError
from mmad.server.binary import (
    InferRequest, binary_response_buffer, encode_infer_response, parse_header_length, parse_infer_request,
    requested_outputs,
)
from mmad.server.common import (
    BINARY_REQUEST_DOC, ERROR_RESPONSES, NotReady, Runtime, TENSOR_REQUEST_DOC, TENSOR_RESPONSES,
    json_body, json_response, mmad_error_response, read_tensor_body, require_key, runtime,
    status_for,
)
from mmad.server.registry import INPUT, OUTPUT, ModelConfig, ModelEntry, ModelNotReady
from mmad.server.store import check_model_name, tensors_from_bytes, tensors_to_bytes
from mmad.spec import MLPSpec

router = APIRouter(tags=["models"], responses=ERROR_RESPONSES)

CREATE_BODY_SCHEMA = {
    "type": "object", "required": ["spec"],
    "properties": {
        "spec": {"type": "object", "description": "tiny-cuda-nn model JSON (DESIGN.md 'Model specification')"},
        "config": ModelConfig.model_json_schema(),
    },
}


def metadata(rt: Runtime, entry: ModelEntry) -> dict[str, Any]:
    versions = rt.registry.versions(entry.name)
    limits = entry.config.limits(rt.settings)
    return {
        "name": entry.name, "versions": [v["version"] for v in versions], "platform": "mmad",
        "inputs": [{"name": INPUT, "datatype": "FP32", "shape": [-1, entry.spec.n_input_dims]}],
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [-1, entry.spec.n_output_dims]}],
        "state": "READY" if entry.ready else "UNAVAILABLE", "reason": entry.reason,
        "backend": rt.registry.backend_label, "latest_version": versions[-1]["version"],
        "step": entry.live.step_count if entry.live is not None else versions[-1]["step"],
        "queued_requests": entry.batcher.queued if entry.batcher is not None else 0,
        "spec": entry.spec.to_json(),
        "config": {"max_batch_rows": limits.max_batch_rows, "max_queue_delay_us": limits.max_queue_delay_us,
                   "max_queue_requests": limits.max_queue_requests,
                   "allow_nonfinite": entry.config.allow_nonfinite},
    }


def all_finite(array: np.ndarray) -> bool:
    if array.dtype == np.float16:  # NumPy's float16 isfinite is ~10x slower than this exponent test
        return (array.view(np.uint16) & np.uint16(0x7C00)).max(initial=0) != 0x7C00
    return bool(np.isfinite(array).all())


def model_tensors(entry: ModelEntry, request: InferRequest, names: dict[str, int],
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
        raise InvalidInput(f"input {name!r} holds NaN or Inf (set config.allow_nonfinite to allow them)")


INFLATE_STEP = 1 << 20  # inflate in steps, so a bomb costs at most the cap plus one step


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """A gzip/deflate body (tritonclient's request_compression_algorithm), inflated to at most ``limit``."""
    wbits = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}.get(encoding)
    if wbits is None:
        raise InvalidInput(f"Content-Encoding {encoding!r} is not supported; use gzip, deflate or none")
    inflater = zlib.decompressobj(wbits)
    chunks, total, pending = [], 0, body
    try:
        while not inflater.eof:
            chunk = inflater.decompress(pending, INFLATE_STEP)
            total += len(chunk)
            if total > limit:
                raise PayloadTooLarge(f"the decompressed body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
            pending = inflater.unconsumed_tail
            if not pending and len(chunk) < INFLATE_STEP:  # input used up and no output held back
                break
    except zlib.error as exc:
        raise InvalidInput(f"the {encoding} body cannot be decompressed: {exc}") from exc
    if not inflater.eof:
        raise InvalidInput(f"the {encoding} body is truncated")
    return b"".join(chunks)


# Work on a small body or tensor runs inline on the event loop: a hop to the compute threads
# costs more than the work, and under load the hops queue behind each other and behind the
# batches (GIL hand-offs). Larger JSON parsing and encoding go to the threads so that they never
# stall the loop. Binary tensors are views of the body (np.frombuffer): cheap at any size.
INLINE_JSON_BYTES = 64 * 1024
INLINE_TENSOR_VALUES = 16 * 1024


async def parse_tensors(rt: Runtime, request: Request) -> InferRequest:
    body = await read_tensor_body(request)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        body = await rt.registry.run(decompress, body, encoding, rt.settings.max_body_bytes)
    header_length = parse_header_length(request.headers.get("inference-header-content-length"), len(body))
    if (len(body) if header_length is None else header_length) <= INLINE_JSON_BYTES:
        return parse_infer_request(body, header_length)
    return await rt.registry.run(parse_infer_request, body, header_length)


def tensor_response(body: bytes, header_length: int | None) -> Response:
    if header_length is None:
        return Response(body, media_type="application/json")
    return Response(body, media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(header_length)})


# -- OIP v2 ---------------------------------------------------------------------------------
@router.get("/v2/models/{model}")
async def model_metadata(model: str, rt: Runtime = Depends(runtime)):
    return json_response(metadata(rt, rt.registry.get(model)))


@router.get("/v2/models/{model}/versions/{version}")
async def model_version_metadata(model: str, version: str, rt: Runtime = Depends(runtime)):
    entry = rt.registry.get(model)
    rt.registry.check_version(model, version)
    return json_response(metadata(rt, entry))


@router.get("/v2/models/{model}/ready")
async def model_ready(model: str, rt: Runtime = Depends(runtime)):
    rt.registry.get_ready(model)
    return json_response({"name": model, "ready": True})


@router.get("/v2/models/{model}/versions/{version}/ready")
async def model_version_ready(model: str, version: str, rt: Runtime = Depends(runtime)):
    rt.registry.get_ready(model)
    rt.registry.check_version(model, version)
    return json_response({"name": model, "version": version, "ready": True})


@router.get("/v2/models/{model}/config")
async def model_config(model: str, rt: Runtime = Depends(runtime)):
    meta = metadata(rt, rt.registry.get(model))
    return json_response({
        "name": model, "platform": "mmad", "backend": meta["backend"], "max_batch_size": 0,
        "input": [{"name": INPUT, "data_type": "TYPE_FP32", "dims": meta["inputs"][0]["shape"]}],
        "output": [{"name": OUTPUT, "data_type": "TYPE_FP32", "dims": meta["outputs"][0]["shape"]}],
        "dynamic_batching": {"max_queue_delay_microseconds": meta["config"]["max_queue_delay_us"]},
        "parameters": meta["config"],
    })


async def _infer(request: Request, rt: Runtime, model: str, version: str | None) -> Response:
    registry, stats = rt.registry, None
    labels = (check_model_name(model), registry.backend_label)
    rt.metrics.requests.labels(*labels, "infer").inc()
    t0 = time.perf_counter_ns()
    try:
        entry = registry.get(model)
        stats = entry.stats  # failures of a known model count in its statistics, not-ready included
        entry = registry.get_ready(model)
        if version is not None:
            registry.check_version(model, version)
        parsed = await parse_tensors(rt, request)
        names = {INPUT: entry.spec.n_input_dims}
        checking = None
        if sum(t.size for t in parsed.tensors.values()) <= INLINE_TENSOR_VALUES:
            x = model_tensors(entry, parsed, names, keep_fp16=True)[INPUT]
        else:
            # a large tensor's finiteness is checked on a compute thread while its forward runs: in
            # series it held the forward back ~1.5 ms per 65,536 FP16 rows; a refused input's
            # output is never sent
            x = model_tensors(entry, parsed, names, True, check_finite=False)[INPUT]
            checking = asyncio.ensure_future(registry.run(check_finite_input, entry, INPUT, x))
        try:
            outputs = requested_outputs(parsed, (OUTPUT,))
            header = {"model_name": model, "model_version": version or registry.latest_version(model)}
            if parsed.id is not None:
                header["id"] = parsed.id
            out_shape = (x.shape[0], entry.spec.n_output_dims)
            body, out = None, None
            if len(outputs) == 1 and outputs[0].binary:  # the forward writes (and casts) into the response
                body, header_length, out = binary_response_buffer(header, outputs[0], out_shape)
            t1 = time.perf_counter_ns()
            if version is None:
                batcher = entry.batcher  # None once an unload that began while the body was read finished
                if batcher is None:
                    raise ModelNotReady(model)
                result = await batcher.submit(x, out)
                out, queue_ns, compute_ns = result.output, result.queue_ns, result.compute_ns
            else:
                out = await registry.run(registry.forward_pinned, entry, version, x,
                                         np.empty(out_shape, dtype=np.float32) if out is None else out)
                queue_ns, compute_ns = 0, time.perf_counter_ns() - t1
                registry.record_batch(entry, x.shape[0], 1, compute_ns)
            t2 = time.perf_counter_ns()
            if body is None:
                outs = [(o, out) for o in outputs]
                if out.size <= INLINE_TENSOR_VALUES:
                    body, header_length = encode_infer_response(header, outs)
                else:
                    body, header_length = await registry.run(encode_infer_response, header, outs)
        finally:
            if checking is not None:
                await checking  # its InvalidInput, if any, is the answer
    except MMADError as exc:
        if stats is not None:
            with stats.lock:
                stats.fail.add(time.perf_counter_ns() - t0)
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
    return tensor_response(body, header_length)


class InferFastPath:
    """ASGI middleware: ``POST /v2/models/{m}/infer`` straight to its handler.

    Infer is the hot path, and FastAPI's routing (a match against every route), dependency
    resolution and exception middleware cost more CPU than the work of a small request. This
    calls the same handler (:func:`_infer`) with the same error mapping; every other path, and
    infer pinned to a version, goes through FastAPI. The route below stays declared for the
    OpenAPI schema (docs/service-performance.md has the measurements).
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
                        response = await _infer(request, self.rt, model, None)
                    except MMADError as exc:
                        response = mmad_error_response(request, exc)
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


@router.post("/v2/models/{model}/infer", openapi_extra=TENSOR_REQUEST_DOC, responses=TENSOR_RESPONSES)
async def infer(model: str, request: Request, rt: Runtime = Depends(runtime)):
    return await _infer(request, rt, model, None)


@router.post("/v2/models/{model}/versions/{version}/infer", openapi_extra=TENSOR_REQUEST_DOC,
             responses=TENSOR_RESPONSES)
async def infer_version(model: str, version: str, request: Request, rt: Runtime = Depends(runtime)):
    return await _infer(request, rt, model, version)


# -- mmad: create / replace / delete ----------------------------------------------------------
@router.put("/v2/models/{model}", dependencies=[Depends(require_key)], status_code=201,
            openapi_extra={"requestBody": {"required": True,
                                           "content": {"application/json": {"schema": CREATE_BODY_SCHEMA}}}},
            responses={200: {"description": "replaced"}, 201: {"description": "created"}})
async def create_model(model: str, request: Request, rt: Runtime = Depends(runtime)):
    """Create (201) or replace (200) a model from a tiny-cuda-nn spec; version 1 holds the seed's weights."""
    check_model_name(model)
    doc = json_body(await request.body())
    if not isinstance(doc, dict):
        raise InvalidInput("the body must be a JSON object {\"spec\": ..., \"config\": ...}")
    if "spec" not in doc:
        raise SpecError("spec", "is required: {\"spec\": <tiny-cuda-nn model JSON>, \"config\": {...}}")
    unknown = sorted(set(doc) - {"spec", "config"})
    if unknown:
        raise InvalidInput(f"unknown field {unknown[0]!r}; the body has spec and config")
    spec = MLPSpec.from_json(doc["spec"])
    config = ModelConfig.parse(doc.get("config"))
    created = await rt.registry.create(model, spec, config)
    return json_response(metadata(rt, rt.registry.get(model)), status=201 if created else 200)


@router.delete("/v2/models/{model}", dependencies=[Depends(require_key)])
async def delete_model(model: str, rt: Runtime = Depends(runtime)):
    await rt.registry.delete(model)
    return json_response({"model_name": model, "deleted": True})


# -- mmad: versions and weights -------------------------------------------------------------
@router.get("/v2/models/{model}/versions")
async def list_versions(model: str, rt: Runtime = Depends(runtime)):
    versions = rt.registry.versions(model)
    return json_response({"versions": versions, "latest": versions[-1]["version"]})


@router.post("/v2/models/{model}/versions", dependencies=[Depends(require_key)])
async def checkpoint(model: str, rt: Runtime = Depends(runtime)):
    entry = rt.registry.get_ready(model)
    version = await rt.registry.run(rt.registry.checkpoint_blocking, entry)
    return json_response(version)


@router.get("/v2/models/{model}/weights",
            responses={200: {"description": "safetensors", "content": {"application/octet-stream": {}}}})
async def get_weights(model: str, version: str | None = None, rt: Runtime = Depends(runtime)):
    """A stored version's safetensors file (``?version=``), else the live weights right now."""
    registry = rt.registry
    if version is not None:
        registry.get(model)
        data = await registry.run(registry.store.weights_bytes, model, registry.check_version(model, version))
        return Response(data, media_type="application/octet-stream", headers={"Mmad-Model-Version": version})
    entry = registry.get_ready(model)

    def snapshot() -> tuple[bytes, int]:
        with entry.lock:
            return tensors_to_bytes(entry.live.get_params()), entry.live.step_count

    data, step = await registry.run(snapshot)
    return Response(data, media_type="application/octet-stream", headers={"Mmad-Step": str(step)})


@router.put("/v2/models/{model}/weights", dependencies=[Depends(require_key)], openapi_extra=BINARY_REQUEST_DOC)
async def set_weights(model: str, request: Request, rt: Runtime = Depends(runtime)):
    entry = rt.registry.get_ready(model)
    params = tensors_from_bytes(await request.body(), "the body")
    version = await rt.registry.run(rt.registry.set_weights_blocking, entry, params)
    return json_response(version)
