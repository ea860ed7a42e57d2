"""A group of forwards between shared-memory regions in flight on one GPU: the CUDA side of the
primary's region forwards (:mod:`mmad.engine.region_forwards`), which reaches it through
:meth:`CudaBackend.region_group_slot <mmad.backends.cuda.CudaBackend.region_group_slot>`."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import numpy as np

STAGED_KEPT = 8  # a slot keeps the staging arrays of its groups' first forwards (system regions)
PINNED_MIN_BYTES = 16 << 10  # a page-locked buffer is at least this large (and grows when a batch needs more)


class CudaGroupSlot:
    """One group in flight on one device: its stream, its finiteness words on the device and in
    page-locked host memory, and the event that says the group's kernels and the words' copy
    are done.

    Each slot has a stream of its own, so one group's downloads run beside the next group's
    uploads (the copy engines of the two directions work at once; on one stream the PCIe link
    carried one direction at a time). The streams are blocking ones: ordered with the device's
    default stream, where training and the replicas' weight updates run, so a forward still
    sees the weights of before or after a whole optimizer step."""

    def __init__(self, cp, device: int, size: int):
        """``size``: the forwards of one group at most (a finiteness word each)."""
        self.cp = cp
        self.device = device
        with cp.cuda.Device(device):
            self.stream = cp.cuda.Stream(non_blocking=False)
            self.words = cp.zeros(size, dtype=cp.uint32)
            self.host = np.frombuffer(cp.cuda.alloc_pinned_memory(size * 4), np.uint32, size)
            self.event = cp.cuda.Event(disable_timing=True)
        self._staging: dict[tuple[str, int], Any] = {}  # (in|out, position in the group) -> device array
        self._pinned: dict[tuple[str, int], tuple[Any, int]] = {}  # (in|out, position) -> (memory, bytes)

    @contextlib.contextmanager
    def launching(self) -> Iterator[None]:
        """The group's device current and its stream the current stream, while it is launched."""
        with self.cp.cuda.Device(self.device), self.stream:
            yield

    def start(self) -> None:
        """Zero the words (on the slot's stream, as everything after: the runner launches the
        group inside ``with slot.launching()``)."""
        self.cp.cuda.runtime.memsetAsync(self.words.data.ptr, 0, self.words.nbytes, self.stream.ptr)

    def _staged(self, side: str, k: int, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """The device array of the group's ``k``-th forward's input or output: kept by the slot
        for the next group of the same shapes (clients send the same sizes again and again, and
        a pool allocation costs the launching thread more than the lookup)."""
        key = (side, k)
        array = self._staging.get(key)
        if array is None or array.shape != shape or array.dtype != dtype:
            array = self.cp.empty(shape, dtype=dtype)
            if k < STAGED_KEPT:
                self._staging[key] = array
        return array

    def pinned(self, side: str, k: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A page-locked host array for the group's ``k``-th forward's input or output rows (a
        worker's batch sent over its socket: copied here so that the copies to and from the
        device are asynchronous), kept by the slot, grown when a batch needs more."""
        dtype, count = np.dtype(dtype), math.prod(shape)
        nbytes = count * dtype.itemsize
        memory, capacity = self._pinned.get((side, k), (None, 0))
        if capacity < nbytes:
            capacity = max(nbytes, PINNED_MIN_BYTES)
            with self.cp.cuda.Device(self.device):
                memory = self.cp.cuda.alloc_pinned_memory(capacity)
            self._pinned[(side, k)] = (memory, capacity)
        return np.frombuffer(memory, dtype, count).reshape(shape)

    def upload(self, k: int, host: np.ndarray) -> Any:
        """A device copy of the host array (the group's ``k``-th input, a system region's rows),
        queued: asynchronous from the primary's page-locked mapping of the region."""
        device = self._staged("in", k, host.shape, host.dtype)
        self.cp.cuda.runtime.memcpyAsync(device.data.ptr, host.ctypes.data, host.nbytes, 1,  # host to device
                                         self.stream.ptr)
        return device

    def output(self, k: int, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """The device array the group's ``k``-th forward writes, before its download."""
        return self._staged("out", k, shape, dtype)

    def download(self, device: Any, host: np.ndarray) -> None:
        """Queue the copy of the device array into the host array (a system region), in its dtype."""
        cp = self.cp
        if device.dtype != host.dtype:
            device = device.astype(host.dtype)
        cp.cuda.runtime.memcpyAsync(host.ctypes.data, device.data.ptr, host.nbytes, 2,  # device to host
                                    self.stream.ptr)

    def finish(self, count: int) -> None:
        """Queue the copy of the first ``count`` words back, and the event after it."""
        self.cp.cuda.runtime.memcpyAsync(self.host.ctypes.data, self.words.data.ptr, count * 4, 2,  # device to host
                                         self.stream.ptr)
        self.event.record(self.stream)

    def wait(self) -> np.ndarray:
        """The words, once the group is done (the wait lets go of the GIL)."""
        self.event.synchronize()
        return self.host
