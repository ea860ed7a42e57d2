"""Datasets of a model for training jobs: created from a first chunk, grown chunk by chunk, listed,
deleted.

A chunk is a safetensors body (``x`` [rows, n_input_dims], ``y`` [rows, n_output_dims], float32
or float16, finite) of at most ``--max-body-bytes``; it streams into a file of the store's
``.incoming`` directory (never whole in memory), is checked there (header, the model's columns,
the dataset's first chunk's types, finite values) and renamed into the dataset. A dataset holds at
most ``--max-dataset-bytes`` as stored, checked from the Content-Length before the body is read,
while it streams, and again when the chunk is added: a refused chunk leaves the dataset as it was.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Depends, Request

from mmad.server.bodies import json_response, stream_to_file
from mmad.engine.runtime import Runtime
from mmad.server.deps import require_key, runtime
from mmad.server.errors import ERROR_RESPONSES
from mmad.server.openapi import BINARY_REQUEST_DOC
from mmad.engine.registry import ModelEntry
from mmad.engine.store import ChunkHeader, DatasetInfo, check_dataset_id, check_dataset_size, store_write

router = APIRouter(tags=["datasets"], responses=ERROR_RESPONSES)


async def receive_chunk(rt: Runtime, request: Request, entry: ModelEntry, stored: int) -> tuple[Path, ChunkHeader]:
    """The request body as a checked chunk file (the caller moves or removes it); ``stored``: the
    bytes the dataset holds already, for the dataset limit."""
    limit = rt.settings.max_dataset_bytes
    length = request.headers.get("content-length", "")
    if length.isdigit():  # refused before a byte of the body is read
        check_dataset_size(stored + int(length), limit)
    path = await rt.registry.datasets.incoming_path()
    try:
        with store_write(f"the dataset chunk for model {entry.name!r}"):  # a full disk is a 507, not a 500
            await stream_to_file(request, path, rt.settings.max_body_bytes, rt.registry.run,
                                 check=lambda received: check_dataset_size(stored + received, limit))
            header = await rt.registry.datasets.check_chunk(entry, path)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path, header


def described(rt: Runtime, info: DatasetInfo) -> dict:
    return {**info.to_json(), "on_device": info.dataset in rt.registry.datasets.resident(info.model)}


@router.post("/v2/models/{model}/datasets", dependencies=[Depends(require_key)], openapi_extra=BINARY_REQUEST_DOC)
async def create_dataset(model: str, request: Request, rt: Runtime = Depends(runtime)):
    """A new dataset from its first chunk: a safetensors body with ``x`` [rows, n_input_dims] and ``y``
    [rows, n_output_dims] (float32 or float16, finite); more chunks go to ``.../datasets/{id}/chunks``."""
    entry = rt.registry.get(model)
    path, header = await receive_chunk(rt, request, entry, 0)
    try:
        info = await rt.registry.datasets.add(entry, path, header)
    finally:
        path.unlink(missing_ok=True)  # gone already when it was moved into the dataset
    return json_response({"dataset": info.dataset, "rows": info.rows, "bytes": info.bytes})


@router.post("/v2/models/{model}/datasets/{dataset}/chunks", dependencies=[Depends(require_key)],
             openapi_extra=BINARY_REQUEST_DOC)
async def append_chunk(model: str, dataset: str, request: Request, rt: Runtime = Depends(runtime)):
    """The dataset's next chunk: the same tensors, types and columns as its first chunk."""
    entry = rt.registry.get(model)
    check_dataset_id(dataset)
    before = await rt.registry.datasets.info(model, dataset)  # 404 before the body is read
    path, header = await receive_chunk(rt, request, entry, before.bytes)
    try:
        info = await rt.registry.datasets.append(entry, dataset, path, header)  # a held copy is dropped
    finally:
        path.unlink(missing_ok=True)
    return json_response({"dataset": dataset, "rows": info.rows, "bytes": info.bytes, "chunks": len(info.chunks)})


@router.get("/v2/models/{model}/datasets")
async def list_datasets(model: str, rt: Runtime = Depends(runtime)):
    """The model's datasets, and the limits an upload must keep (bytes of a chunk, of a dataset)."""
    rt.registry.get(model)
    infos = await rt.registry.datasets.listed(model)
    return json_response({"datasets": [described(rt, i) for i in infos],
                          "max_chunk_bytes": rt.settings.max_body_bytes,
                          "max_dataset_bytes": rt.settings.max_dataset_bytes})


@router.get("/v2/models/{model}/datasets/{dataset}")
async def get_dataset(model: str, dataset: str, rt: Runtime = Depends(runtime)):
    rt.registry.get(model)
    check_dataset_id(dataset)
    return json_response(described(rt, await rt.registry.datasets.info(model, dataset)))


@router.delete("/v2/models/{model}/datasets/{dataset}", dependencies=[Depends(require_key)])
async def delete_dataset(model: str, dataset: str, rt: Runtime = Depends(runtime)):
    """Delete the dataset and drop the copy its model's backend holds. A running job that trains
    from it keeps the copy it holds until it ends (its memory is freed then)."""
    rt.registry.get(model)
    check_dataset_id(dataset)
    await rt.registry.datasets.delete(model, dataset)
    return json_response({"model_name": model, "dataset": dataset, "deleted": True})
