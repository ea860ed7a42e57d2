"""Triton's shared-memory extensions: regions that inference requests read inputs from and write
outputs into, instead of the body. System regions are POSIX shared-memory objects (``/dev/shm``);
CUDA regions (the cuda backend only, :mod:`mmad.server.cudashm`) are device allocations another
process shares through a CUDA IPC handle. Both kinds share one namespace of region names and one
validation of every reference (:meth:`SharedMemoryRegistry.reference`).

A region maps the whole object once at registration; tensors are NumPy views of the mapping,
checked to lie inside the region before any is made. A region unregistered while a request
still holds views of it stays mapped until the last view is gone (the mapping cannot be closed
under a live buffer export), so an unregister never pulls memory from under a forward.

On a backend that copies to a device (cuda), a system region's mapping is page-locked at
registration (the backend's ``pin_host_memory``), so that inputs read from it and outputs
written into it are copied by DMA straight from and to the region, without staging; a region
whose pinning fails still works, through the staged path, and its status says so.
"""

from __future__ import annotations

import base64
import binascii
import math
import mmap
import os
import re
import stat
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from mmad.errors import InvalidInput

log = logging.getLogger("mmad.server")

SHM_DIR = "/dev/shm"
# a POSIX shared-memory name: one leading slash, no other (no way out of /dev/shm)
_KEY = re.compile(r"/[^/\x00]{1,255}")
_NAME_MAX = 256
CUDA_IPC_HANDLE_SIZE = 64  # bytes of a cudaIpcMemHandle_t


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    mapping: mmap.mmap
    view: memoryview  # [offset, offset + byte_size) of the mapping
    unpin: Callable[[], None] | None = None  # undoes the page-locking of the mapping, if it was
    pin_error: str | None = None  # why page-locking failed, where it was tried and failed
    # weak references to the buffer objects under the arrays handed out: while one lives, a
    # request may still read or write the mapping (NumPy holds its own memoryview of ``view``, so
    # ``view.release()`` succeeding proves nothing)
    _exports: list = field(default_factory=list)
    _exports_lock: threading.Lock = field(default_factory=threading.Lock)

    on_device = False
    device_id = None

    def status(self) -> dict[str, Any]:
        doc = {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}
        if self.unpin is not None or self.pin_error is not None:  # mmad's addition: a device backend
            doc["page_locked"] = self.unpin is not None
            if self.pin_error is not None:
                doc["page_locked_error"] = self.pin_error
        return doc

    def registration(self) -> dict[str, Any]:
        """What registered it (the serving workers register the same)."""
        return {"name": self.name, "kind": "system", "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}

    def array(self, where: str, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        self.check_size()
        with self._exports_lock:  # one at a time with close(): an array is made before it, or refused
            try:
                flat = np.frombuffer(self.view, dtype=dtype, count=math.prod(shape), offset=offset)
            except ValueError as exc:  # the view was released: unregistered since the lookup
                raise InvalidInput(f"{where}: shared memory region {self.name!r} was unregistered") from exc
            self._exports = [r for r in self._exports if r() is not None]
            self._exports.append(weakref.ref(flat.base))
        return flat.reshape(shape)

    def check_size(self) -> None:
        """Refuse a region whose object was truncated below it since registration: touching the
        mapping past the object's end would kill the daemon with SIGBUS."""
        try:
            size = os.fstat(self.fd).st_size
        except OSError as exc:
            raise InvalidInput(f"shared memory region {self.name!r} cannot be used: {exc.strerror}") from exc
        if size < self.offset + self.byte_size:
            raise InvalidInput(f"shared memory region {self.name!r}: its object {self.key!r} shrank to {size} "
                               f"bytes since registration (the region needs {self.offset + self.byte_size}); "
                               "unregister and register it again")

    def close(self) -> bool:
        """Unmap the region; False while a request still holds views of it (then the registry
        keeps it and tries again later: a page-locked mapping must be unlocked before it is
        unmapped, and not while a copy may still read or write it)."""
        fd, self.fd = self.fd, -1  # a closed number may be reused by another file: never fstat it
        if fd >= 0:
            os.close(fd)
        with self._exports_lock:
            if any(r() is not None for r in self._exports):
                return False
            self.view.release()
        if self.unpin is not None:
            self.unpin()
            self.unpin = None
        self.mapping.close()
        return True


def _int_field(doc: dict[str, Any], name: str, default: int | None = None) -> int:
    value = doc.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"{name} must be a non-negative integer; got {value!r}")
    return value


CUDA_NEEDS_BACKEND = "CUDA shared memory needs the cuda backend; this daemon runs {backend}"


class SharedMemoryRegistry:
    """The registered shared-memory regions, system and CUDA, by name (one namespace, as
    Triton's), thread-safe: large request headers are parsed on compute threads.

    ``pin``: the backend's ``pin_host_memory`` (page-locks a system region's mapping; None where
    the backend copies nothing to a device). ``cuda_open``: turns (IPC handle bytes, device id,
    byte size) into a CUDA region (:func:`mmad.server.cudashm.open_ipc_region` on the cuda
    backend; tests pass a fake); None where CUDA shared memory is unavailable, then
    ``cuda_unavailable`` says why.
    """

    def __init__(self) -> None:
        self._regions: dict[str, Any] = {}  # name -> Region or CudaRegion
        self._retired: list[Any] = []  # unregistered while requests still held views of them
        self._lock = threading.Lock()
        self.pin: Callable[[Any], Callable[[], None] | None] | None = None
        self.cuda_open: Callable[[bytes, int, int], Any] | None = None
        self.cuda_unavailable = CUDA_NEEDS_BACKEND.format(backend="no backend yet")
        self._pin_failure_logged = False
        self.on_change: Callable[[], None] | None = None  # after a region came or went (--workers)

    def use_backend(self, backend: Any, name: str) -> None:
        """Page-lock system regions through ``backend`` (its ``pin_host_memory`` hook); CUDA
        regions on the cuda backend only."""
        self.pin = backend.pin_host_memory
        if name == "cuda":
            from mmad.server.cudashm import open_ipc_region

            self.cuda_open = open_ipc_region
        else:
            self.cuda_unavailable = CUDA_NEEDS_BACKEND.format(backend=name)

    @property
    def cuda_enabled(self) -> bool:
        return self.cuda_open is not None

    # -- registration -------------------------------------------------------------------------
    def _check_new(self, name: str) -> None:
        if not name or len(name) > _NAME_MAX:
            raise InvalidInput(f"the region name must be 1 to {_NAME_MAX} characters")
        with self._lock:
            if name in self._regions:
                raise InvalidInput(f"shared memory region {name!r} is already registered; unregister it first")

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _add(self, region: Any) -> None:
        with self._lock:
            if region.name not in self._regions:
                self._regions[region.name] = region
                added = True
            else:
                added = False
        if added:
            self._changed()
            return
        self._retire([region])  # registered by a concurrent request meanwhile
        raise InvalidInput(f"shared memory region {region.name!r} is already registered; unregister it first")

    def register(self, name: str, doc: Any) -> None:
        """A system region (``{"key", "offset", "byte_size"}``)."""
        if not isinstance(doc, dict):
            raise InvalidInput('the register body must be a JSON object {"key", "offset", "byte_size"}')
        self._check_new(name)
        key = doc.get("key")
        if not isinstance(key, str) or not _KEY.fullmatch(key) or key in ("/.", "/.."):
            raise InvalidInput(f"key must name a POSIX shared-memory object such as \"/my_region\" "
                               f"(one leading slash, no other); got {key!r}")
        offset = _int_field(doc, "offset", 0)
        byte_size = _int_field(doc, "byte_size")
        if byte_size == 0:
            raise InvalidInput("byte_size must be at least 1")
        try:
            # O_NOFOLLOW: a link planted in /dev/shm must not lead to a file elsewhere
            fd = os.open(SHM_DIR + key, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise InvalidInput(f"unable to open shared memory object {key!r}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidInput(f"{key!r} is not a shared memory object")
            if offset + byte_size > st.st_size:
                raise InvalidInput(f"offset {offset} + byte_size {byte_size} is past the end of shared memory "
                                   f"object {key!r} ({st.st_size} bytes)")
            mapping = mmap.mmap(fd, st.st_size)
        except BaseException:
            os.close(fd)
            raise
        region = Region(name, key, offset, byte_size, fd, mapping, memoryview(mapping)[offset:offset + byte_size])
        if self.pin is not None:
            self._pin(region)
        self._add(region)

    def _pin(self, region: Region) -> None:
        """Page-lock the region's mapping; a failure leaves it usable, unpinned (logged once, and
        in its status)."""
        try:
            region.unpin = self.pin(region.mapping)
        except Exception as exc:  # the backend's own error types: any failure means "not pinned"
            region.pin_error = f"{type(exc).__name__}: {exc}"
            if not self._pin_failure_logged:
                self._pin_failure_logged = True
                log.warning("page-locking shared memory region %r failed (%s); its tensors take the staged "
                            "copy path (logged once; each region's status says whether it is page-locked)",
                            region.name, region.pin_error)

    def register_cuda(self, name: str, doc: Any) -> None:
        """A CUDA region (``{"raw_handle": {"b64"}, "device_id", "byte_size"}``, as tritonclient sends)."""
        if self.cuda_open is None:
            raise InvalidInput(self.cuda_unavailable)
        if not isinstance(doc, dict):
            raise InvalidInput('the register body must be a JSON object {"raw_handle": {"b64": ...}, '
                               '"device_id", "byte_size"}')
        self._check_new(name)
        raw = doc.get("raw_handle")
        b64 = raw.get("b64") if isinstance(raw, dict) else None
        if not isinstance(b64, str):
            raise InvalidInput('raw_handle must be {"b64": "<the CUDA IPC handle in base64>"}')
        try:
            handle = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidInput(f"raw_handle.b64 is not valid base64: {exc}") from exc
        if len(handle) != CUDA_IPC_HANDLE_SIZE:
            raise InvalidInput(f"raw_handle is {len(handle)} bytes; a CUDA IPC handle is {CUDA_IPC_HANDLE_SIZE}")
        device_id = _int_field(doc, "device_id")
        byte_size = _int_field(doc, "byte_size")
        if byte_size == 0:
            raise InvalidInput("byte_size must be at least 1")
        region = self.cuda_open(name, handle, device_id, byte_size)
        region.handle = handle
        self._add(region)

    def unregister(self, name: str | None = None, cuda: bool = False) -> None:
        """One region, or every region (``None``) of one kind; an unknown name is no error (as Triton)."""
        with self._lock:
            names = [name] if name is not None else list(self._regions)
            gone = [self._regions.pop(n) for n in names
                    if n in self._regions and self._regions[n].on_device == cuda]
        self._retire(gone)
        if gone:
            self._changed()

    def registrations(self) -> list[dict[str, Any]]:
        """Every region as it was registered (a CUDA region with its IPC handle)."""
        with self._lock:
            return [r.registration() for r in self._regions.values()]

    def follow(self, registrations: list[dict[str, Any]]) -> None:
        """Hold the regions ``registrations`` lists (a serving worker following the primary's):
        unchanged ones kept, new ones opened, the others retired. One that cannot be opened here
        is left out, logged; a request naming it is refused as unregistered."""
        wanted = {doc["name"]: doc for doc in registrations}
        with self._lock:
            gone = [r for name, r in self._regions.items() if wanted.get(name) != r.registration()]
            for region in gone:
                del self._regions[region.name]
            held = set(self._regions)
        self._retire(gone)
        for name, doc in wanted.items():
            if name in held:
                continue
            try:
                if doc["kind"] == "cuda":
                    self.register_cuda(name, doc)
                else:
                    self._check_followed_size(doc)
                    self.register(name, doc)
            except InvalidInput as exc:
                log.error("shared memory region %r, registered with the primary, cannot be used by this worker: %s",
                          name, exc)
                self._add(UnusableRegion(doc, str(exc)))

    @staticmethod
    def _check_followed_size(doc: dict[str, Any]) -> None:
        """The primary checked the object's size when it registered the region: smaller now, it shrank."""
        try:
            size = os.stat(SHM_DIR + doc["key"], follow_symlinks=False).st_size
        except OSError:
            return  # register() says why it cannot be opened
        if size < doc["offset"] + doc["byte_size"]:
            raise InvalidInput(f"its object {doc['key']!r} shrank to {size} bytes since registration (the region "
                               f"needs {doc['offset'] + doc['byte_size']}); unregister and register it again")

    def _retire(self, regions: list[Any]) -> None:
        with self._lock:
            pending, self._retired = [*self._retired, *regions], []
        busy = [r for r in pending if not r.close()]
        if busy:
            with self._lock:
                self._retired.extend(busy)

    def status(self, name: str | None = None, cuda: bool = False) -> list[dict[str, Any]]:
        self._retire([])  # close what requests have let go of since
        with self._lock:
            if name is None:
                return [r.status() for r in self._regions.values() if r.on_device == cuda]
            region = self._regions.get(name)
        if region is None or region.on_device != cuda:
            raise InvalidInput(f"unable to find {'cuda' if cuda else 'system'} shared memory region {name!r}")
        return [region.status()]

    def close(self) -> None:
        with self._lock:
            gone, self._regions = list(self._regions.values()), {}
        self._retire(gone)

    # -- references -----------------------------------------------------------------------------
    def reference(self, where: str, params: dict[str, Any]) -> tuple[Any, int, int]:
        """(region, offset, byte_size) of a tensor's shared_memory_* parameters, checked to lie
        inside the region."""
        name = params["shared_memory_region"]
        if not isinstance(name, str):
            raise InvalidInput(f"{where}: shared_memory_region must be a string; got {name!r}")
        offset = params.get("shared_memory_offset", 0)
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise InvalidInput(f"{where}: shared_memory_offset must be a non-negative integer; got {offset!r}")
        size = params.get("shared_memory_byte_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidInput(f"{where}: shared_memory_byte_size must be a non-negative integer; got {size!r}")
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise InvalidInput(f"{where}: shared memory region {name!r} is not registered")
        if offset + size > region.byte_size:
            raise InvalidInput(f"{where}: shared_memory_offset {offset} + shared_memory_byte_size {size} is past "
                               f"the end of region {name!r} ({region.byte_size} bytes)")
        return region, offset, size

    def tensor(self, where: str, params: dict[str, Any], dtype: np.dtype, shape: tuple[int, ...],
               datatype: str, at_least: bool = False) -> "ShmTensor":
        """A (shape, dtype) view of the region a tensor names (a NumPy array in a system region, a
        device array in a CUDA one). ``at_least``: the byte size may be larger than the tensor
        (an output's region), else it must equal it (an input's)."""
        region, offset, size = self.reference(where, params)
        needed = math.prod(shape) * dtype.itemsize
        if size < needed if at_least else size != needed:
            raise InvalidInput(f"{where}: shared_memory_byte_size is {size} bytes but shape {list(shape)} of "
                               f"{datatype} {'needs at least' if at_least else 'is'} {needed}")
        return ShmTensor(region.array(where, offset, dtype, shape), region.name, offset, needed, region.on_device,
                         region.device_id)


class UnusableRegion:
    """A region the primary registered that a serving worker could not open: every request
    naming it is refused with the reason, as the primary would refuse it."""

    def __init__(self, doc: dict[str, Any], reason: str):
        self._doc = doc
        self.name, self.byte_size, self.reason = doc["name"], doc["byte_size"], reason
        self.on_device = doc["kind"] == "cuda"
        self.device_id = doc.get("device_id")

    def registration(self) -> dict[str, Any]:
        return self._doc

    def status(self) -> dict[str, Any]:
        return {k: v for k, v in self._doc.items() if k not in ("kind", "raw_handle")}

    def array(self, where: str, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> Any:
        raise InvalidInput(f"{where}: shared memory region {self.name!r} cannot be used: {self.reason}")

    def close(self) -> bool:
        return True


@dataclass
class ShmTensor:
    """A tensor's view of its region and the bytes it covers there (for the overlap check)."""

    array: Any
    region: str
    offset: int
    nbytes: int
    on_device: bool
    device: int | None  # the GPU of a CUDA region

    def overlaps(self, other: "ShmTensor") -> bool:
        return (self.region == other.region and self.offset < other.offset + other.nbytes
                and other.offset < self.offset + self.nbytes)
