"""Data-parallel training: one model's replicas on several devices, each training on its shard.

A data-parallel run splits the dataset into contiguous shards (``shard_bounds``), one per
replica, and each optimizer batch into per-replica parts (``split_batch``) that add up to the
batch a single device would train on. Each replica draws its part of every batch from its own
shard in the epoch order of its own :class:`~mmad.backends.numerics.EpochPosition` (seed
``shard_seed(seed, rank)``), computes the gradient of the *global* batch's mean loss over its
rows, and the replicas' gradients are summed: every replica then takes the same optimizer step
on the same sum, so their weights stay identical, step for step.

:class:`DataParallel` is the interface; :class:`HostDataParallel` (the default of
``Backend.data_parallel``) sums on the host through ``loss_and_grads`` and ``apply_gradients``,
which suits host backends (the cpu backend's virtual devices) and is the reference the device
implementation (``mmad.backends.cuda.parallel``, NCCL all-reduce) is checked against.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import numpy as np

from mmad.backends.numerics import EpochPosition, check_epoch_run, epoch_rows, mix32
from mmad.errors import InvalidInput

if TYPE_CHECKING:  # annotations only: the contract's default trainer is this module's
    from mmad.backends.contract import CompiledModel, Dataset


def shard_bounds(rows: int, shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) row ranges of ``shards`` shards, sizes differing by at most one."""
    return [(rows * r // shards, rows * (r + 1) // shards) for r in range(shards)]


def split_batch(batch: int, shards: int) -> list[int]:
    """Each replica's part of a ``batch``-row optimizer batch (sizes differing by at most one)."""
    return [stop - start for start, stop in shard_bounds(batch, shards)]


def shard_seed(seed: int, rank: int) -> int:
    """The epoch-order seed of shard ``rank``: rank 0 keeps the job's seed, so a one-device run
    draws the order a single-replica job draws."""
    return seed if rank == 0 else int(mix32(np.uint32((seed + 0x9E3779B9 * rank) & 0xFFFFFFFF)))


def shard_positions(seed: int, shards: int) -> list[EpochPosition]:
    return [EpochPosition(shard_seed(seed, r)) for r in range(shards)]


def shard_chunks(chunks: Iterable[tuple[Any, Any]], start: int, stop: int) -> Iterator[tuple[Any, Any]]:
    """The rows [start, stop) of a dataset arriving as (x, y) chunks, as (x, y) chunks."""
    at = 0
    for cx, cy in chunks:
        n = np.shape(cx)[0]
        lo, hi = max(start, at), min(stop, at + n)
        if lo < hi:
            yield cx[lo - at:hi - at], cy[lo - at:hi - at]
        at += n
        if at >= stop:
            return


def check_parallel_run(shards: list[Dataset], batches: list[int], steps: int,
                       positions: list[EpochPosition]) -> None:
    if not len(shards) == len(batches) == len(positions) or not shards:
        raise InvalidInput("a data-parallel run needs one shard, batch part and position per replica")
    for data, batch in zip(shards, batches):
        check_epoch_run(data, batch, steps)


class DataParallel(abc.ABC):
    """Data-parallel training over ``replicas`` (one per device; identical weights and
    optimizer state on entry, kept identical)."""

    def __init__(self, replicas: list[CompiledModel]):
        if len(replicas) < 2:
            raise InvalidInput("data-parallel training needs replicas on at least two devices")
        devices = [r.device_index for r in replicas]
        if len(set(devices)) != len(devices):
            raise InvalidInput(f"data-parallel replicas must be on different devices; got devices {devices}")
        self.replicas = replicas

    @abc.abstractmethod
    def train_epochs(self, shards: list[Dataset], batches: list[int], steps: int,
                     positions: list[EpochPosition]) -> np.ndarray:
        """``steps`` optimizer steps; replica r trains on ``batches[r]`` rows a step drawn from
        ``shards[r]`` in the order of ``positions[r]`` (advanced). Returns each step's loss over
        the whole batch (the mean over every replica's rows)."""

    def close(self) -> None:
        """Release what the trainer opened (communicators); the replicas stay."""


class HostDataParallel(DataParallel):
    """The replicas' gradients summed on the host (float64), the same step applied on each."""

    def train_epochs(self, shards: list[Dataset], batches: list[int], steps: int,
                     positions: list[EpochPosition]) -> np.ndarray:
        check_parallel_run(shards, batches, steps, positions)
        total = sum(batches)
        losses = np.empty(steps, dtype=np.float32)
        for s in range(steps):
            loss_sum, summed = 0.0, None
            for model, data, batch, position in zip(self.replicas, shards, batches, positions):
                rows = epoch_rows(position.seed, position.epoch, data.rows, position.cursor, batch)
                loss, grads = model.loss_and_grads(model.take_rows(data.x, rows), model.take_rows(data.y, rows))
                weight = batch / total  # each replica's mean over its rows -> the mean over the batch
                loss_sum += loss * weight
                if summed is None:
                    summed = {k: g.astype(np.float64) * weight for k, g in grads.items()}
                else:
                    for k, g in grads.items():
                        summed[k] += g.astype(np.float64) * weight
                position.advance(data.rows, batch)
            step_grads = {k: v.astype(np.float32) for k, v in summed.items()}
            for model in self.replicas:
                model.apply_gradients(step_grads)
            losses[s] = loss_sum
        return losses
