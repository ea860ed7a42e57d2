"""``GET /v2/devices``: the probe report taken once at startup, each device's memory and load now,
and the variants the dispatcher chose for the loaded models (the engine's
:class:`~mmad.engine.api.DevicesReport`)."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Depends

from mmad.engine.api import EngineClient
from mmad.server.bodies import json_response
from mmad.server.deps import engine
from mmad.server.errors import ERROR_RESPONSES

router = APIRouter(tags=["devices"], responses=ERROR_RESPONSES)


@router.get("/v2/devices")
async def devices(engine: EngineClient = Depends(engine)):
    return json_response(dataclasses.asdict(await engine.devices()))
