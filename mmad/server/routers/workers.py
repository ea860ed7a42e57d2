"""The primary's routes for its serving workers (``--workers``; :mod:`mmad.server.workers`):
what a worker needs to serve as the primary does. Not part of the API: left out of the schema,
and answered 404 without the token the primary made at start."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from starlette.exceptions import HTTPException

from mmad.errors import ModelNotReady
from mmad.server.bodies import json_response
from mmad.server.deps import Runtime, runtime
from mmad.engine.store import tensors_to_bytes
from mmad.server.workers import INTERNAL_PREFIX, check_token

router = APIRouter(include_in_schema=False)


async def worker_token(request: Request) -> None:  # async: no thread hop
    pool = request.app.state.runtime.workers
    if pool is None or not check_token(request.headers, pool.token):
        raise HTTPException(404)


@router.get(INTERNAL_PREFIX + "/state", dependencies=[Depends(worker_token)])
async def state(rt: Runtime = Depends(runtime)):
    """The ready models (what a worker compiles, and the generation of their weights) and the
    shared-memory regions; ``generation`` is read first, so all below is at least that new."""
    registry = rt.registry
    generation = registry.generation
    models = []
    for name, entry in list(registry.models.items()):
        live = entry.live
        if live is None:  # a worker passes its requests to the primary, which says why
            continue
        models.append({"name": name, "incarnation": entry.incarnation, "generation": entry.generation,
                       "spec": entry.spec.to_json(), "config": entry.config.model_dump(),
                       "devices": [r.device for r in entry.replicas], "variant": live.variant,
                       "version": registry.latest_version(name)})
    return json_response({"generation": generation, "backend": rt.selected.backend, "models": models,
                          "shm": rt.shm.registrations()})


@router.get(INTERNAL_PREFIX + "/weights/{model}", dependencies=[Depends(worker_token)])
async def weights(model: str, rt: Runtime = Depends(runtime)):
    """The live weights of ``model`` now (safetensors)."""
    entry = rt.registry.get_ready(model)

    def snapshot() -> bytes:
        with entry.lock:
            if entry.live is None:
                raise ModelNotReady(model)
            return tensors_to_bytes(entry.live.get_params())

    return Response(await rt.registry.run(snapshot), media_type="application/octet-stream")


@router.post(INTERNAL_PREFIX + "/ready/{index}", dependencies=[Depends(worker_token)])
async def worker_ready(index: int, rt: Runtime = Depends(runtime)):
    """A worker listens on the port: the daemon is ready once every worker said so."""
    rt.workers.mark_ready(index)
    return json_response({})
