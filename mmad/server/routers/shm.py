"""Triton's system and CUDA shared-memory extensions: register, unregister and list regions.

Registering a region lets the daemon read and write memory with its own permissions, so it is
an admin action: the API key where one is set, and ``--shared-memory`` (``off``: none;
``loopback``, the default: from clients on this host only; ``on``: from any client, which
needs an API key). A keyless daemon lets a local client register only a ``/dev/shm`` object of
the client's own user (:mod:`mmad.engine.peers` tells which user holds the connection), so no
local process reaches, through the daemon, an object it could not open itself.

The CUDA routes answer 400 with the reason (CUDA shared memory needs the cuda backend) on any
other backend; ``GET /v2`` lists ``cuda_shared_memory`` only where they work. The rules and the
checks of the values sent are the engine's (:class:`~mmad.engine.api.InferenceClient`): these
routes parse the JSON bodies and encode the engine's answers."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from fastapi import APIRouter, Depends, Request

from mmad.engine.api import CudaRegion, EngineClient, SystemRegion
from mmad.errors import InvalidInput
from mmad.server.bodies import json_body, json_response
from mmad.server.deps import admitted_caller, engine, require_key
from mmad.server.errors import ERROR_RESPONSES

router = APIRouter(tags=["shared memory"], responses=ERROR_RESPONSES)

_REGISTER_DOC = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["key", "byte_size"], "properties": {
        "key": {"type": "string", "description": "POSIX shared-memory name, e.g. /my_region"},
        "offset": {"type": "integer", "minimum": 0}, "byte_size": {"type": "integer", "minimum": 1}}}}}}}


def _system_doc(region: SystemRegion) -> dict[str, Any]:
    doc = {"name": region.name, "key": region.key, "offset": region.offset, "byte_size": region.byte_size}
    if region.page_locked is not None:  # mmad's addition: page-locking for device copies was tried
        doc["page_locked"] = region.page_locked
        if region.page_locked_error is not None:
            doc["page_locked_error"] = region.page_locked_error
    return doc


def _cuda_doc(region: CudaRegion) -> dict[str, Any]:
    return {"name": region.name, "device_id": region.device_id, "byte_size": region.byte_size}


def _object(body: bytes, fields: str) -> dict[str, Any]:
    doc = json_body(body)
    if not isinstance(doc, dict):
        raise InvalidInput(f"the register body must be a JSON object {fields}")
    return doc


@router.get("/v2/systemsharedmemory/status")
async def status_all(engine: EngineClient = Depends(engine)):
    return json_response([_system_doc(r) for r in await engine.system_shm_status()])


@router.get("/v2/systemsharedmemory/region/{region}/status")
async def status_one(region: str, engine: EngineClient = Depends(engine)):
    return json_response([_system_doc(r) for r in await engine.system_shm_status(region)])


@router.post("/v2/systemsharedmemory/region/{region}/register", dependencies=[Depends(require_key)],
             openapi_extra=_REGISTER_DOC)
async def register(region: str, request: Request, engine: EngineClient = Depends(engine)):
    doc = _object(await request.body(), '{"key", "offset", "byte_size"}')
    # (the engine checks the values, as it does those of every front end)
    await engine.system_shm_register(region, doc.get("key"), doc.get("offset", 0), doc.get("byte_size"),
                                     admitted_caller(request))
    return json_response({})


@router.post("/v2/systemsharedmemory/unregister", dependencies=[Depends(require_key)])
async def unregister_all(request: Request, engine: EngineClient = Depends(engine)):
    await engine.system_shm_unregister(None, admitted_caller(request))
    return json_response({})


@router.post("/v2/systemsharedmemory/region/{region}/unregister", dependencies=[Depends(require_key)])
async def unregister_one(region: str, request: Request, engine: EngineClient = Depends(engine)):
    await engine.system_shm_unregister(region, admitted_caller(request))
    return json_response({})


_CUDA_REGISTER_DOC = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["raw_handle", "device_id", "byte_size"], "properties": {
        "raw_handle": {"type": "object", "required": ["b64"], "properties": {
            "b64": {"type": "string", "description": "the cudaIpcMemHandle_t bytes in base64"}}},
        "device_id": {"type": "integer", "minimum": 0}, "byte_size": {"type": "integer", "minimum": 1}}}}}}}


def _raw_handle(doc: dict[str, Any]) -> bytes:
    raw = doc.get("raw_handle")
    b64 = raw.get("b64") if isinstance(raw, dict) else None
    if not isinstance(b64, str):
        raise InvalidInput('raw_handle must be {"b64": "<the CUDA IPC handle in base64>"}')
    try:
        return base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidInput(f"raw_handle.b64 is not valid base64: {exc}") from exc


@router.get("/v2/cudasharedmemory/status")
async def cuda_status_all(engine: EngineClient = Depends(engine)):
    return json_response([_cuda_doc(r) for r in await engine.cuda_shm_status()])


@router.get("/v2/cudasharedmemory/region/{region}/status")
async def cuda_status_one(region: str, engine: EngineClient = Depends(engine)):
    return json_response([_cuda_doc(r) for r in await engine.cuda_shm_status(region)])


@router.post("/v2/cudasharedmemory/region/{region}/register", dependencies=[Depends(require_key)],
             openapi_extra=_CUDA_REGISTER_DOC)
async def cuda_register(region: str, request: Request, engine: EngineClient = Depends(engine)):
    doc = _object(await request.body(), '{"raw_handle": {"b64": ...}, "device_id", "byte_size"}')
    await engine.cuda_shm_register(region, _raw_handle(doc), doc.get("device_id"), doc.get("byte_size"),
                                   admitted_caller(request))
    return json_response({})


@router.post("/v2/cudasharedmemory/unregister", dependencies=[Depends(require_key)])
async def cuda_unregister_all(request: Request, engine: EngineClient = Depends(engine)):
    await engine.cuda_shm_unregister(None, admitted_caller(request))
    return json_response({})


@router.post("/v2/cudasharedmemory/region/{region}/unregister", dependencies=[Depends(require_key)])
async def cuda_unregister_one(region: str, request: Request, engine: EngineClient = Depends(engine)):
    await engine.cuda_shm_unregister(region, admitted_caller(request))
    return json_response({})
