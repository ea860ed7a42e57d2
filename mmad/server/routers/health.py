"""Health and server metadata (OIP v2)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from mmad.engine.api import EngineClient
from mmad.errors import NotReady
from mmad.server.bodies import json_response
from mmad.server.deps import engine
from mmad.server.errors import ERROR_RESPONSES

router = APIRouter(tags=["health"], responses=ERROR_RESPONSES)

# what the HTTP front end adds to the engine's extensions: binary tensors and mmad's own routes
HTTP_EXTENSIONS = (
    "binary_tensor_data", "mmad_model_management", "mmad_weights", "mmad_versions", "mmad_training",
    "mmad_training_jobs", "mmad_devices", "mmad_metrics",
)


@router.get("/v2/health/live")
async def live():
    return json_response({"live": True})


@router.get("/v2/health/ready")
async def ready(engine: EngineClient = Depends(engine)):
    readiness = await engine.ready()  # --workers: ready once every process serves
    if not readiness.ready:
        raise NotReady(readiness.reason)
    return json_response({"ready": True})


@router.get("/v2")
async def server_metadata(engine: EngineClient = Depends(engine)):
    meta = await engine.server_metadata()
    return json_response({"name": meta.name, "version": meta.version,
                          "extensions": [HTTP_EXTENSIONS[0], *meta.extensions, *HTTP_EXTENSIONS[1:]]})
