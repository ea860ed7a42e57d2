"""Training requests the engine runs: optimizer steps on the live model in time slices, the
model's weights of before the request snapshotted and put back when a slice diverges."""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable

import numpy as np

from mmad.engine.registry import ModelEntry
from mmad.engine.runtime import Runtime
from mmad.errors import Diverged

SLICE_S = 0.05

log = logging.getLogger("mmad.engine.training")


async def train_in_slices(rt: Runtime, entry: ModelEntry, x: np.ndarray, y: np.ndarray, steps: int,
                          disconnected: Callable[[], Awaitable[bool]]) -> tuple[list[np.ndarray], int, bool]:
    """``steps`` optimizer steps on ``x``/``y`` in slices of ~``SLICE_S`` (between slices other
    work gets the threads and the model's lock, and ``disconnected()``, the client gone away,
    stops it): (losses per slice, the model's step count, whether the client went away first).

    A diverged slice is undone by ``train_live``; the request's earlier slices are undone too
    unless other training interleaved (undoing those would lose someone else's steps).
    """
    losses: list[np.ndarray] = []
    done, step, per_step_s = 0, 0, None
    snapshot = await rt.registry.run_training(rt.registry.snapshot_blocking, entry) if steps > 1 else None
    while done < steps:
        n = 1 if per_step_s is None else int(SLICE_S / max(per_step_s, 1e-7))
        n = max(1, min(n, steps - done))
        started = time.perf_counter()
        try:
            out, step = await rt.registry.run_training(entry.train_live, x, y, n, done, steps)
        except Diverged as exc:
            if done == 0:
                raise Diverged(f"{exc}; the weights of before this request are kept") from None
            if await rt.registry.run_training(rt.registry.restore_blocking, entry, snapshot, snapshot[2] + done):
                raise Diverged(f"{exc}; the weights of before this request are kept") from None
            raise Diverged(f"{exc}; the weights of before step {done + 1} are kept (other training "
                           "interleaved with this request)") from None
        per_step_s = (time.perf_counter() - started) / n
        losses.append(out)
        done += n
        if done < steps and await disconnected():
            log.info("train on %s: the client went away after %d of %d steps; stopped", entry.name, done, steps)
            return losses, step, True
    return losses, step, False
