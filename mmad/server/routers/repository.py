"""Model repository extension: index, load, unload."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from mmad.errors import InvalidInput
from mmad.server.bodies import json_body, json_response
from mmad.engine.runtime import Runtime
from mmad.server.deps import require_key, runtime
from mmad.server.errors import ERROR_RESPONSES

router = APIRouter(tags=["repository"], responses=ERROR_RESPONSES)


@router.post("/v2/repository/index")
async def index(request: Request, rt: Runtime = Depends(runtime)):
    body = await request.body()
    options = json_body(body) if body.strip() else {}
    if not isinstance(options, dict):
        raise InvalidInput("the repository index body must be a JSON object such as {\"ready\": true}")
    only_ready = bool(options.get("ready", False))
    rows = []
    # the store's models, and the model repository's folders that gave none (unreadable holds both)
    for name in sorted(set(rt.store.list_models()) | set(rt.registry.unreadable)):
        entry = rt.registry.models.get(name)
        ready = entry is not None and entry.ready
        if only_ready and not ready:
            continue
        # a READY model's reason is empty unless some of its versions are damaged
        reason = entry.reason if entry else rt.registry.unreadable.get(name, "not loaded")
        rows.append({"name": name, "version": rt.registry.latest_version(name) if entry else "",
                     "state": "READY" if ready else "UNAVAILABLE", "reason": reason})
    return json_response(rows)


@router.post("/v2/repository/models/{model}/load", dependencies=[Depends(require_key)])
async def load(model: str, rt: Runtime = Depends(runtime)):
    await rt.registry.load(model)
    return json_response({"model_name": model, "state": "READY"})


@router.post("/v2/repository/models/{model}/unload", dependencies=[Depends(require_key)])
async def unload(model: str, rt: Runtime = Depends(runtime)):
    await rt.registry.unload(model)
    return json_response({"model_name": model, "state": "UNAVAILABLE"})
