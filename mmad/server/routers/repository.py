"""Model repository extension: index, load, unload."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from mmad.engine.api import EngineClient
from mmad.errors import InvalidInput
from mmad.server.bodies import json_body, json_response
from mmad.server.deps import admitted_caller, engine, require_key
from mmad.server.errors import ERROR_RESPONSES

router = APIRouter(tags=["repository"], responses=ERROR_RESPONSES)


@router.post("/v2/repository/index")
async def index(request: Request, engine: EngineClient = Depends(engine)):
    """The store's models and the model repository's folders that gave none; a READY model's
    reason is empty unless some of its versions are damaged."""
    body = await request.body()
    options = json_body(body) if body.strip() else {}
    if not isinstance(options, dict):
        raise InvalidInput("the repository index body must be a JSON object such as {\"ready\": true}")
    rows = await engine.repository_index(bool(options.get("ready", False)))
    return json_response([{"name": r.name, "version": r.version, "state": r.state, "reason": r.reason} for r in rows])


@router.post("/v2/repository/models/{model}/load", dependencies=[Depends(require_key)])
async def load(model: str, request: Request, engine: EngineClient = Depends(engine)):
    await engine.load_model(model, admitted_caller(request))
    return json_response({"model_name": model, "state": "READY"})


@router.post("/v2/repository/models/{model}/unload", dependencies=[Depends(require_key)])
async def unload(model: str, request: Request, engine: EngineClient = Depends(engine)):
    await engine.unload_model(model, admitted_caller(request))
    return json_response({"model_name": model, "state": "UNAVAILABLE"})
