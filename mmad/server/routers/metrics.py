"""Prometheus text at ``/metrics`` and Triton's statistics extension."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response

from mmad.server.bodies import json_response

from mmad.server.deps import Runtime, runtime

from mmad.server.errors import ERROR_RESPONSES

router = APIRouter(tags=["metrics"], responses=ERROR_RESPONSES)


@router.get("/metrics", responses={200: {"description": "Prometheus text", "content": {"text/plain": {}}}})
async def prometheus(rt: Runtime = Depends(runtime)):
    body, content_type = rt.metrics.render()
    return Response(body, media_type=content_type)


def _model_stats(rt: Runtime, name: str, version: str | None = None) -> dict:
    entry = rt.registry.get(name)
    if version is not None:
        rt.registry.check_version(name, version)
    return entry.stats.to_json(name, version or rt.registry.latest_version(name))


@router.get("/v2/models/stats")
async def all_stats(rt: Runtime = Depends(runtime)):
    return json_response({"model_stats": [_model_stats(rt, name) for name in sorted(rt.registry.models)]})


@router.get("/v2/models/{model}/stats")
async def model_stats(model: str, rt: Runtime = Depends(runtime)):
    return json_response({"model_stats": [_model_stats(rt, model)]})


@router.get("/v2/models/{model}/versions/{version}/stats")
async def model_version_stats(model: str, version: str, rt: Runtime = Depends(runtime)):
    return json_response({"model_stats": [_model_stats(rt, model, version)]})
