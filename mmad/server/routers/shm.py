"""Triton's system and CUDA shared-memory extensions: register, unregister and list regions.

Registering a region lets the daemon read and write memory with its own permissions, so it is
an admin action: the API key where one is set, and ``--shared-memory`` (``off``: none;
``loopback``, the default: from clients on this host only; ``on``: from any client, which
needs an API key). A keyless daemon lets a local client register only a ``/dev/shm`` object of
the client's own user (:mod:`mmad.engine.peers` tells which user holds the connection), so no
local process reaches, through the daemon, an object it could not open itself.

The CUDA routes answer 400 with the reason (CUDA shared memory needs the cuda backend) on any
other backend; ``GET /v2`` lists ``cuda_shared_memory`` only where they work."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from mmad.errors import InvalidInput
from mmad.server.bodies import json_body, json_response
from mmad.engine.runtime import Runtime
from mmad.server.deps import require_key, runtime
from mmad.server.errors import ERROR_RESPONSES
from mmad.engine.peers import peer_of, shared_memory_owner
from mmad.server.internal import check_token

router = APIRouter(tags=["shared memory"], responses=ERROR_RESPONSES)


def admitted(request: Request, rt: Runtime) -> int | None:
    """:func:`~mmad.engine.peers.shared_memory_owner` for an HTTP request (the client's address
    as the connection or, behind ``--workers``, the serving worker tells it)."""
    via_worker = request.client is None and rt.workers is not None and check_token(request.headers, rt.workers.token)
    return shared_memory_owner(rt.settings.shared_memory, rt.settings.api_key_value is not None,
                               peer_of(request.scope, via_worker))

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
    owner = admitted(request, rt)
    # opening and (with region forwards) page-locking the object: off the event loop
    await rt.registry.run(rt.shm.register, region, json_body(await request.body()), owner,
                          rt.settings.max_shm_regions)
    return json_response({})


@router.post("/v2/systemsharedmemory/unregister", dependencies=[Depends(require_key)])
async def unregister_all(request: Request, rt: Runtime = Depends(runtime)):
    admitted(request, rt)
    rt.shm.unregister(None)
    return json_response({})


@router.post("/v2/systemsharedmemory/region/{region}/unregister", dependencies=[Depends(require_key)])
async def unregister_one(region: str, request: Request, rt: Runtime = Depends(runtime)):
    admitted(request, rt)
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
    admitted(request, rt)  # (an IPC handle names memory of the client's own process: no owner to check)
    # opening an IPC handle maps device memory: off the event loop
    await rt.registry.run(rt.shm.register_cuda, region, json_body(await request.body()), rt.settings.max_shm_regions)
    return json_response({})


@router.post("/v2/cudasharedmemory/unregister", dependencies=[Depends(require_key)])
async def cuda_unregister_all(request: Request, rt: Runtime = Depends(runtime)):
    _cuda(rt)
    admitted(request, rt)
    rt.shm.unregister(None, cuda=True)
    return json_response({})


@router.post("/v2/cudasharedmemory/region/{region}/unregister", dependencies=[Depends(require_key)])
async def cuda_unregister_one(region: str, request: Request, rt: Runtime = Depends(runtime)):
    _cuda(rt)
    admitted(request, rt)
    rt.shm.unregister(region, cuda=True)
    return json_response({})
