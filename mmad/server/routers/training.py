"""Training over HTTP: optimizer steps on the batch sent (datasets for jobs: ``routers/datasets.py``).

A ``/train`` request runs in slices of about ``SLICE_S`` seconds on the training threads: between
slices other work gets the threads and the model's lock, and a client that has gone away stops
the request at the next slice (the steps done so far stay, as if it had asked for fewer).
"""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Depends, Request

from mmad.engine.inference import model_tensors
from mmad.engine.training import train_in_slices
from mmad.errors import InvalidInput, MMADError
from mmad.server.bodies import json_response
from mmad.engine.runtime import Runtime
from mmad.server.deps import require_key, runtime
from mmad.server.errors import ERROR_RESPONSES, status_for
from mmad.engine.metrics import UNKNOWN_MODEL
from mmad.server.openapi import TENSOR_REQUEST_DOC
from mmad.engine.registry import INPUT, TARGET
from mmad.engine.store import check_model_name
from mmad.server.tensors import parse_tensors

router = APIRouter(tags=["training"], responses=ERROR_RESPONSES)

MAX_STEPS_PER_REQUEST = 100_000


@router.post("/v2/models/{model}/train", dependencies=[Depends(require_key)], openapi_extra=TENSOR_REQUEST_DOC)
async def train(model: str, request: Request, rt: Runtime = Depends(runtime)):
    """``parameters.steps`` optimizer steps on INPUT/TARGET (JSON or binary tensors); returns the losses."""
    check_model_name(model)
    labels = (UNKNOWN_MODEL, rt.registry.backend_label)  # series only for models that exist (inference.py)
    try:
        rt.registry.get(model)
        labels = (model, rt.registry.backend_label)
        rt.metrics.requests.labels(*labels, "train").inc()
        entry = rt.registry.get_ready(model)
        parsed = await parse_tensors(rt, request)
        steps = parsed.parameters.get("steps", 1)
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS_PER_REQUEST:
            raise InvalidInput(f"parameters.steps must be an integer from 1 to {MAX_STEPS_PER_REQUEST}; got {steps!r}")
        tensors = model_tensors(entry, parsed, {INPUT: entry.spec.n_input_dims, TARGET: entry.spec.n_output_dims})
        slices, step, _gone = await train_in_slices(rt, entry, tensors[INPUT], tensors[TARGET], steps,
                                                    request.is_disconnected)
    except MMADError as exc:
        if labels[0] is UNKNOWN_MODEL:
            rt.metrics.requests.labels(*labels, "train").inc()
        rt.metrics.failures.labels(*labels, "train", str(status_for(exc))).inc()
        raise
    losses = np.concatenate(slices)
    rows = tensors[INPUT].shape[0]
    rt.metrics.training_steps.labels(*labels).inc(losses.size)
    rt.metrics.training_samples.labels(*labels).inc(rows * losses.size)
    losses = [float(v) if np.isfinite(v) else None for v in losses]
    return json_response({"losses": losses, "step": step, "model_name": model})
