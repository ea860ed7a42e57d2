"""Triton's system and CUDA shared-memory extensions: register, unregister and list regions.

The CUDA routes answer 400 with the reason (CUDA shared memory needs the cuda backend) on any
other backend; ``GET /v2`` lists ``cuda_shared_memory`` only where they work."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from mmad.errors import InvalidInput
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


_CUDA_REGISTER_DOC = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["raw_handle", "device_id", "byte_size"], "properties": {
        "raw_handle": {"type": "object", "required": ["b64"], "properties": {
            "b64": {"type": "string", "description": "the cudaIpcMemHandle_t bytes in base64"}}},
        "device_id": {"type": "integer", "minimum": 0}, "byte_size": {"type": "integer", "minimum": 1}}}}}}}


def _cuda(rt: Runtime) -> None:
    if not rt.shm.cuda_enabled:
        raise InvalidInput(rt.shm.cuda_unavailable)


@router.get("/v2/cudasharedmemory/status")
async def cuda_status_all(rt: Runtime = Depends(runtime)):
    _cuda(rt)
    return json_response(rt.shm.status(cuda=True))


@router.get("/v2/cudasharedmemory/region/{region}/status")
async def cuda_status_one(region: str, rt: Runtime = Depends(runtime)):
    _cuda(rt)
    return json_response(rt.shm.status(region, cuda=True))


@router.post("/v2/cudasharedmemory/region/{region}/register", dependencies=[Depends(require_key)],
             openapi_extra=_CUDA_REGISTER_DOC)
async def cuda_register(region: str, request: Request, rt: Runtime = Depends(runtime)):
    _cuda(rt)
    # opening an IPC handle maps device memory: off the event loop
    await rt.registry.run(rt.shm.register_cuda, region, json_body(await request.body()))
    return json_response({})


@router.post("/v2/cudasharedmemory/unregister", dependencies=[Depends(require_key)])
async def cuda_unregister_all(rt: Runtime = Depends(runtime)):
    _cuda(rt)
    rt.shm.unregister(None, cuda=True)
    return json_response({})


@router.post("/v2/cudasharedmemory/region/{region}/unregister", dependencies=[Depends(require_key)])
async def cuda_unregister_one(region: str, rt: Runtime = Depends(runtime)):
    _cuda(rt)
    rt.shm.unregister(region, cuda=True)
    return json_response({})
