"""Training over HTTP: optimizer steps on the batch sent, and dataset upload for jobs."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Depends, Request

from mmad.errors import InvalidInput, MMADError
from mmad.server.bodies import json_response
from mmad.server.deps import Runtime, require_key, runtime
from mmad.server.errors import ERROR_RESPONSES, status_for
from mmad.server.jobs import JobManager
from mmad.server.metrics import UNKNOWN_MODEL
from mmad.server.openapi import BINARY_REQUEST_DOC, TENSOR_REQUEST_DOC
from mmad.server.registry import INPUT, TARGET
from mmad.server.store import check_model_name, tensors_from_bytes
from mmad.server.tensors import model_tensors, parse_tensors

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
        losses, step = await rt.registry.run(entry.train_live, tensors[INPUT], tensors[TARGET], steps)
    except MMADError as exc:
        if labels[0] is UNKNOWN_MODEL:
            rt.metrics.requests.labels(*labels, "train").inc()
        rt.metrics.failures.labels(*labels, "train", str(status_for(exc))).inc()
        raise
    rows = tensors[INPUT].shape[0]
    rt.metrics.training_steps.labels(*labels).inc(steps)
    rt.metrics.training_samples.labels(*labels).inc(rows * steps)
    losses = [float(v) if np.isfinite(v) else None for v in losses]
    return json_response({"losses": losses, "step": step, "model_name": model})


@router.post("/v2/models/{model}/datasets", dependencies=[Depends(require_key)], openapi_extra=BINARY_REQUEST_DOC)
async def upload_dataset(model: str, request: Request, rt: Runtime = Depends(runtime)):
    """A safetensors file with ``x`` [rows, n_input_dims] and ``y`` [rows, n_output_dims]."""
    entry = rt.registry.get(model)
    body = await request.body()
    data = tensors_from_bytes(body, "the dataset")
    JobManager.check_dataset(entry.spec, data, batch_size=1)
    for name, array in data.items():
        if not np.isfinite(array).all():
            raise InvalidInput(f"dataset {name} holds NaN or Inf")
    dataset_id = await rt.registry.run(rt.store.add_dataset, model, body)
    return json_response({"dataset": dataset_id, "rows": int(data["x"].shape[0])})
