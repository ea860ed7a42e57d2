"""Model repository extension: index, load, unload."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from mmad.server.common import Runtime, json_body, json_response, require_key, runtime

router = APIRouter(tags=["repository"])


@router.post("/v2/repository/index")
async def index(request: Request, rt: Runtime = Depends(runtime)):
    body = await request.body()
    only_ready = bool(json_body(body).get("ready", False)) if body.strip() else False
    rows = []
    for name in rt.store.list_models():
        entry = rt.registry.models.get(name)
        ready = entry is not None and entry.ready
        if only_ready and not ready:
            continue
        rows.append({"name": name, "version": rt.registry.latest_version(name) if entry else "",
                     "state": "READY" if ready else "UNAVAILABLE",
                     "reason": "" if ready else (entry.reason if entry else "not loaded")})
    return json_response(rows)


@router.post("/v2/repository/models/{model}/load", dependencies=[Depends(require_key)])
async def load(model: str, rt: Runtime = Depends(runtime)):
    await rt.registry.load(model)
    return json_response({"model_name": model, "state": "READY"})


@router.post("/v2/repository/models/{model}/unload", dependencies=[Depends(require_key)])
async def unload(model: str, rt: Runtime = Depends(runtime)):
    await rt.registry.unload(model)
    return json_response({"model_name": model, "state": "UNAVAILABLE"})
