"""Training jobs: start, status, cancel, and progress as Server-Sent Events."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from mmad.server.bodies import json_body, json_response

from mmad.engine.runtime import Runtime
from mmad.server.deps import require_key, runtime

from mmad.server.errors import ERROR_RESPONSES
from mmad.engine.jobs import JobRequest

router = APIRouter(tags=["jobs"], responses=ERROR_RESPONSES)


@router.post("/v2/models/{model}/jobs", dependencies=[Depends(require_key)], status_code=202,
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/json": {"schema": JobRequest.model_json_schema()}}}})
async def start_job(model: str, request: Request, rt: Runtime = Depends(runtime)):
    job_request = JobRequest.parse(json_body(await request.body()))
    job = await rt.jobs.start(model, job_request)
    return json_response({"job": job.id, **job.status()}, status=202)


@router.get("/v2/jobs")
async def list_jobs(rt: Runtime = Depends(runtime)):
    """Every job the daemon keeps, newest first: those running and the latest finished ones."""
    jobs = sorted(rt.jobs.jobs.values(), key=lambda job: job.created, reverse=True)
    return json_response({"jobs": [job.status() for job in jobs]})


@router.get("/v2/models/{model}/jobs/{job_id}")
async def job_status(model: str, job_id: str, rt: Runtime = Depends(runtime)):
    return json_response(rt.jobs.get(model, job_id).status())


@router.get("/v2/models/{model}/jobs/{job_id}/losses")
async def job_losses(model: str, job_id: str, rt: Runtime = Depends(runtime)):
    """The job's loss curve from its first step: ``[[step, loss], ...]``, at most about a thousand
    points (evenly merged as the job runs); ``loss`` is null where it was NaN or Inf."""
    job = rt.jobs.get(model, job_id)
    return json_response({"job": job.id, "model_name": job.model, "step": job.step, "points": job.history.points()})


@router.delete("/v2/models/{model}/jobs/{job_id}", dependencies=[Depends(require_key)])
async def cancel_job(model: str, job_id: str, rt: Runtime = Depends(runtime)):
    return json_response(rt.jobs.cancel(model, job_id).status())


@router.get("/v2/models/{model}/jobs/{job_id}/events",
            responses={200: {"description": "Server-Sent Events", "content": {"text/event-stream": {}}}})
async def job_events(model: str, job_id: str, rt: Runtime = Depends(runtime)):
    job = rt.jobs.get(model, job_id)
    return StreamingResponse(job.events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
