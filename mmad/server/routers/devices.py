"""``GET /v2/devices``: the probe report taken once at startup."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from mmad.server.bodies import json_response

from mmad.server.deps import Runtime, runtime

from mmad.server.errors import ERROR_RESPONSES

router = APIRouter(tags=["devices"], responses=ERROR_RESPONSES)


@router.get("/v2/devices")
async def devices(rt: Runtime = Depends(runtime)):
    return json_response({"selected": rt.selected.to_json(), "rows": [r.to_json() for r in rt.probe_rows]})
