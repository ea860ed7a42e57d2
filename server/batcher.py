"""Dynamic batching: concurrent infer requests to one model merged into one launch.

Requests wait in a bounded queue. A single worker per model takes the oldest request, keeps
collecting until ``max_batch_rows`` rows are gathered or the oldest has waited
``max_queue_delay_us``, runs the concatenation once (in the compute thread pool, never on the
event loop) and hands every request its own slice of the output. A request larger than
``max_batch_rows`` runs alone (batch size is never restricted). A full queue refuses new work
with :class:`~mmad.errors.Overloaded` (HTTP 503 with Retry-After).
"""

from __future__ import annotations

import asyncio
import collections
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable

import numpy as np

from mmad.errors import Overloaded


@dataclass(frozen=True)
class BatchLimits:
    max_batch_rows: int
    max_queue_delay_us: int
    max_queue_requests: int


@dataclass
class BatchResult:
    """One request's output and what its batch cost."""

    output: np.ndarray
    queue_ns: int
    compute_ns: int
    batch_rows: int
    batch_requests: int


@dataclass
class _Pending:
    x: np.ndarray
    future: asyncio.Future
    enqueued_ns: int


class Batcher:
    """Merges requests for one model; ``run(x)`` is the blocking forward on the whole batch."""

    def __init__(self, name: str, run: Callable[[np.ndarray], np.ndarray], executor: Executor,
                 limits: BatchLimits, on_batch: Callable[[int, int, int], None] | None = None):
        self.name = name
        self.limits = limits
        self._run = run
        self._executor = executor
        self._on_batch = on_batch  # (rows, requests, compute_ns), for statistics and metrics
        self._pending: collections.deque[_Pending] = collections.deque()
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False

    @property
    def queued(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._worker(), name=f"batcher:{self.name}")

    async def stop(self) -> None:
        """Run what is queued (without waiting for more), then stop; later submits get 503."""
        self._stopping = True
        self._arrived.set()
        if self._task is not None:
            await self._task
            self._task = None
        while self._pending:
            item = self._pending.popleft()
            if not item.future.done():
                item.future.set_exception(Overloaded(f"model {self.name!r} is being unloaded"))

    async def submit(self, x: np.ndarray) -> BatchResult:
        if self._stopping:
            raise Overloaded(f"model {self.name!r} is being unloaded")
        if len(self._pending) >= self.limits.max_queue_requests:
            raise Overloaded(f"the queue of model {self.name!r} is full "
                             f"({self.limits.max_queue_requests} requests waiting); retry later",
                             retry_after_s=1.0)
        if self._task is None:
            self.start()
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(x, future, time.perf_counter_ns()))
        self._arrived.set()
        return await future

    def _take_batch(self) -> list[_Pending]:
        batch, rows = [], 0
        while self._pending:
            item = self._pending[0]
            if item.future.done():  # the client went away
                self._pending.popleft()
                continue
            if batch and rows + item.x.shape[0] > self.limits.max_batch_rows:
                break
            batch.append(self._pending.popleft())
            rows += item.x.shape[0]
        return batch

    async def _gather(self) -> None:
        """Wait until a full batch is queued or the oldest request's delay has passed."""
        delay_ns = self.limits.max_queue_delay_us * 1000
        while self._pending and not self._stopping:
            rows = sum(p.x.shape[0] for p in self._pending)
            left_ns = self._pending[0].enqueued_ns + delay_ns - time.perf_counter_ns()
            if rows >= self.limits.max_batch_rows or left_ns <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left_ns / 1e9)
            except asyncio.TimeoutError:
                return

    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                if self._stopping:
                    return
                self._arrived.clear()
                await self._arrived.wait()
                continue
            await self._gather()
            batch = self._take_batch()
            if not batch:
                continue
            start_ns = time.perf_counter_ns()
            x = batch[0].x if len(batch) == 1 else np.concatenate([p.x for p in batch])
            try:
                out = await loop.run_in_executor(self._executor, self._run, x)
            except Exception as exc:  # every request of the batch gets the error
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            compute_ns = time.perf_counter_ns() - start_ns
            if self._on_batch is not None:
                self._on_batch(x.shape[0], len(batch), compute_ns)
            offset = 0
            for p in batch:
                rows = p.x.shape[0]
                if not p.future.done():
                    p.future.set_result(BatchResult(out[offset:offset + rows], start_ns - p.enqueued_ns,
                                                    compute_ns, x.shape[0], len(batch)))
                offset += rows
