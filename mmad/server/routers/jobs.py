"""Training jobs: start, status, cancel, and progress as Server-Sent Events."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from mmad.engine.api import EngineClient, JobEvent, JobRequest
from mmad.server.bodies import json_body, json_response
from mmad.server.deps import admitted_caller, engine, require_key
from mmad.server.errors import ERROR_RESPONSES

router = APIRouter(tags=["jobs"], responses=ERROR_RESPONSES)

SSE_KEEPALIVE_S = 15.0  # a comment line this often keeps proxies from closing a quiet stream


@router.post("/v2/models/{model}/jobs", dependencies=[Depends(require_key)], status_code=202,
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/json": {"schema": JobRequest.model_json_schema()}}}})
async def start_job(model: str, request: Request, engine: EngineClient = Depends(engine)):
    job = JobRequest.parse(json_body(await request.body()))
    status = await engine.start_job(model, job, admitted_caller(request))
    return json_response(dataclasses.asdict(status), status=202)


@router.get("/v2/jobs")
async def list_jobs(engine: EngineClient = Depends(engine)):
    """Every job the daemon keeps, newest first: those running and the latest finished ones."""
    return json_response({"jobs": [dataclasses.asdict(s) for s in await engine.jobs()]})


@router.get("/v2/models/{model}/jobs/{job_id}")
async def job_status(model: str, job_id: str, engine: EngineClient = Depends(engine)):
    return json_response(dataclasses.asdict(await engine.job_status(model, job_id)))


@router.get("/v2/models/{model}/jobs/{job_id}/losses")
async def job_losses(model: str, job_id: str, engine: EngineClient = Depends(engine)):
    """The job's loss curve from its first step: ``[[step, loss], ...]``, at most about a thousand
    points (evenly merged as the job runs); ``loss`` is null where it was NaN or Inf."""
    return json_response(dataclasses.asdict(await engine.job_losses(model, job_id)))


@router.delete("/v2/models/{model}/jobs/{job_id}", dependencies=[Depends(require_key)])
async def cancel_job(model: str, job_id: str, request: Request, engine: EngineClient = Depends(engine)):
    return json_response(dataclasses.asdict(await engine.cancel_job(model, job_id, admitted_caller(request))))


def sse(event: JobEvent) -> bytes:
    return b"event: " + event.event.encode() + b"\ndata: " + orjson.dumps(event.data) + b"\n\n"


async def sse_stream(events: AsyncIterator[JobEvent]) -> AsyncIterator[bytes]:
    """The job's events as Server-Sent Events, a keep-alive comment after each quiet
    ``SSE_KEEPALIVE_S`` (the wait for the next event goes on: it is not cancelled)."""
    pending = None
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=SSE_KEEPALIVE_S)
            if not done:
                yield b": keep-alive\n\n"
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield sse(event)
    finally:
        if pending is not None:  # the client went away: the generator closes as its wait is cancelled
            pending.cancel()
            await asyncio.wait({pending})
        else:
            await events.aclose()


@router.get("/v2/models/{model}/jobs/{job_id}/events",
            responses={200: {"description": "Server-Sent Events", "content": {"text/event-stream": {}}}})
async def job_events(model: str, job_id: str, engine: EngineClient = Depends(engine)):
    events = await engine.job_events(model, job_id)  # an unknown job is a 404 before the stream starts
    return StreamingResponse(sse_stream(events), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
