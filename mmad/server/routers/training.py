"""Training over HTTP: optimizer steps on the batch sent (datasets for jobs: ``routers/datasets.py``).

A ``/train`` request runs in slices of about ``SLICE_S`` seconds on the training threads: between
slices other work gets the threads and the model's lock, and a client that has gone away stops
the request at the next slice (the steps done so far stay, as if it had asked for fewer).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from mmad.engine.api import EngineClient
from mmad.errors import InvalidInput, MMADError
from mmad.server.bodies import json_response
from mmad.engine.runtime import Runtime
from mmad.server.deps import admitted_caller, engine, require_key, runtime
from mmad.server.errors import ERROR_RESPONSES, status_for
from mmad.engine.metrics import UNKNOWN_MODEL
from mmad.server.openapi import TENSOR_REQUEST_DOC
from mmad.server.tensors import parse_tensors

router = APIRouter(tags=["training"], responses=ERROR_RESPONSES)

MAX_STEPS_PER_REQUEST = 100_000


@router.post("/v2/models/{model}/train", dependencies=[Depends(require_key)], openapi_extra=TENSOR_REQUEST_DOC)
async def train(model: str, request: Request, rt: Runtime = Depends(runtime),
                engine: EngineClient = Depends(engine)):
    """``parameters.steps`` optimizer steps on INPUT/TARGET (JSON or binary tensors); returns the losses."""
    backend = rt.registry.backend_label
    try:
        parsed = await parse_tensors(rt, request, resolve_shm=False)
        if parsed.shm_refs:
            raise InvalidInput(f"input {next(iter(parsed.shm_refs))!r} names a shared-memory region: shared memory "
                               "carries infer requests; send training tensors in the body (JSON or binary)")
        steps = parsed.parameters.get("steps", 1)
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS_PER_REQUEST:
            raise InvalidInput(f"parameters.steps must be an integer from 1 to {MAX_STEPS_PER_REQUEST}; got {steps!r}")
        result = await engine.train(model, parsed.tensors, steps, admitted_caller(request), request.is_disconnected)
    except MMADError as exc:
        # series only for models that exist (inference.py)
        labels = (model if model in rt.registry.models else UNKNOWN_MODEL, backend)
        rt.metrics.requests.labels(*labels, "train").inc()
        rt.metrics.failures.labels(*labels, "train", str(status_for(exc))).inc()
        raise
    rt.metrics.requests.labels(model, backend, "train").inc()
    return json_response({"losses": result.losses, "step": result.step, "model_name": model})
