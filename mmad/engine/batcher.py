"""Dynamic batching: concurrent infer requests to one model merged into one launch.

Requests wait in a bounded queue. A single worker per model takes the oldest request, keeps
collecting until ``max_batch_rows`` rows are gathered or the oldest has waited
``max_queue_delay_us``, runs the concatenation once (in the compute thread pool, never on the
event loop) and hands every request its own slice of the output. A request larger than
``max_batch_rows`` runs alone (batch size is never restricted). A full queue refuses new work
with :class:`~mmad.errors.Overloaded` (HTTP 503 with Retry-After).

A request may ask for its rows to be checked finite (``submit(..., check_finite=True)``): the
forward checks the batch (on the device, on a GPU backend); when a merged batch holds NaN or
Inf, the requests whose rows hold them fail with :class:`~mmad.errors.NonFiniteInput` and the
others get their rows (a row's output depends on that row alone).

A request may bring its own output buffer (``submit(x, out)``, e.g. a view of its binary
response body): a request that runs alone is computed straight into it, so the forward's
output cast is its only pass over the data; in a merged batch its rows are copied there on
the compute thread.

Keeping the device busy: requests that arrive while a batch runs queue up; when it finishes,
the worker launches the next batch (due already: its oldest request waited through the run)
*before* it hands out the finished batch's results, so the compute thread works on batch n+1
while the event loop encodes and sends the responses of batch n. A model with replicas on
several devices runs up to one batch per replica at once (``concurrency``); the run callable
sends each to the least busy replica. Bookkeeping is O(1) per
request: queued rows are counted as they arrive, and one timer per batch replaces a wake-up
per arrival.
"""

from __future__ import annotations

import asyncio
import collections
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import numpy as np

from mmad.backends.numerics import all_finite
from mmad.engine.config import BatchLimits
from mmad.errors import NonFiniteInput, Overloaded
from mmad.engine import hostmem

TIMER_RESOLUTION_S = 1e-3  # event-loop timers round to milliseconds: a batch this close to due is due


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
    out: np.ndarray | None  # where the request wants its output rows, or None for a slice of the batch's
    check_finite: bool = False
    error: BaseException | None = None  # this request's own failure in a batch that ran


def _host_array(shape: tuple[int, int], dtype: Any) -> np.ndarray:
    """An uninitialised host array for a merged batch (page-locked where the backend copies to a
    GPU: :mod:`mmad.engine.hostmem`)."""
    dtype = np.dtype(dtype)
    return hostmem.empty(shape[0] * shape[1] * dtype.itemsize).view(dtype).reshape(shape)


def _concatenate(parts: list[np.ndarray]) -> np.ndarray:
    dtype = np.result_type(*parts)
    return np.concatenate(parts, out=_host_array((sum(p.shape[0] for p in parts), parts[0].shape[1]), dtype))


RemoteForward = Callable[[np.ndarray, np.ndarray, bool], Awaitable[None]]


