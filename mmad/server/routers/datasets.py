"""Datasets of a model for training jobs: created from a first chunk, grown chunk by chunk, listed,
deleted.

A chunk is a safetensors body (``x`` [rows, n_input_dims], ``y`` [rows, n_output_dims], float32
or float16, finite) of at most ``--max-body-bytes``; the engine streams it into its store (never
whole in memory), checks it there (header, the model's columns, the dataset's first chunk's
types, finite values) and moves it into the dataset. A dataset holds at most
``--max-dataset-bytes`` as stored, checked from the Content-Length before the body is read, while
it streams, and again when the chunk is added: a refused chunk leaves the dataset as it was.
"""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Depends, Request

from mmad.engine.api import EngineClient
from mmad.server.bodies import json_response
from mmad.server.deps import admitted_caller, engine, require_key
from mmad.server.errors import ERROR_RESPONSES
from mmad.server.openapi import BINARY_REQUEST_DOC
from mmad.settings import Settings

router = APIRouter(tags=["datasets"], responses=ERROR_RESPONSES)


def declared_length(request: Request) -> int | None:
    length = request.headers.get("content-length", "")
    return int(length) if length.isdigit() else None


@router.post("/v2/models/{model}/datasets", dependencies=[Depends(require_key)], openapi_extra=BINARY_REQUEST_DOC)
async def create_dataset(model: str, request: Request, engine: EngineClient = Depends(engine)):
    """A new dataset from its first chunk: a safetensors body with ``x`` [rows, n_input_dims] and ``y``
    [rows, n_output_dims] (float32 or float16, finite); more chunks go to ``.../datasets/{id}/chunks``."""
    info = await engine.create_dataset(model, request.stream(), declared_length(request), admitted_caller(request))
    return json_response({"dataset": info.dataset, "rows": info.rows, "bytes": info.bytes})


@router.post("/v2/models/{model}/datasets/{dataset}/chunks", dependencies=[Depends(require_key)],
             openapi_extra=BINARY_REQUEST_DOC)
async def append_chunk(model: str, dataset: str, request: Request, engine: EngineClient = Depends(engine)):
    """The dataset's next chunk: the same tensors, types and columns as its first chunk."""
    info = await engine.append_dataset_chunk(model, dataset, request.stream(), declared_length(request),
                                             admitted_caller(request))
    return json_response({"dataset": dataset, "rows": info.rows, "bytes": info.bytes, "chunks": info.chunks})


@router.get("/v2/models/{model}/datasets")
async def list_datasets(model: str, request: Request, engine: EngineClient = Depends(engine)):
    """The model's datasets, and the limits an upload must keep (bytes of a chunk, of a dataset)."""
    settings: Settings = request.app.state.runtime.settings
    infos = await engine.datasets(model)
    return json_response({"datasets": [dataclasses.asdict(i) for i in infos],
                          "max_chunk_bytes": settings.max_body_bytes,
                          "max_dataset_bytes": settings.max_dataset_bytes})


@router.get("/v2/models/{model}/datasets/{dataset}")
async def get_dataset(model: str, dataset: str, engine: EngineClient = Depends(engine)):
    return json_response(dataclasses.asdict(await engine.dataset(model, dataset)))


@router.delete("/v2/models/{model}/datasets/{dataset}", dependencies=[Depends(require_key)])
async def delete_dataset(model: str, dataset: str, request: Request, engine: EngineClient = Depends(engine)):
    """Delete the dataset and drop the copy its model's backend holds. A running job that trains
    from it keeps the copy it holds until it ends (its memory is freed then)."""
    await engine.delete_dataset(model, dataset, admitted_caller(request))
    return json_response({"model_name": model, "dataset": dataset, "deleted": True})
