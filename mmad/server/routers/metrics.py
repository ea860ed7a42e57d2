"""Prometheus text at ``/metrics`` and Triton's statistics extension."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response

from mmad.server.bodies import json_response

from mmad.engine.runtime import Runtime
from mmad.server.deps import runtime

from mmad.server.errors import ERROR_RESPONSES
from mmad.engine.statistics import model_statistics, worker_records

router = APIRouter(tags=["metrics"], responses=ERROR_RESPONSES)


@router.get("/metrics", responses={200: {"description": "Prometheus text", "content": {"text/plain": {}}}})
async def prometheus(rt: Runtime = Depends(runtime)):
    others = [r.samples for r in await worker_records(rt)]
    body, content_type = rt.metrics.render(others)
    return Response(body, media_type=content_type)


@router.get("/v2/models/stats")
async def all_stats(rt: Runtime = Depends(runtime)):
    records = await worker_records(rt)
    return json_response({"model_stats": [model_statistics(rt, records, name) for name in sorted(rt.registry.models)]})


@router.get("/v2/models/{model}/stats")
async def model_stats(model: str, rt: Runtime = Depends(runtime)):
    rt.registry.get(model)  # an unknown name is answered before the workers are asked
    return json_response({"model_stats": [model_statistics(rt, await worker_records(rt), model)]})


@router.get("/v2/models/{model}/versions/{version}/stats")
async def model_version_stats(model: str, version: str, rt: Runtime = Depends(runtime)):
    rt.registry.get(model)
    rt.registry.check_version(model, version)
    return json_response({"model_stats": [model_statistics(rt, await worker_records(rt), model, version)]})
