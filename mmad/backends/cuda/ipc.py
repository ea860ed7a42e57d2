"""Triton's CUDA shared-memory extension on the cuda backend: device allocations of another
process, shared through CUDA IPC handles, that inference requests read inputs from and write
outputs into on the device, with no host copy.

:func:`open_ipc_region` is the one place that touches CUDA: it opens the handle on the
region's device and wraps the pointer as CuPy memory. The registry
(:class:`mmad.engine.shm.SharedMemoryRegistry`) takes it from the backend
(``CudaBackend.cuda_ipc_opener``) as a seam (``cuda_open``), so the
routes and every reference check run in CI without a GPU, with a fake opener.
"""

from __future__ import annotations

import base64
import ctypes
import logging
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from mmad.errors import InvalidInput

log = logging.getLogger("mmad.backends.cuda.ipc")


VIEWS_KEPT = 64  # device-array views of one region kept for reuse


@dataclass
class CudaRegion:
    """A registered CUDA region: ``byte_size`` bytes on GPU ``device_id``; ``view`` makes device
    arrays of it (the seam: a fake opener's ``view`` may give NumPy arrays)."""

    name: str
    device_id: int
    byte_size: int
    view: Callable[[int, np.dtype, tuple[int, ...]], Any]  # (offset, dtype, shape) -> device array
    handle: bytes = b""  # the IPC handle it was opened from (the serving workers open it too)

    on_device = True

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}

    def registration(self) -> dict[str, Any]:
        return {"name": self.name, "kind": "cuda", "raw_handle": {"b64": base64.b64encode(self.handle).decode()},
                "device_id": self.device_id, "byte_size": self.byte_size}

    def __post_init__(self) -> None:
        # (offset, dtype, shape) -> its view: clients name the same tensors request after request,
        # and making a device array costs the region-forward thread more than its launch share
        self._views: dict[tuple, Any] = {}

    def array(self, where: str, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> Any:
        key = (offset, dtype, shape)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= VIEWS_KEPT:
                self._views.clear()
            view = self._views[key] = self.view(offset, dtype, shape)
        return view

    def close(self) -> bool:
        """Let the IPC mapping go: it is closed once no request's array uses it any more (the
        arrays hold it), so this is never refused."""
        return True


def open_ipc_region(name: str, handle: bytes, device_id: int, byte_size: int) -> CudaRegion:
    """Open a CUDA IPC handle on ``device_id`` as a region of ``byte_size`` bytes."""
    from mmad.backends.cuda.toolchain import cupy_module

    cp = cupy_module()
    count = cp.cuda.runtime.getDeviceCount()
    if not 0 <= device_id < count:
        raise InvalidInput(f"device_id {device_id} is not a GPU of this daemon (it sees {count})")
    with cp.cuda.Device(device_id):
        try:
            ptr = cp.cuda.runtime.ipcOpenMemHandle(handle)
        except cp.cuda.runtime.CUDARuntimeError as exc:
            raise InvalidInput(f"unable to open the CUDA IPC handle of region {name!r} on GPU {device_id}: "
                               f"{exc}") from exc
    owner = _IpcMapping(cp, ptr, device_id)  # closes the handle if the size check below refuses it
    with cp.cuda.Device(device_id):
        allocated = _allocation_bytes_from(ptr)
    if byte_size > allocated:
        raise InvalidInput(f"byte_size {byte_size} of CUDA region {name!r} is larger than the device "
                           f"allocation its handle shares ({allocated} bytes)")
    # closed when the registry dropped the region and no request's array over it is left
    memory = cp.cuda.UnownedMemory(ptr, byte_size, owner, device_id)

    def view(offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> Any:
        return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(memory, offset))

    return CudaRegion(name, device_id, byte_size, view)


def _allocation_bytes_from(ptr: int) -> int:
    """Bytes of the device allocation from ``ptr`` to its end (the driver's cuMemGetAddressRange):
    a client's byte_size is never trusted past it."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = libcuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if status != 0:
        raise InvalidInput(f"the CUDA driver could not tell the size of the shared allocation (CUresult {status})")
    return base.value + size.value - ptr


class _IpcMapping:
    """The owner of an opened IPC handle: ``UnownedMemory`` (and so every array over the
    region) keeps it alive; the handle is closed when it is collected."""

    def __init__(self, cp, ptr: int, device_id: int):
        self.cp, self.ptr, self.device_id = cp, ptr, device_id

    def __del__(self) -> None:
        try:
            with self.cp.cuda.Device(self.device_id):
                self.cp.cuda.runtime.ipcCloseMemHandle(self.ptr)
        except Exception as exc:  # a destructor cannot raise; at interpreter exit CUDA may be gone first
            log.warning("closing the CUDA IPC handle at %#x on GPU %d failed: %s", self.ptr, self.device_id, exc)
