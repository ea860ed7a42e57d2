"""Prometheus text at ``/metrics`` and Triton's statistics extension."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Depends, Response

from mmad.engine.api import EngineClient, ModelStatistics
from mmad.engine.runtime import Runtime
from mmad.engine.statistics import worker_records
from mmad.server.bodies import json_response
from mmad.server.deps import engine, runtime
from mmad.server.errors import ERROR_RESPONSES

router = APIRouter(tags=["metrics"], responses=ERROR_RESPONSES)


@router.get("/metrics", responses={200: {"description": "Prometheus text", "content": {"text/plain": {}}}})
async def prometheus(rt: Runtime = Depends(runtime)):
    others = [r.samples for r in await worker_records(rt)]
    body, content_type = rt.metrics.render(others)
    return Response(body, media_type=content_type)


def _stats(statistics: list[ModelStatistics]) -> Response:
    # the typed record's fields are Triton's JSON keys
    return json_response({"model_stats": [dataclasses.asdict(s) for s in statistics]})


@router.get("/v2/models/stats")
async def all_stats(engine: EngineClient = Depends(engine)):
    return _stats(await engine.statistics())


@router.get("/v2/models/{model}/stats")
async def model_stats(model: str, engine: EngineClient = Depends(engine)):
    return _stats(await engine.statistics(model))


@router.get("/v2/models/{model}/versions/{version}/stats")
async def model_version_stats(model: str, version: str, engine: EngineClient = Depends(engine)):
    return _stats(await engine.statistics(model, version))
