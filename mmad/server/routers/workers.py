"""The primary's routes for its serving workers (``--workers``; :mod:`mmad.server.workers`):
what a worker needs to serve as the primary does. Not part of the API: left out of the schema,
and answered 404 without the token the primary made at start."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from starlette.exceptions import HTTPException

from mmad.server.bodies import json_response
from mmad.engine.inprocess import InProcessEngine
from mmad.engine.runtime import Runtime
from mmad.server.deps import engine, runtime
from mmad.engine.messages import ENGINE_METHODS, PrimaryState
from mmad.engine.worker_client import answer_call
from mmad.server.internal import INTERNAL_PREFIX, check_token

router = APIRouter(include_in_schema=False)


async def worker_token(request: Request) -> None:  # async: no thread hop
    pool = request.app.state.runtime.workers
    if pool is None or not check_token(request.headers, pool.token):
        raise HTTPException(404)


@router.get(INTERNAL_PREFIX + "/state", dependencies=[Depends(worker_token)])
async def state(rt: Runtime = Depends(runtime)):
    """The ready models (what a worker compiles, and the generation of their weights) and the
    shared-memory regions; ``generation`` is read first, so all below is at least that new."""
    generation = rt.registry.generation
    state = PrimaryState(generation, rt.selected.backend, rt.registry.served_models(), rt.shm.registrations())
    return json_response(state.to_json())


@router.get(INTERNAL_PREFIX + "/weights/{model}", dependencies=[Depends(worker_token)])
async def weights(model: str, rt: Runtime = Depends(runtime)):
    """The live weights of ``model`` now (safetensors)."""
    data, _step = await rt.registry.live_weights(rt.registry.get_ready(model))
    return Response(data, media_type="application/octet-stream")


@router.post(INTERNAL_PREFIX + "/ready/{index}", dependencies=[Depends(worker_token)])
async def worker_ready(index: int, rt: Runtime = Depends(runtime)):
    """A worker listens on the port: the daemon is ready once every worker said so."""
    rt.workers.mark_ready(index)
    return json_response({})


@router.post(INTERNAL_PREFIX + "/engine/{method}", dependencies=[Depends(worker_token)])
async def engine_call(method: str, request: Request, engine: InProcessEngine = Depends(engine)):
    """A call of the engine's interface a worker's front end (gRPC) passed on, with the caller it
    names (:class:`~mmad.engine.worker_client.WorkerEngine`), answered by this process's engine."""
    if method not in ENGINE_METHODS:
        raise HTTPException(404)
    answer = await answer_call(engine, method, await request.body())
    return Response(answer, media_type="application/octet-stream")