class Batcher:
    """Merges requests for one model; ``run(x, out, check_finite)`` is the blocking forward of a
    batch into ``out`` (raising :class:`~mmad.errors.NonFiniteInput` when asked to check and
    the rows hold NaN or Inf), run on the compute threads. ``remote(x)``: the awaitable forward
    of the same signature that runs batch ``x`` in another process (a serving worker's small
    batches, run by the primary), or None for ``run``; it is awaited on the event loop, where a
    compute thread between would cost a thread hand-off a batch."""

    def __init__(self, name: str, run: Callable[[np.ndarray, np.ndarray, bool], None], out_cols: int,
                 executor: Executor, limits: BatchLimits, on_batch: Callable[[int, int, int], None] | None = None,
                 concurrency: int = 1, remote: Callable[[np.ndarray], RemoteForward | None] | None = None):
        self.name = name
        self._concurrency = concurrency  # batches run at once (one per replica of the model)
        self.limits = limits
        self._run = run
        self._remote = remote
        self._out_cols = out_cols
        self._executor = executor
        self._on_batch = on_batch  # (rows, requests, compute_ns), for statistics and metrics
        self._pending: collections.deque[_Pending] = collections.deque()
        self._pending_rows = 0
        self._wake = asyncio.Event()  # a first arrival, a full batch, the delay timer, or stop()
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
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        self._fail(list(self._pending), Overloaded(f"model {self.name!r} is being unloaded"))
        self._pending.clear()
        self._pending_rows = 0

    async def submit(self, x: np.ndarray, out: np.ndarray | None = None, check_finite: bool = False) -> BatchResult:
        """Queue ``x``; its result's ``output`` is ``out`` when given (filled), else float32 rows.
        ``check_finite``: fail with :class:`~mmad.errors.NonFiniteInput` if ``x`` holds NaN or Inf."""
        if self._stopping:
            raise Overloaded(f"model {self.name!r} is being unloaded")
        if len(self._pending) >= self.limits.max_queue_requests:
            raise Overloaded(f"the queue of model {self.name!r} is full "
                             f"({self.limits.max_queue_requests} requests waiting); retry later",
                             retry_after_s=1.0)
        if self._task is None:
            self.start()
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(x, future, time.perf_counter_ns(), out, check_finite))
        self._pending_rows += x.shape[0]
        if len(self._pending) == 1 or self._pending_rows >= self.limits.max_batch_rows:
            self._wake.set()
        return await future

    def _due_in(self) -> float:
        """Seconds until the queued requests should run (0: now)."""
        if self._stopping or self._pending_rows >= self.limits.max_batch_rows:
            return 0.0
        deadline_ns = self._pending[0].enqueued_ns + self.limits.max_queue_delay_us * 1000
        return max(0.0, (deadline_ns - time.perf_counter_ns()) / 1e9)

    async def _wait_until_due(self) -> None:
        """Wait for a first request, then until a full batch is queued or the oldest's delay passed.

        One timer, never re-armed: event loops round timers to milliseconds (uvloop rounds a
        sub-millisecond delay down to 0), so re-checking the clock after each wake-up would spin
        the loop. The delay is an upper bound; a batch may start a little before it.
        Returns with nothing queued only when stopping.
        """
        while not self._pending:
            if self._stopping:
                return
            self._wake.clear()
            await self._wake.wait()
        left = self._due_in()
        if left > 0:
            self._wake.clear()
            timer = asyncio.get_running_loop().call_later(left, self._wake.set)
            try:
                await self._wake.wait()
            finally:
                timer.cancel()

    def _take_batch(self) -> list[_Pending]:
        batch, rows = [], 0
        while self._pending:
            item = self._pending[0]
            if item.future.done():  # the client went away
                self._pending.popleft()
                self._pending_rows -= item.x.shape[0]
                continue
            if batch and rows + item.x.shape[0] > self.limits.max_batch_rows:
                break
            batch.append(self._pending.popleft())
            rows += item.x.shape[0]
        self._pending_rows -= rows
        return batch

    @staticmethod
    def _fail(batch: list[_Pending], exc: BaseException) -> None:
        for p in batch:
            if not p.future.done():
                p.future.set_exception(exc)

    def _launch(self, batch: list[_Pending]) -> tuple[list[_Pending], np.ndarray, int, asyncio.Future]:
        """Start a batch on the compute threads or, where ``remote`` takes it, in the process
        that runs it: (batch, input, start time, future of the output)."""
        x = batch[0].x if len(batch) == 1 else _concatenate([p.x for p in batch])
        start_ns = time.perf_counter_ns()
        remote = self._remote(x) if self._remote is not None else None
        if remote is not None:
            return batch, x, start_ns, asyncio.ensure_future(self._execute_remote(remote, batch, x))
        return batch, x, start_ns, asyncio.get_running_loop().run_in_executor(self._executor, self._execute, batch, x)

    def _output(self, batch: list[_Pending], x: np.ndarray) -> np.ndarray:
        """Where the batch's forward writes: the one request's own buffer, else a merged array."""
        if len(batch) == 1 and batch[0].out is not None:
            return batch[0].out
        return _host_array((x.shape[0], self._out_cols), np.float32)

    @staticmethod
    def _blame(batch: list[_Pending]) -> bool:
        """After a batch's forward found NaN or Inf: which requests brought them (they fail, the
        others' rows are computed again); False when none of several, or the only one, can be told."""
        if len(batch) == 1:
            return False
        for p in batch:
            if p.check_finite and not all_finite(p.x):
                p.error = NonFiniteInput()
        return any(p.error for p in batch)

    @staticmethod
    def _split(batch: list[_Pending], out: np.ndarray) -> None:
        """A merged batch's output rows into the buffers its requests gave."""
        if len(batch) == 1 and batch[0].out is out:
            return
        offset = 0
        for p in batch:
            rows = p.x.shape[0]
            if p.out is not None:
                np.copyto(p.out, out[offset:offset + rows], casting="same_kind")
            offset += rows

    def _execute(self, batch: list[_Pending], x: np.ndarray) -> np.ndarray:
        """On a compute thread: the forward of one batch, into its requests' buffers where they gave one."""
        out = self._output(batch, x)
        try:
            self._run(x, out, any(p.check_finite for p in batch))
        except NonFiniteInput:
            if not self._blame(batch):
                raise
            self._run(x, out, False)
        self._split(batch, out)
        return out

    async def _execute_remote(self, remote: RemoteForward, batch: list[_Pending], x: np.ndarray) -> np.ndarray:
        """:meth:`_execute` with the forward run by another process, awaited here."""
        out = self._output(batch, x)
        try:
            await remote(x, out, any(p.check_finite for p in batch))
        except NonFiniteInput:
            if not self._blame(batch):
                raise
            await remote(x, out, False)
        self._split(batch, out)
        return out

    async def _worker(self) -> None:
        running: dict[asyncio.Future, tuple[list[_Pending], np.ndarray, int, asyncio.Future]] = {}

        def launch_due(idle: bool) -> bool:
            """Start the queued batch if due (``idle``: nothing runs, so it was waited for)."""
            if len(running) >= self._concurrency or not self._pending:
                return False
            if not idle and self._due_in() > TIMER_RESOLUTION_S:
                return False
            batch = self._take_batch()
            if batch:
                started = self._launch(batch)
                running[started[3]] = started
            return bool(batch)

        try:
            while True:
                if not running:
                    await self._wait_until_due()
                    if not self._pending:  # stopping, and everything queued has run
                        return
                    launch_due(idle=True)
                    continue
                if launch_due(idle=False):
                    continue
                # wait for a batch to finish or, with a replica free, for the queue to fall due
                waiters: set[asyncio.Future] = set(running)
                wake, timeout = None, None
                if len(running) < self._concurrency:
                    self._wake.clear()
                    wake = asyncio.ensure_future(self._wake.wait())
                    waiters.add(wake)
                    timeout = self._due_in() if self._pending else None
                try:
                    done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if wake is not None and not wake.done():
                        wake.cancel()
                for future in done:
                    if future is not wake:
                        self._hand_out(running.pop(future), launch_due)
        except asyncio.CancelledError:  # the loop is going away: nobody will hand these out
            for batch, *_ in running.values():
                self._fail(batch, Overloaded(f"model {self.name!r} is being unloaded"))
            raise

    def _hand_out(self, finished: tuple[list[_Pending], np.ndarray, int, asyncio.Future],
                  launch_due: Callable[[bool], bool]) -> None:
        """Give a finished batch's requests their rows (or its error); the next due batch is
        launched first, so the device works on it while the event loop sends these responses."""
        batch, x, start_ns, future = finished
        try:
            out = future.result()
        except Exception as exc:  # every request of the batch gets the error
            self._fail(batch, exc)
            return
        compute_ns = time.perf_counter_ns() - start_ns
        launch_due(False)
        if self._on_batch is not None:
            self._on_batch(x.shape[0], len(batch), compute_ns)
        offset = 0
        for p in batch:
            rows = p.x.shape[0]
            if p.error is not None:
                if not p.future.done():
                    p.future.set_exception(p.error)
            elif not p.future.done():
                output = p.out if p.out is not None else out[offset:offset + rows]
                p.future.set_result(BatchResult(output, start_ns - p.enqueued_ns, compute_ns, x.shape[0], len(batch)))
            offset += rows
