"""Triton's shared-memory extensions: regions that inference requests read inputs from and write
outputs into, instead of the body. System regions are POSIX shared-memory objects (``/dev/shm``);
CUDA regions (the cuda backend only, :mod:`mmad.backends.cuda.ipc`) are device allocations another
process shares through a CUDA IPC handle. Both kinds share one namespace of region names and one
validation of every reference (:meth:`SharedMemoryRegistry.reference`).

A system region's object belongs to the client, who can shrink it (``ftruncate``) or leave it
sparse on a full filesystem at any moment. A load or store through a mapping of such an object
past its end, or into a hole the filesystem has no page for, is SIGBUS: the whole daemon dies.
So the daemon's CPU never touches a mapping of a client's object. Inputs are read with
``pread`` into buffers of the daemon's own (page-locked on a GPU backend,
:mod:`mmad.engine.hostmem`), and outputs are written from such buffers with ``pwrite``: a read
that comes up short (the object shrank) is a 400 for that request, a write the filesystem has
no room for (ENOSPC) a 507, and nothing else happens to the daemon.

The one exception is DMA. Where the primary runs region forwards for its serving workers on
the cuda backend (:mod:`mmad.engine.region_forwards`), a region's pages are mapped and
page-locked at registration (the backend's ``pin_host_memory``: ``cudaHostRegister``), and the
device copies rows straight from and into them. Page-locking faults every page of the region
in and holds it: a client that truncates the object afterwards takes the pages out of its
file, but the pinned pages stay allocated until the region is unregistered, and the copy
engines reach them by their physical addresses, never through the CPU's page tables, so no
fault can happen; the client just no longer sees what the copies write. A region that cannot
be page-locked (a sparse object on a /dev/shm too small for it: faulting its pages in fails)
takes the ``pread``/``pwrite`` path there too, and its status says so. A page-locked region's
views are handed to device copies only, never to host code.

Registration is an admin action (routers/shm.py: the API key where one is set, and
``--shared-memory``); a registration opens the object once (a regular file directly in
``/dev/shm``, no link followed, and with ``owner`` given, owned by that user), and at most
``limit`` regions are held.
"""

from __future__ import annotations

import base64
import errno
import logging
import math
import mmap
import os
import re
import stat
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from mmad.errors import ConflictError, Forbidden, InvalidInput, RegionFull
from mmad.engine import hostmem

log = logging.getLogger("mmad.engine.shm")

SHM_DIR = "/dev/shm"
# a POSIX shared-memory name: one leading slash, no other (no way out of /dev/shm)
_KEY = re.compile(r"/[^/\x00]{1,255}")
NAME_MAX = 128  # characters of a region name (it is echoed in statuses, errors and logs)
CUDA_IPC_HANDLE_SIZE = 64  # bytes of a cudaIpcMemHandle_t
_FULL = {errno.ENOSPC, errno.EDQUOT}


class _Descriptor:
    """The open descriptor of a region's object, closed once nothing holds it: the region, and
    every tensor a request still reads from or writes to it (an unregister never closes a
    descriptor under a request, and a closed number is never used again)."""

    def __init__(self, fd: int):
        self.fd = fd
        weakref.finalize(self, os.close, fd)


