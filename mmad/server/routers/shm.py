"""Triton's system shared-memory extension: register, unregister and list regions."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from mmad.server.bodies import json_body, json_response
from mmad.server.deps import Runtime, require_key, runtime
from mmad.server.errors import ERROR_RESPONSES

router = APIRouter(tags=["shared memory"], responses=ERROR_RESPONSES)

_REGISTER_DOC = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["key", "byte_size"], "properties": {
        "key": {"type": "string", "description": "POSIX shared-memory name, e.g. /my_region"},
        "offset": {"type": "integer", "minimum": 0}, "byte_size": {"type": "integer", "minimum": 1}}}}}}}


@router.get("/v2/systemsharedmemory/status")
async def status_all(rt: Runtime = Depends(runtime)):
    return json_response(rt.shm.status())


@router.get("/v2/systemsharedmemory/region/{region}/status")
async def status_one(region: str, rt: Runtime = Depends(runtime)):
    return json_response(rt.shm.status(region))


@router.post("/v2/systemsharedmemory/region/{region}/register", dependencies=[Depends(require_key)],
             openapi_extra=_REGISTER_DOC)
async def register(region: str, request: Request, rt: Runtime = Depends(runtime)):
    rt.shm.register(region, json_body(await request.body()))
    return json_response({})


@router.post("/v2/systemsharedmemory/unregister", dependencies=[Depends(require_key)])
async def unregister_all(rt: Runtime = Depends(runtime)):
    rt.shm.unregister(None)
    return json_response({})


@router.post("/v2/systemsharedmemory/region/{region}/unregister", dependencies=[Depends(require_key)])
async def unregister_one(region: str, rt: Runtime = Depends(runtime)):
    rt.shm.unregister(region)
    return json_response({})
