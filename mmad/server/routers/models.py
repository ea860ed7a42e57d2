"""Models: OIP v2 metadata, ready and infer, plus mmad's create/replace, delete, versions, weights."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from mmad.engine.api import EngineClient
from mmad.errors import InvalidInput, ModelNotReady, SpecError
from mmad.server.bodies import json_body, json_response
from mmad.engine.runtime import Runtime
from mmad.server.deps import admitted_caller, engine, require_key, runtime
from mmad.server.errors import ERROR_RESPONSES
from mmad.server.inference import infer_request
from mmad.server.openapi import BINARY_REQUEST_DOC, TENSOR_REQUEST_DOC, TENSOR_RESPONSES
from mmad.engine.config import ModelConfig

router = APIRouter(tags=["models"], responses=ERROR_RESPONSES)

CREATE_BODY_SCHEMA = {
    "type": "object", "required": ["spec"],
    "properties": {
        "spec": {"type": "object", "description": "tiny-cuda-nn model JSON (docs/api.md, 'Model specification')"},
        "config": ModelConfig.model_json_schema(),
    },
}


async def metadata(engine: EngineClient, model: str, version: str | None = None) -> dict[str, Any]:
    """Triton's model metadata and mmad's own state of the model (``ModelStatus``) in one document."""
    meta = await engine.model_metadata(model, version)
    status = await engine.model_status(model, version)
    return {
        "name": meta.name, "versions": meta.versions, "platform": meta.platform,
        "inputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in meta.inputs],
        "outputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in meta.outputs],
        "state": meta.state, "reason": meta.reason, "backend": meta.backend,
        **dataclasses.asdict(status), "devices": list(status.devices),
    }


# -- OIP v2 ---------------------------------------------------------------------------------
@router.get("/v2/models/{model}")
async def model_metadata(model: str, engine: EngineClient = Depends(engine)):
    return json_response(await metadata(engine, model))


@router.get("/v2/models/{model}/versions/{version}")
async def model_version_metadata(model: str, version: str, engine: EngineClient = Depends(engine)):
    return json_response(await metadata(engine, model, version))


async def check_ready(engine: EngineClient, model: str, version: str | None) -> None:
    """A model that is not READY is a 503 saying how to load it (Triton's ready answers 400 with
    no body; the reason helps more), before the version is looked at."""
    if (await engine.model_metadata(model)).state != "READY":
        raise ModelNotReady(model)
    if version is not None:
        await engine.model_metadata(model, version)  # 404 for a version the model lacks


@router.get("/v2/models/{model}/ready")
async def model_ready(model: str, engine: EngineClient = Depends(engine)):
    await check_ready(engine, model, None)
    return json_response({"name": model, "ready": True})


@router.get("/v2/models/{model}/versions/{version}/ready")
async def model_version_ready(model: str, version: str, engine: EngineClient = Depends(engine)):
    await check_ready(engine, model, version)
    return json_response({"name": model, "version": version, "ready": True})


@router.get("/v2/models/{model}/config")
async def model_config(model: str, engine: EngineClient = Depends(engine)):
    config = await engine.model_config(model)
    return json_response({
        "name": config.name, "platform": config.platform, "backend": config.backend,
        "max_batch_size": config.max_batch_size,
        "input": [{"name": t.name, "data_type": t.data_type, "dims": list(t.dims)} for t in config.inputs],
        "output": [{"name": t.name, "data_type": t.data_type, "dims": list(t.dims)} for t in config.outputs],
        "dynamic_batching": {"max_queue_delay_microseconds": config.max_queue_delay_us},
        "parameters": config.parameters,
    })


@router.post("/v2/models/{model}/infer", openapi_extra=TENSOR_REQUEST_DOC, responses=TENSOR_RESPONSES)
async def infer(model: str, request: Request, rt: Runtime = Depends(runtime), engine: EngineClient = Depends(engine)):
    return await infer_request(request, engine, rt, model, None)


@router.post("/v2/models/{model}/versions/{version}/infer", openapi_extra=TENSOR_REQUEST_DOC,
             responses=TENSOR_RESPONSES)
async def infer_version(model: str, version: str, request: Request, rt: Runtime = Depends(runtime),
                        engine: EngineClient = Depends(engine)):
    return await infer_request(request, engine, rt, model, version)


# -- mmad: create / replace / delete ----------------------------------------------------------
@router.put("/v2/models/{model}", dependencies=[Depends(require_key)], status_code=201,
            openapi_extra={"requestBody": {"required": True,
                                           "content": {"application/json": {"schema": CREATE_BODY_SCHEMA}}}},
            responses={200: {"description": "replaced"}, 201: {"description": "created"}})
async def create_model(model: str, request: Request, engine: EngineClient = Depends(engine)):
    """Create (201) or replace (200) a model from a tiny-cuda-nn spec; version 1 holds the seed's weights."""
    doc = json_body(await request.body())
    if not isinstance(doc, dict):
        raise InvalidInput("the body must be a JSON object {\"spec\": ..., \"config\": ...}")
    if "spec" not in doc:
        raise SpecError("spec", "is required: {\"spec\": <tiny-cuda-nn model JSON>, \"config\": {...}}")
    unknown = sorted(set(doc) - {"spec", "config"})
    if unknown:
        raise InvalidInput(f"unknown field {unknown[0]!r}; the body has spec and config")
    created = await engine.create_model(model, doc["spec"], doc.get("config"), admitted_caller(request))
    return json_response(await metadata(engine, model), status=201 if created else 200)


@router.delete("/v2/models/{model}", dependencies=[Depends(require_key)])
async def delete_model(model: str, request: Request, engine: EngineClient = Depends(engine)):
    await engine.delete_model(model, admitted_caller(request))
    return json_response({"model_name": model, "deleted": True})


# -- mmad: versions and weights -------------------------------------------------------------
@router.get("/v2/models/{model}/versions")
async def list_versions(model: str, engine: EngineClient = Depends(engine)):
    versions = [dataclasses.asdict(v) for v in await engine.versions(model)]
    return json_response({"versions": versions, "latest": versions[-1]["version"] if versions else None})


@router.post("/v2/models/{model}/versions", dependencies=[Depends(require_key)])
async def checkpoint(model: str, request: Request, engine: EngineClient = Depends(engine)):
    return json_response(dataclasses.asdict(await engine.checkpoint(model, admitted_caller(request))))


@router.get("/v2/models/{model}/weights",
            responses={200: {"description": "safetensors", "content": {"application/octet-stream": {}}}})
async def get_weights(model: str, version: str | None = None, engine: EngineClient = Depends(engine)):
    """A stored version's safetensors file (``?version=``), else the live weights right now."""
    weights = await engine.get_weights(model, version)
    headers = {"Mmad-Model-Version": version} if version is not None else {"Mmad-Step": str(weights.step)}
    return Response(weights.data, media_type="application/octet-stream", headers=headers)


@router.put("/v2/models/{model}/weights", dependencies=[Depends(require_key)], openapi_extra=BINARY_REQUEST_DOC)
async def set_weights(model: str, request: Request, engine: EngineClient = Depends(engine)):
    version = await engine.set_weights(model, await request.body(), admitted_caller(request))
    return json_response(dataclasses.asdict(version))