@dataclass(eq=False)
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    descriptor: _Descriptor
    # page-locked mapping of the region's pages, for device copies only (see the module docstring)
    mapping: mmap.mmap | None = None
    view: memoryview | None = None  # [offset, offset + byte_size) of the mapping
    unpin: Callable[[], None] | None = None  # undoes the page-locking of the mapping
    pin_error: str | None = None  # why page-locking failed, where it was tried and failed
    # weak references to the buffer objects under the DMA views handed out: while one lives, a
    # device copy may still read or write the mapping (NumPy holds its own memoryview of ``view``,
    # so ``view.release()`` succeeding proves nothing)
    _exports: list = field(default_factory=list)
    _exports_lock: threading.Lock = field(default_factory=threading.Lock)

    on_device = False
    device_id = None

    @property
    def page_locked(self) -> bool:
        return self.unpin is not None

    def status(self) -> dict[str, Any]:
        doc = {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}
        if self.unpin is not None or self.pin_error is not None:  # mmad's addition: DMA was tried
            doc["page_locked"] = self.unpin is not None
            if self.pin_error is not None:
                doc["page_locked_error"] = self.pin_error
        return doc

    def registration(self) -> dict[str, Any]:
        """What registered it (the serving workers register the same)."""
        return {"name": self.name, "kind": "system", "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}

    def dma_array(self, where: str, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A view of the page-locked mapping, for device copies only (host code touching it
        could fault: the module docstring). An object shrunk below the region is refused: the
        copies would be safe, but would no longer reach the client's file."""
        size = os.fstat(self.descriptor.fd).st_size
        if size < self.offset + self.byte_size:
            raise self._shrank(where, size)
        with self._exports_lock:  # one at a time with close(): a view is made before it, or refused
            try:
                flat = np.frombuffer(self.view, dtype=dtype, count=math.prod(shape), offset=offset)
            except (TypeError, ValueError) as exc:  # the view was released: unregistered since the lookup
                raise InvalidInput(f"{where}: shared memory region {self.name!r} was unregistered") from exc
            self._exports = [r for r in self._exports if r() is not None]
            self._exports.append(weakref.ref(flat.base))
        return flat.reshape(shape)

    def _shrank(self, where: str, size: int) -> InvalidInput:
        return InvalidInput(f"{where}: shared memory region {self.name!r}: its object {self.key!r} shrank to {size} "
                            f"bytes since registration (the region needs {self.offset + self.byte_size}); "
                            "unregister and register it again")

    def read_into(self, where: str, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` from the region's bytes at ``offset`` (``pread``: a shrunk object is a
        short read, refused, never a fault)."""
        pos, done = self.offset + offset, 0
        try:
            while done < len(buffer):
                n = os.preadv(self.descriptor.fd, [buffer[done:]], pos + done)
                if n == 0:
                    raise self._shrank(where, pos + done)
                done += n
        except OSError as exc:
            raise InvalidInput(f"{where}: shared memory region {self.name!r} cannot be read: {exc.strerror}") from exc

    def write_from(self, where: str, offset: int, data: memoryview) -> None:
        """Write ``data`` into the region's bytes at ``offset`` (``pwrite``: no room on the
        object's filesystem is a 507, a shrunk object a 400, never a fault)."""
        pos, done = self.offset + offset, 0
        try:
            size = os.fstat(self.descriptor.fd).st_size
            if size < pos + len(data):  # (shrinking after this check only makes the write extend it again)
                raise self._shrank(where, size)
            while done < len(data):
                n = os.pwritev(self.descriptor.fd, [data[done:]], pos + done)
                if n == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                done += n
        except OSError as exc:
            if exc.errno in _FULL:
                raise RegionFull(f"{where}: the filesystem of shared memory object {self.key!r} (region "
                                 f"{self.name!r}) has no room for the output: {done} of {len(data)} bytes were "
                                 "written (a sparse object larger than its /dev/shm, e.g. Docker's 64 MiB "
                                 "default: enlarge it, or fill the object when creating it)") from exc
            raise InvalidInput(f"{where}: shared memory region {self.name!r} cannot be written: "
                               f"{exc.strerror}") from exc

    def close(self) -> bool:
        """Let the region go; False while a device copy may still use its page-locked mapping
        (then the registry keeps it and tries again later: the mapping must be unlocked before
        it is unmapped, and not while a copy may still read or write it). Its descriptor closes
        once the last request's tensor lets go of it."""
        if self.mapping is None:
            return True
        with self._exports_lock:
            if any(r() is not None for r in self._exports):
                return False
            self.view.release()
        if self.unpin is not None:
            self.unpin()
            self.unpin = None
        self.mapping.close()
        self.mapping = None
        return True


def _non_negative(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"{name} must be a non-negative integer; got {value!r}")
    return value


def _byte_size(value: Any) -> int:
    if _non_negative("byte_size", value) == 0:
        raise InvalidInput("byte_size must be at least 1")
    return value


def _check_key(key: Any) -> str:
    if (not isinstance(key, str) or not _KEY.fullmatch(key) or key in ("/.", "/..")
            or not key.isprintable()):
        raise InvalidInput(f"key must name a POSIX shared-memory object such as \"/my_region\" "
                           f"(one leading slash, no other, printable characters); got {key!r}")
    return key


CUDA_NEEDS_BACKEND = "CUDA shared memory needs the cuda backend; this daemon runs {backend}"


class SharedMemoryRegistry:
    """The registered shared-memory regions, system and CUDA, by name (one namespace, as
    Triton's), thread-safe: large request headers are parsed on compute threads.

    ``pin``: the backend's ``pin_host_memory`` (page-locks a system region's mapping; None where
    the backend copies nothing to a device), used once :meth:`enable_dma` was called (the
    primary's region forwards). ``cuda_open``: turns (IPC handle bytes, device id, byte size)
    into a CUDA region (the backend's ``cuda_ipc_opener``, :func:`mmad.backends.cuda.ipc.open_ipc_region`; tests
    pass a fake); None where CUDA shared memory is unavailable, then ``cuda_unavailable`` says why.
    """

    def __init__(self) -> None:
        self._regions: dict[str, Any] = {}  # name -> Region or CudaRegion
        self._retired: list[Any] = []  # unregistered while device copies still held views of them
        self._lock = threading.Lock()
        self.pin: Callable[[Any], Callable[[], None] | None] | None = None
        self._dma = False  # map and page-lock system regions for device copies (enable_dma)
        self.cuda_open: Callable[[bytes, int, int], Any] | None = None
        self.cuda_unavailable = CUDA_NEEDS_BACKEND.format(backend="no backend yet")
        self._pin_failure_logged = False
        self.on_change: Callable[[], None] | None = None  # after a region came or went (--workers)

    def use_backend(self, backend: Any, name: str) -> None:
        """Page-lock system regions through ``backend`` (its ``pin_host_memory`` hook) where
        device copies use them; CUDA regions where it opens them (``cuda_ipc_opener``: the cuda
        backend only)."""
        self.pin = backend.pin_host_memory
        self.cuda_open = backend.cuda_ipc_opener()
        if self.cuda_open is None:
            self.cuda_unavailable = CUDA_NEEDS_BACKEND.format(backend=name)

    def enable_dma(self) -> None:
        """Map and page-lock the system regions registered from now on, so that device copies
        read and write them straight (the primary's region forwards, on the cuda backend)."""
        self._dma = True

    @property
    def cuda_enabled(self) -> bool:
        return self.cuda_open is not None

    # -- registration -------------------------------------------------------------------------
    def _check_new(self, name: Any, limit: int | None) -> None:
        if not isinstance(name, str) or not 1 <= len(name) <= NAME_MAX or not name.isprintable():
            raise InvalidInput(f"the region name must be 1 to {NAME_MAX} printable characters; got {name!r:.200}")
        with self._lock:
            if name in self._regions:
                raise InvalidInput(f"shared memory region {name!r} is already registered; unregister it first")
            self._check_room(limit)

    def _check_room(self, limit: int | None) -> None:
        """Under the lock: room for one more region (each holds a descriptor of the daemon's)."""
        if limit is not None and len(self._regions) >= limit:
            raise ConflictError(f"{len(self._regions)} shared memory regions are registered, the most this daemon "
                                "holds (--max-shm-regions); unregister one first")

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _add(self, region: Any, limit: int | None = None) -> None:
        try:
            with self._lock:
                if region.name in self._regions:
                    raise InvalidInput(f"shared memory region {region.name!r} is already registered; "
                                       "unregister it first")  # by a concurrent request meanwhile
                self._check_room(limit)
                self._regions[region.name] = region
        except (InvalidInput, ConflictError):
            self._retire([region])
            raise
        self._changed()

    def register(self, name: str, key: Any, offset: Any, byte_size: Any, owner: int | None = None,
                 limit: int | None = None) -> None:
        """A system region: ``byte_size`` bytes at ``offset`` of the object ``key``, each value
        checked here as a client sent it. ``owner``: the user id the object must belong to (the
        requesting user where the daemon can tell it; root may name any object); ``limit``: the
        most regions held."""
        self._check_new(name, limit)
        key = _check_key(key)
        offset = _non_negative("offset", offset)
        byte_size = _byte_size(byte_size)
        try:
            # O_NOFOLLOW: a link planted in /dev/shm must not lead to a file elsewhere; O_NONBLOCK:
            # opening a FIFO or device node planted there never waits (refused just below)
            fd = os.open(SHM_DIR + key, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise InvalidInput(f"unable to open shared memory object {key!r}: {exc.strerror}") from exc
        descriptor = _Descriptor(fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInput(f"{key!r} is not a shared memory object (not a regular file)")
        if owner is not None and owner != 0 and st.st_uid != owner:
            raise Forbidden(f"shared memory object {key!r} belongs to another user; a client registers objects "
                            "of its own user only")
        if offset + byte_size > st.st_size:
            raise InvalidInput(f"offset {offset} + byte_size {byte_size} is past the end of shared memory "
                               f"object {key!r} ({st.st_size} bytes)")
        region = Region(name, key, offset, byte_size, descriptor)
        if self._dma and self.pin is not None:
            self._map_and_pin(region)
        self._add(region, limit)

    def _map_and_pin(self, region: Region) -> None:
        """Map the region's pages and page-lock them for device copies; a failure leaves the
        region unmapped, served through ``pread``/``pwrite`` (logged once, and in its status)."""
        start = region.offset - region.offset % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(region.descriptor.fd, region.offset + region.byte_size - start, offset=start)
        try:
            unpin = self.pin(mapping)
        except Exception as exc:  # the backend's own error types: any failure means "not pinned"
            unpin, region.pin_error = None, f"{type(exc).__name__}: {exc}"
            if not self._pin_failure_logged:
                self._pin_failure_logged = True
                log.warning("page-locking shared memory region %r failed (%s); its tensors are read and written "
                            "with pread/pwrite (logged once; each region's status says whether it is page-locked)",
                            region.name, region.pin_error)
        if unpin is None:
            mapping.close()
            return
        region.mapping, region.unpin = mapping, unpin
        region.view = memoryview(mapping)[region.offset - start:region.offset - start + region.byte_size]

    def register_cuda(self, name: str, handle: bytes, device_id: Any, byte_size: Any, limit: int | None = None) -> None:
        """A CUDA region: ``byte_size`` bytes of the allocation the IPC ``handle`` names on GPU ``device_id``."""
        if self.cuda_open is None:
            raise InvalidInput(self.cuda_unavailable)
        self._check_new(name, limit)
        if len(handle) != CUDA_IPC_HANDLE_SIZE:
            raise InvalidInput(f"raw_handle is {len(handle)} bytes; a CUDA IPC handle is {CUDA_IPC_HANDLE_SIZE}")
        device_id = _non_negative("device_id", device_id)
        byte_size = _byte_size(byte_size)
        region = self.cuda_open(name, handle, device_id, byte_size)
        region.handle = handle
        self._add(region, limit)

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
        """Hold the regions ``registrations`` lists (a serving worker following the primary's,
        which checked who registered them): unchanged ones kept, new ones opened, the others
        retired. One that cannot be opened here is left out, logged; a request naming it is
        refused as unregistered."""
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
                if doc["kind"] == "cuda":  # (the primary's registration: its handle in base64)
                    self.register_cuda(name, base64.b64decode(doc["raw_handle"]["b64"]), doc["device_id"],
                                       doc["byte_size"])
                else:
                    self._check_followed_size(doc)
                    self.register(name, doc["key"], doc["offset"], doc["byte_size"])
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
        self._retire([])  # close what device copies have let go of since
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
               datatype: str, at_least: bool = False, dma: bool = False) -> "ShmTensor":
        """The tensor a request names in a region: ``at_least``: the byte size may be larger than
        the tensor (an output's region), else it must equal it (an input's). Its ``array`` is a
        device array in a CUDA region; in a system region, a host buffer of the daemon's that
        :meth:`ShmTensor.load` fills from the region (an input) or :meth:`ShmTensor.store`
        writes into it (an output); with ``dma`` and a page-locked region, the view of its
        mapping, for device copies only."""
        region, offset, size = self.reference(where, params)
        needed = math.prod(shape) * dtype.itemsize
        if size < needed if at_least else size != needed:
            raise InvalidInput(f"{where}: shared_memory_byte_size is {size} bytes but shape {list(shape)} of "
                               f"{datatype} {'needs at least' if at_least else 'is'} {needed}")
        if not isinstance(region, Region):
            return ShmTensor(region.array(where, offset, dtype, shape), region.name, offset, needed, region.on_device,
                             region.device_id)
        if dma and region.page_locked:
            return ShmTensor(region.dma_array(where, offset, dtype, shape), region.name, offset, needed, False, None)
        array = hostmem.empty(needed).view(dtype).reshape(shape)
        return ShmTensor(array, region.name, offset, needed, False, None, (where, region))


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
    """A tensor's array, its region and the bytes it covers there (for the overlap check).

    ``copy``: (where, region) of a system-region tensor whose ``array`` is a buffer
    of the daemon's, read from (``load``) or written into (``store``) the region's object with
    ``pread``/``pwrite``; None where ``array`` is the region itself (CUDA, or page-locked DMA)."""

    array: Any
    region: str
    offset: int
    nbytes: int
    on_device: bool
    device: int | None  # the GPU of a CUDA region
    copy: tuple[str, Region] | None = None

    def overlaps(self, other: "ShmTensor") -> bool:
        return (self.region == other.region and self.offset < other.offset + other.nbytes
                and other.offset < self.offset + self.nbytes)

    def _bytes(self) -> memoryview:
        return memoryview(self.array).cast("B")

    def load(self) -> None:
        """Read the input's bytes from its region into ``array`` (nothing to do without ``copy``)."""
        if self.copy is not None:
            where, region = self.copy
            region.read_into(where, self.offset, self._bytes())

    def store(self) -> None:
        """Write ``array`` (the output) into its region (nothing to do without ``copy``)."""
        if self.copy is not None:
            where, region = self.copy
            region.write_from(where, self.offset, self._bytes())


COPY_INLINE_BYTES = 256 * 1024  # region copies up to this size run on the event loop (cheaper than a thread hop)


def copy_bytes(tensors: list[ShmTensor]) -> int:
    """The bytes ``load``/``store`` of ``tensors`` copy."""
    return sum(t.nbytes for t in tensors if t.copy is not None)
