"""Models: OIP v2 metadata, ready and infer, plus mmad's create/replace, delete, versions, weights."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from mmad.errors import InvalidInput, SpecError
from mmad.backends.contract import param_shapes
from mmad.server.bodies import check_safetensors_header, json_body, json_response
from mmad.engine.runtime import Runtime
from mmad.server.deps import require_key, runtime
from mmad.server.errors import ERROR_RESPONSES
from mmad.server.inference import infer_request
from mmad.server.openapi import BINARY_REQUEST_DOC, TENSOR_REQUEST_DOC, TENSOR_RESPONSES
from mmad.engine.registry import INPUT, OUTPUT, ModelConfig, ModelEntry
from mmad.engine.store import check_model_name, tensors_from_bytes
from mmad.engine.messages import WorkerRecords
from mmad.engine.statistics import worker_queued, worker_records
from mmad.spec import MLPSpec

router = APIRouter(tags=["models"], responses=ERROR_RESPONSES)

CREATE_BODY_SCHEMA = {
    "type": "object", "required": ["spec"],
    "properties": {
        "spec": {"type": "object", "description": "tiny-cuda-nn model JSON (docs/api.md, 'Model specification')"},
        "config": ModelConfig.model_json_schema(),
    },
}


def metadata(rt: Runtime, entry: ModelEntry, records: list[WorkerRecords] = ()) -> dict[str, Any]:
    """The model's metadata; ``records``: the serving workers' (their queued requests count too)."""
    versions = rt.registry.versions(entry.name)
    limits = entry.config.limits(rt.settings)
    live = entry.live  # read once: an unload may clear it meanwhile
    return {
        "name": entry.name, "versions": [v["version"] for v in versions], "platform": "mmad",
        "inputs": [{"name": INPUT, "datatype": "FP32", "shape": [-1, entry.spec.n_input_dims]}],
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [-1, entry.spec.n_output_dims]}],
        "state": "READY" if entry.ready else "UNAVAILABLE", "reason": entry.reason,
        "backend": rt.registry.backend_label, "latest_version": versions[-1]["version"] if versions else "",
        "step": entry.live.step_count if entry.live is not None else (versions[-1]["step"] if versions else 0),
        "queued_requests": (entry.batcher.queued if entry.batcher is not None else 0)
                           + worker_queued(list(records), entry),
        "devices": [r.device for r in entry.replicas if r.model is not None],  # the replicas', primary first
        # the variant the primary runs, and the dispatcher's figures when it was chosen by measurement
        "variant": live.variant if live is not None else None,
        "dispatch": live.dispatch.to_json() if live is not None and live.dispatch is not None else None,
        "spec": entry.spec.to_json(),
        "config": {"max_batch_rows": limits.max_batch_rows, "max_queue_delay_us": limits.max_queue_delay_us,
                   "max_queue_requests": limits.max_queue_requests,
                   "allow_nonfinite": entry.config.allow_nonfinite, "device": entry.config.device,
                   "replicas": entry.config.replicas, "variant": entry.config.variant},
    }


# -- OIP v2 ---------------------------------------------------------------------------------
@router.get("/v2/models/{model}")
async def model_metadata(model: str, rt: Runtime = Depends(runtime)):
    entry = rt.registry.get(model)
    return json_response(metadata(rt, entry, await worker_records(rt)))


@router.get("/v2/models/{model}/versions/{version}")
async def model_version_metadata(model: str, version: str, rt: Runtime = Depends(runtime)):
    entry = rt.registry.get(model)
    rt.registry.check_version(model, version)
    return json_response(metadata(rt, entry, await worker_records(rt)))


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


@router.post("/v2/models/{model}/infer", openapi_extra=TENSOR_REQUEST_DOC, responses=TENSOR_RESPONSES)
async def infer(model: str, request: Request, rt: Runtime = Depends(runtime)):
    return await infer_request(request, rt, model, None)


@router.post("/v2/models/{model}/versions/{version}/infer", openapi_extra=TENSOR_REQUEST_DOC,
             responses=TENSOR_RESPONSES)
async def infer_version(model: str, version: str, request: Request, rt: Runtime = Depends(runtime)):
    return await infer_request(request, rt, model, version)


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
    return json_response({"versions": versions, "latest": versions[-1]["version"] if versions else None})


@router.post("/v2/models/{model}/versions", dependencies=[Depends(require_key)])
async def checkpoint(model: str, rt: Runtime = Depends(runtime)):
    entry = rt.registry.get_ready(model)
    version = await rt.registry.checkpoint(entry)
    return json_response(version)


@router.get("/v2/models/{model}/weights",
            responses={200: {"description": "safetensors", "content": {"application/octet-stream": {}}}})
async def get_weights(model: str, version: str | None = None, rt: Runtime = Depends(runtime)):
    """A stored version's safetensors file (``?version=``), else the live weights right now."""
    registry = rt.registry
    if version is not None:
        data = await registry.stored_weights(model, version)
        return Response(data, media_type="application/octet-stream", headers={"Mmad-Model-Version": version})
    data, step = await registry.live_weights(registry.get_ready(model))
    return Response(data, media_type="application/octet-stream", headers={"Mmad-Step": str(step)})


# a weight file's safetensors header: an entry per parameter (~70 bytes: name, dtype, shape,
# offsets) with room to spare, and the metadata a writer adds ({"format": "pt"} and the like)
HEADER_BYTES_PER_PARAMETER, HEADER_METADATA_BYTES = 256, 64 * 1024


def uploaded_weights(spec: MLPSpec, data: bytes) -> dict[str, Any]:
    """The tensors of a weight upload, its header bounded by what ``spec``'s parameters need."""
    check_safetensors_header(data, "the body", HEADER_METADATA_BYTES + HEADER_BYTES_PER_PARAMETER * len(
        param_shapes(spec)))
    return tensors_from_bytes(data, "the body")


@router.put("/v2/models/{model}/weights", dependencies=[Depends(require_key)], openapi_extra=BINARY_REQUEST_DOC)
async def set_weights(model: str, request: Request, rt: Runtime = Depends(runtime)):
    entry = rt.registry.get_ready(model)
    params = await rt.registry.run(uploaded_weights, entry.spec, await request.body())
    version = await rt.registry.set_weights(entry, params)
    return json_response(version)
