"""Host buffers of tensor bodies: page-locked where the backend copies to a GPU.

A request body read off the socket and a response body the forward writes into are the host
ends of the device copies. Where they lie in page-locked memory the cuda backend copies them
straight to and from the device (``CudaModel.forward_to_host``: 0.33 ms for 65,536 FP16 rows of
model M each way on an H100, against 1.45 ms through page-locked staging and 2.2 ms through the
driver's pageable copies). Allocating page-locked memory is slow
(``cudaHostAlloc``), so :class:`PinnedPool` keeps freed buffers by size class (eight classes an
octave: at most 1/8 wasted) up to a byte budget, and hands out each buffer as an array over its
own small buffer object, whose collection — once no view of the body is left anywhere (the
parsed tensors, the response the transport still sends) — puts the buffer back. Beyond the
budget, or where the backend has no page-locked memory, bodies are plain NumPy memory.

``empty(nbytes)`` is what the body and response code call; the daemon installs the pool of
its backend at start (:func:`install`) and removes it at exit.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from typing import Callable

import numpy as np

log = logging.getLogger("mmad.engine.hostmem")

MIN_POOLED_BYTES = 1 << 16  # below this a body costs no copy worth avoiding; plain memory


class PinnedPool:
    """Page-locked buffers from ``alloc(nbytes) -> uint8 array``, reused by size class, at most
    ``budget_bytes`` of them held (handed out or free)."""

    def __init__(self, alloc: Callable[[int], np.ndarray], budget_bytes: int):
        self._alloc = alloc
        self.budget_bytes = budget_bytes
        self.held_bytes = 0
        self.over_budget = 0  # bodies given plain memory because the budget was spent
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()
        self._failed = False

    @staticmethod
    def size_class(nbytes: int) -> int:
        """``nbytes`` rounded up to one of eight steps an octave."""
        granule = 1 << max(0, nbytes.bit_length() - 4)
        return -(-nbytes // granule) * granule

    def empty(self, nbytes: int) -> np.ndarray:
        """An uninitialised uint8 array of ``nbytes``, page-locked when the pool can."""
        if nbytes < MIN_POOLED_BYTES or self._failed:
            return np.empty(nbytes, dtype=np.uint8)
        size = self.size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            base = free.pop() if free else None
            if base is None:
                if self.held_bytes + size > self.budget_bytes:
                    self.over_budget += 1
                    return np.empty(nbytes, dtype=np.uint8)
                self.held_bytes += size  # reserved before the slow allocation, outside the lock
        if base is None:
            try:
                base = self._alloc(size)
            except Exception as exc:  # noqa: BLE001 - out of page-locked memory, a driver refusal
                with self._lock:
                    self.held_bytes -= size
                    self._failed = True
                log.warning("page-locked body buffers are off: allocating %d bytes failed (%s); bodies use "
                            "ordinary memory (device copies go through staging)", size, exc)
                return np.empty(nbytes, dtype=np.uint8)
        # a buffer object of its own per body: every view of the body keeps it alive, and its
        # collection (no view left) returns the page-locked memory to the pool
        owner = (ctypes.c_uint8 * nbytes).from_address(base.ctypes.data)
        weakref.finalize(owner, self._release, size, base)
        return np.frombuffer(owner, dtype=np.uint8)

    def _release(self, size: int, base: np.ndarray) -> None:
        with self._lock:
            self._free.setdefault(size, []).append(base)


_pool: PinnedPool | None = None


def install(pool: PinnedPool | None) -> None:
    """Use ``pool`` for the bodies of this process (None: plain memory)."""
    global _pool
    _pool = pool


def empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array for a tensor body (page-locked where a pool is installed)."""
    pool = _pool
    return np.empty(nbytes, dtype=np.uint8) if pool is None else pool.empty(nbytes)
