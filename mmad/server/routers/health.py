"""Health and server metadata (OIP v2)."""

from __future__ import annotations

from fastapi import APIRouter, Request

import mmad
from mmad.errors import NotReady
from mmad.server.bodies import json_response
from mmad.server.errors import ERROR_RESPONSES

router = APIRouter(tags=["health"], responses=ERROR_RESPONSES)

EXTENSIONS = [
    "binary_tensor_data", "system_shared_memory", "model_repository", "statistics", "model_configuration",
    "mmad_model_management", "mmad_weights", "mmad_versions", "mmad_training", "mmad_training_jobs",
    "mmad_devices", "mmad_metrics",
]


@router.get("/v2/health/live")
async def live():
    return json_response({"live": True})


@router.get("/v2/health/ready")
async def ready(request: Request):
    rt = request.app.state.runtime
    if not rt.ready or rt.shutting_down:
        raise NotReady("the daemon is not ready")
    if rt.workers is not None and rt.workers.waiting:  # --workers: ready once every process serves
        raise NotReady(f"serving worker(s) {', '.join(map(str, rt.workers.waiting))} are still starting")
    return json_response({"ready": True})


@router.get("/v2")
async def server_metadata(request: Request):
    rt = request.app.state.runtime
    extensions = [*EXTENSIONS, *(["cuda_shared_memory"] if rt.shm.cuda_enabled else [])]
    if rt.settings.shared_memory == "off":  # --shared-memory off: neither extension is offered
        extensions = [e for e in extensions if not e.endswith("_shared_memory")]
    return json_response({"name": "mmad", "version": mmad.__version__, "extensions": extensions})
