"""A training job's loss curve in bounded memory, from its first step to its latest.

A point is ``(step, loss)``: ``loss`` is the mean of the per-step losses of the steps after the
previous point up to ``step``. Points are added per chunk of steps (``add``). When the history
is full, neighbouring points are merged in pairs (the mean weighted by their step counts, at the
later step) and from then on a point gathers twice as many chunks before the next one starts, so
the points stay evenly spread over the whole run however long it is. The first point is never
merged, so the curve always starts at the job's first step; the last point always ends at the
latest step added. A non-finite loss makes its point's loss non-finite (given as ``None``): a
curve never hides that a loss was NaN or Inf by averaging it away.

Storage is three preallocated NumPy arrays (``capacity`` × 24 bytes, 24 KiB at the default), so
every job the daemon keeps costs the same whatever its length, and adding a chunk is a few
scalar writes (a merge, once every ``capacity / 2`` points, is one vectorised pass).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

DEFAULT_CAPACITY = 1024


class LossHistory:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 4 or capacity % 2:
            raise ValueError(f"a loss history's capacity must be even and at least 4, not {capacity}")
        self.capacity = capacity
        self._step = np.zeros(capacity, np.int64)
        self._sum = np.zeros(capacity, np.float64)  # of the per-step losses the point stands for
        self._count = np.zeros(capacity, np.int64)  # steps the point stands for
        self._n = 0
        self._chunks_per_point = 1
        self._last_chunks = 0  # chunks gathered by the last point

    def __len__(self) -> int:
        return self._n

    def add(self, step: int, losses: Sequence[float] | np.ndarray) -> None:
        """The per-step losses of the steps after the previous ``add`` up to ``step``."""
        count = len(losses)
        if count == 0:
            return
        with np.errstate(invalid="ignore", over="ignore"):  # Inf - Inf is NaN: the point says so
            total = float(np.sum(losses, dtype=np.float64))
        n = self._n
        if n > 1 and self._last_chunks < self._chunks_per_point:  # the last point still gathers
            i = n - 1
            self._step[i] = step
            with np.errstate(invalid="ignore", over="ignore"):
                self._sum[i] += total
            self._count[i] += count
            self._last_chunks += 1
            return
        if n == self.capacity:
            self._merge()
            self.add(step, losses)  # the last point now gathers
            return
        self._step[n], self._sum[n], self._count[n] = step, total, count
        self._n = n + 1
        self._last_chunks = 1

    def _merge(self) -> None:
        """Full: the first point stays, the points between it and the last merge in pairs, and the
        last point (a full one at the old rate: half of one at the new) gathers on."""
        cap = self.capacity
        pairs = (cap - 2) // 2
        steps = self._step[2:cap - 1:2].copy()  # the later step of each pair
        with np.errstate(invalid="ignore", over="ignore"):
            sums = self._sum[1:cap - 1].reshape(pairs, 2).sum(1)
        counts = self._count[1:cap - 1].reshape(pairs, 2).sum(1)
        last = self._step[cap - 1], self._sum[cap - 1], self._count[cap - 1]
        self._step[1:pairs + 1], self._sum[1:pairs + 1], self._count[1:pairs + 1] = steps, sums, counts
        self._step[pairs + 1], self._sum[pairs + 1], self._count[pairs + 1] = last
        self._n = pairs + 2
        self._chunks_per_point *= 2

    def points(self) -> list[list[int | float | None]]:
        """``[[step, loss], ...]`` in step order; ``loss`` is None where it was not finite."""
        n = self._n
        means = self._sum[:n] / self._count[:n]
        return [[step, loss if math.isfinite(loss) else None]
                for step, loss in zip(self._step[:n].tolist(), means.tolist())]
