"""Training sets: uploaded chunks checked against the model, and the copies held by its backend.

A dataset lives in the store as chunk files (:mod:`mmad.engine.store`); an uploaded chunk is
checked here (:func:`check_chunk`: its header, the model's column counts, finite values, one
memory-mapped block at a time) before the store moves it into place.

:class:`DatasetCache` (``registry.datasets``) holds the datasets that training reads from the
backend's memory: ``await registry.datasets.on_device(entry, dataset_id)`` returns the
:class:`~mmad.backends.contract.Dataset` of the model's compiled model, copied in on first use
chunk by chunk (``CompiledModel.put_dataset``) after checking that it fits in the device's free
memory (507 otherwise, before allocating anything). A data-parallel job asks for ``shards``
instead: each replica of the model holds a contiguous part of the rows on its own device. One
copy per (model, incarnation, dataset, number of parts);
the copy of a model replaced, deleted or unloaded is dropped with it (``forget_model``), that of
a dataset appended to or deleted at once (``invalidate``). Dropping a copy drops the cache's
reference only: a training job that holds the Dataset keeps it (and its memory) until it ends,
so deleting a dataset a job trains from is safe, the job goes on with the copy it holds.

A backend that holds datasets in host memory (cpu: ``free_device_bytes`` is None, it cannot
tell what is free) holds at most ``--max-host-dataset-bytes`` of them at once (default a quarter
of the host's memory): a new copy first drops the least recently used ones until it fits, and
one larger than the bound on its own is a 507 before anything is allocated. A job holding a
dropped copy keeps it until it ends; the next use copies it in again from the store.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterable, Awaitable, Callable

import numpy as np

from mmad.backends.contract import CompiledModel, Dataset
from mmad.backends.numerics import all_finite
from mmad.backends.parallel import shard_bounds, shard_chunks
from mmad.errors import ConflictError, DeviceMemoryFull, InvalidInput, ModelNotReady, PayloadTooLarge
from mmad.engine.store import (
    ChunkHeader, DatasetInfo, check_dataset_size, chunk_arrays, read_chunk_header, size_words, store_write,
)
from mmad.spec import MLPSpec

if TYPE_CHECKING:  # the registry creates the cache: no import cycle at run time
    from mmad.engine.registry import ModelEntry, Registry

log = logging.getLogger("mmad.engine.datasets")

FILE_WRITE_BYTES = 1 << 20  # what an arriving chunk gathers before one write on a compute thread
FINITE_BLOCK_VALUES = 1 << 22  # values checked at once (16 MiB of float32): the page cache does the rest


async def stream_to_file(pieces: AsyncIterable[bytes], path: Path, max_bytes: int,
                         run: Callable[..., Awaitable[Any]], check: Callable[[int], None] | None = None) -> int:
    """Write ``pieces`` into a new file ``path`` (flushed and fsynced), returns its size.

    The chunk never sits whole in memory: the pieces received are gathered up to
    ``FILE_WRITE_BYTES`` and written by ``run`` (a compute thread; disk writes stay off the event
    loop). Past ``max_bytes`` (``--max-body-bytes``) it stops with a 413; ``check(bytes so far)``
    may refuse earlier (another limit). The caller removes the file when anything fails.
    """
    f = await run(open, path, "xb")
    total, pending, held = 0, [], 0
    try:
        async for piece in pieces:
            if not piece:
                continue
            total += len(piece)
            if total > max_bytes:
                raise PayloadTooLarge(f"the chunk exceeds the limit of {max_bytes} bytes (--max-body-bytes)")
            if check is not None:
                check(total)
            pending.append(piece)
            held += len(piece)
            if held >= FILE_WRITE_BYTES:
                await run(f.writelines, pending)
                pending, held = [], 0
        if pending:
            await run(f.writelines, pending)
        await run(_flush_and_sync, f)
    finally:
        f.close()
    return total


def _flush_and_sync(f) -> None:
    f.flush()
    os.fsync(f.fileno())


def check_chunk(spec: MLPSpec, path: Path) -> ChunkHeader:
    """A received chunk's header, checked against the model: x [rows, n_input_dims] and y [rows,
    n_output_dims], float32 or float16, every value finite (400 in the user's words otherwise)."""
    header = read_chunk_header(path)
    for name, cols, want, dims in (("x", header.x_cols, spec.n_input_dims, "n_input_dims"),
                                   ("y", header.y_cols, spec.n_output_dims, "n_output_dims")):
        if cols != want:
            raise InvalidInput(f"dataset {name} must have {want} columns (the model's {dims}); this chunk's "
                               f"{name} has {cols}")
    x, y = chunk_arrays(path, header)
    for name, array in (("x", x), ("y", y)):
        step = max(1, FINITE_BLOCK_VALUES // max(1, array.shape[1]))
        for start in range(0, array.shape[0], step):
            block = array[start:start + step]
            if not all_finite(block):
                row = start + int(np.flatnonzero(~np.isfinite(block).all(axis=1))[0])
                raise InvalidInput(f"dataset {name} holds NaN or Inf (row {row} of this chunk)")
    return header


@dataclass
class _Held:
    compiled: tuple[CompiledModel, ...]  # the models the copies were made for: others (reloaded) make their own
    data: list[Dataset]  # one per replica: the whole dataset, or its shards (data-parallel)


def host_memory_bytes() -> int | None:
    """This host's physical memory, where the OS tells."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


class DatasetCache:
    """The datasets held by the backends of the registry's models; see the module docstring."""

    def __init__(self, registry: "Registry"):
        self.registry = registry
        limit = registry.settings.max_host_dataset_bytes
        if limit is None:
            memory = host_memory_bytes()
            limit = memory // 4 if memory else None
        self.host_limit = limit  # bytes of host-memory copies held at once (None: unbounded)
        # least recently used first: a new host copy drops from the front
        self._held: collections.OrderedDict[tuple[str, str | None, str, int], _Held] = collections.OrderedDict()
        self._building: dict[tuple[str, str | None, str, int], asyncio.Lock] = {}
        # bumped by every invalidation: a copy built across one is handed out but not kept
        self._generation: dict[tuple[str, str], int] = {}

    # -- the store's datasets, on a compute thread --------------------------------------------
    async def receive(self, entry: "ModelEntry", chunk: AsyncIterable[bytes], declared: int | None,
                      stored: int) -> tuple[Path, ChunkHeader]:
        """An arriving chunk of ``entry``'s model as a checked file of the store's incoming
        directory (the caller moves or removes it). ``declared``: the size its sender announced,
        ``stored``: the bytes the dataset holds already; the dataset limit refuses the chunk
        from the first (before a byte is read), while it streams and when it is added."""
        settings = self.registry.settings
        limit = settings.max_dataset_bytes
        if declared is not None:
            check_dataset_size(stored + declared, limit)
        path = await self.registry.run(self.registry.store.incoming_path)
        try:
            with store_write(f"the dataset chunk for model {entry.name!r}"):  # a full disk is a 507, not a 500
                await stream_to_file(chunk, path, settings.max_body_bytes, self.registry.run,
                                     check=lambda received: check_dataset_size(stored + received, limit))
                header = await self.registry.run(check_chunk, entry.spec, path)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return path, header

    async def add(self, entry: "ModelEntry", chunk: AsyncIterable[bytes], declared: int | None) -> DatasetInfo:
        """A new dataset of ``entry``'s model from its first chunk."""
        registry = self.registry
        path, header = await self.receive(entry, chunk, declared, 0)
        try:
            return await registry.run(registry.store.add_dataset, entry.name, path, header,
                                      registry.settings.max_dataset_bytes, entry.incarnation)
        finally:
            path.unlink(missing_ok=True)  # gone already when it was moved into the dataset

    async def append(self, entry: "ModelEntry", dataset_id: str, chunk: AsyncIterable[bytes],
                     declared: int | None) -> DatasetInfo:
        """The dataset's next chunk; a held copy, which lacks its rows, is dropped."""
        registry = self.registry
        before = await self.info(entry.name, dataset_id)  # unknown: refused before the chunk is read
        path, header = await self.receive(entry, chunk, declared, before.bytes)
        try:
            info = await registry.run(registry.store.append_dataset_chunk, entry.name, dataset_id, path, header,
                                      registry.settings.max_dataset_bytes, entry.incarnation)
        finally:
            path.unlink(missing_ok=True)
        self.invalidate(entry.name, dataset_id)
        return info

    async def info(self, model: str, dataset_id: str) -> DatasetInfo:
        return await self.registry.run(self.registry.store.dataset_info, model, dataset_id)

    async def listed(self, model: str) -> list[DatasetInfo]:
        return await self.registry.run(self.registry.store.list_datasets, model)

    async def delete(self, model: str, dataset_id: str) -> None:
        """Delete the dataset and drop the copy its model's backend holds."""
        await self.registry.run(self.registry.store.delete_dataset, model, dataset_id)
        self.invalidate(model, dataset_id)

    async def on_device(self, entry: "ModelEntry", dataset_id: str) -> Dataset:
        """The dataset held by ``entry``'s live (primary) compiled model, copied in on first use."""
        return (await self._hold(entry, dataset_id, 1))[0]

    async def shards(self, entry: "ModelEntry", dataset_id: str) -> list[Dataset]:
        """The dataset split over ``entry``'s replicas for data-parallel training: replica r holds
        the rows ``shard_bounds(rows, replicas)[r]``, on its device."""
        return await self._hold(entry, dataset_id, len(entry.replicas))

    async def _hold(self, entry: "ModelEntry", dataset_id: str, parts: int) -> list[Dataset]:
        """The dataset held by the first ``parts`` replicas of ``entry`` (whole for one, in shards
        for several), copied in on first use.

        Concurrent first uses build it once. Before allocating: ``dataset_bytes`` of each part's
        rows and dtypes (read from the chunk headers) against its device's ``free_device_bytes``
        (skipped when the backend cannot tell); too little is a 507 naming both. ``put_dataset``
        then reads the chunks one at a time (memory maps) on a compute thread; it does not hold the
        model's lock, so inference goes on meanwhile (it allocates new buffers and never touches
        the weights).
        """
        compiled = tuple(r.model for r in entry.replicas[:parts])
        if len(compiled) < parts or any(m is None for m in compiled):
            raise ModelNotReady(entry.name)
        key = (entry.name, entry.incarnation, dataset_id, parts)
        held = self._held.get(key)
        if held is not None and held.compiled == compiled:
            self._held.move_to_end(key)
            return held.data
        lock = self._building.setdefault(key, asyncio.Lock())
        async with lock:
            held = self._held.get(key)
            if held is not None and held.compiled == compiled:
                self._held.move_to_end(key)
                return held.data
            generation = self._generation.get((entry.name, dataset_id), 0)
            run = self.registry.run
            info = await run(self.registry.store.dataset_info, entry.name, dataset_id)
            bounds = shard_bounds(info.rows, parts)
            host_need = 0
            for model, (start, stop) in zip(compiled, bounds):
                if stop == start:
                    raise InvalidInput(f"dataset {dataset_id!r} has {info.rows} rows: too few to split over the "
                                       f"{parts} replicas of model {entry.name!r}")
                need = model.dataset_bytes(stop - start, info.x_dtype, info.y_dtype)
                free = await run(model.free_device_bytes)
                if free is None:  # held in host memory: bounded by host_limit below
                    host_need += need
                elif need > free:
                    where = f"device {model.device_index} of " if parts > 1 else ""
                    raise DeviceMemoryFull(
                        f"the dataset{' shard' if parts > 1 else ''} needs {size_words(need)} on {where}"
                        f"{self.registry.backend_label}'s device; {size_words(free)} is free (dataset {dataset_id!r} "
                        f"of model {entry.name!r}, {stop - start} rows); free memory (unload models, or finish other "
                        "jobs) or train from a smaller dataset")
            if host_need:
                self._make_host_room(host_need, entry.name, dataset_id)
            changed = ConflictError(f"model {entry.name!r} was unloaded or replaced while dataset {dataset_id!r} "
                                    "was being copied to its device; try again")

            def still_served() -> bool:
                return (tuple(r.model for r in entry.replicas[:parts]) == compiled
                        and self.registry.models.get(entry.name) is entry)

            data = []
            for model, (start, stop) in zip(compiled, bounds):
                chunks = self.registry.store.dataset_chunks(info)
                if parts > 1:
                    chunks = shard_chunks(chunks, start, stop)
                try:
                    data.append(await run(model.put_dataset, chunks, stop - start, info.x_dtype, info.y_dtype))
                except Exception:
                    if not still_served():  # closed under the copy: that is what went wrong
                        raise changed from None
                    raise
            if not still_served():
                raise changed
            if self._generation.get((entry.name, dataset_id), 0) == generation:
                self._held[key] = _Held(compiled, data)
                self._held.move_to_end(key)
                if host_need:  # copies built meanwhile for other datasets may have taken the room
                    self._make_host_room(0, entry.name, dataset_id, keep=key)
                self._update_metric(entry.name)
            # else: appended to or deleted meanwhile; the caller gets the dataset as it was read
            log.info("dataset %s of model %s held for training: %d rows, %s (%s%s)", dataset_id, entry.name,
                     info.rows, size_words(sum(d.nbytes for d in data)),
                     "on the device" if data[0].on_device else "in host memory",
                     f", in {parts} shards on devices {[m.device_index for m in compiled]}" if parts > 1 else "")
            return data

    def host_bytes(self) -> int:
        """Bytes of the copies held in host memory, every model's."""
        return sum(d.nbytes for h in self._held.values() for d in h.data if not d.on_device)

    def _make_host_room(self, need: int, model: str, dataset_id: str, keep: tuple | None = None) -> None:
        """Drop the least recently used host copies (never ``keep``) until ``need`` more bytes fit
        under ``host_limit``; a need larger than the limit itself is a 507."""
        limit = self.host_limit
        if limit is None:
            return
        if need > limit:
            raise DeviceMemoryFull(
                f"dataset {dataset_id!r} of model {model!r} needs {size_words(need)} of host memory to train from; "
                f"this daemon holds at most {size_words(limit)} of datasets in host memory (--max-host-dataset-bytes)"
                "; raise it or train from a smaller dataset")
        for key in list(self._held):
            if self.host_bytes() + need <= limit:
                return
            held = self._held[key]
            if key != keep and not any(d.on_device for d in held.data):
                del self._held[key]
                log.info("dataset %s of model %s no longer held in host memory (least recently used; "
                         "--max-host-dataset-bytes %d)", key[2], key[0], limit)
                self._update_metric(key[0])

    def resident(self, model: str) -> list[str]:
        """Ids of the model's datasets held now."""
        return sorted({key[2] for key in self._held if key[0] == model})

    def resident_bytes(self, model: str) -> int:
        return sum(d.nbytes for key, h in self._held.items() if key[0] == model for d in h.data)

    def invalidate(self, model: str, dataset_id: str) -> None:
        """Drop the copy of a dataset that changed (a chunk appended) or went (deleted)."""
        gen_key = (model, dataset_id)
        self._generation[gen_key] = self._generation.get(gen_key, 0) + 1
        for key in [k for k in self._held if k[0] == model and k[2] == dataset_id]:
            del self._held[key]
        for key in [k for k, lock in self._building.items() if k[0] == model and k[2] == dataset_id
                    and not lock.locked()]:
            del self._building[key]
        self._update_metric(model)

    def forget_model(self, model: str) -> None:
        """Drop every copy of a model's datasets (it is being closed: deleted, replaced, unloaded;
        a copy being built meanwhile is not kept: ``on_device`` sees the live model change)."""
        for key in [k for k in self._held if k[0] == model]:
            del self._held[key]
        for key in [k for k, lock in self._building.items() if k[0] == model and not lock.locked()]:
            del self._building[key]
        self._update_metric(model)

    def clear(self) -> None:
        """Drop every copy (the registry is closing)."""
        for model in {k[0] for k in self._held}:
            self.forget_model(model)
        self._held.clear()

    def _update_metric(self, model: str) -> None:
        self.registry.metrics.dataset_bytes.labels(model, self.registry.backend_label).set(self.resident_bytes(model))
