"""Triton's system shared-memory extension: regions of POSIX shared-memory objects (``/dev/shm``)
that inference requests read inputs from and write outputs into, instead of the body.

A region maps the whole object once at registration; tensors are NumPy views of the mapping,
checked to lie inside the region before any is made. A region unregistered while a request
still holds views of it stays mapped until the last view is gone (the mapping cannot be closed
under a live buffer export), so an unregister never pulls memory from under a forward.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import stat
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmad.errors import InvalidInput

SHM_DIR = "/dev/shm"
# a POSIX shared-memory name: one leading slash, no other (no way out of /dev/shm)
_KEY = re.compile(r"/[^/\x00]{1,255}")
_NAME_MAX = 256


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    mapping: mmap.mmap
    view: memoryview  # [offset, offset + byte_size) of the mapping

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

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

    def close(self) -> None:
        try:
            self.view.release()
            self.mapping.close()
        except BufferError:
            pass  # a request still holds views: the mapping closes when the last one is collected
        fd, self.fd = self.fd, -1  # a closed number may be reused by another file: never fstat it
        if fd >= 0:
            os.close(fd)


def _int_field(doc: dict[str, Any], name: str, default: int | None = None) -> int:
    value = doc.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"{name} must be a non-negative integer; got {value!r}")
    return value


class SharedMemoryRegistry:
    """The registered system shared-memory regions by name (thread-safe: large request headers
    are parsed on compute threads)."""

    def __init__(self) -> None:
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    def register(self, name: str, doc: Any) -> None:
        if not isinstance(doc, dict):
            raise InvalidInput('the register body must be a JSON object {"key", "offset", "byte_size"}')
        if not name or len(name) > _NAME_MAX:
            raise InvalidInput(f"the region name must be 1 to {_NAME_MAX} characters")
        key = doc.get("key")
        if not isinstance(key, str) or not _KEY.fullmatch(key) or key in ("/.", "/.."):
            raise InvalidInput(f"key must name a POSIX shared-memory object such as \"/my_region\" "
                               f"(one leading slash, no other); got {key!r}")
        offset = _int_field(doc, "offset", 0)
        byte_size = _int_field(doc, "byte_size")
        if byte_size == 0:
            raise InvalidInput("byte_size must be at least 1")
        with self._lock:
            if name in self._regions:
                raise InvalidInput(f"shared memory region {name!r} is already registered; unregister it first")
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
        region = Region(name, key, offset, byte_size, fd, mapping,
                        memoryview(mapping)[offset:offset + byte_size])
        with self._lock:
            if name in self._regions:  # registered by a concurrent request meanwhile
                region.close()
                raise InvalidInput(f"shared memory region {name!r} is already registered; unregister it first")
            self._regions[name] = region

    def unregister(self, name: str | None = None) -> None:
        """One region, or every region (``None``); an unknown name is no error (as Triton)."""
        with self._lock:
            if name is None:
                gone = list(self._regions.values())
                self._regions.clear()
            else:
                region = self._regions.pop(name, None)
                gone = [region] if region is not None else []
        for region in gone:
            region.close()

    def status(self, name: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            if name is None:
                return [r.status() for r in self._regions.values()]
            region = self._regions.get(name)
        if region is None:
            raise InvalidInput(f"unable to find system shared memory region {name!r}")
        return [region.status()]

    def close(self) -> None:
        self.unregister(None)

    def reference(self, where: str, params: dict[str, Any]) -> tuple[Region, int, int]:
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
        region.check_size()
        return region, offset, size

    def tensor(self, where: str, params: dict[str, Any], dtype: np.dtype, shape: tuple[int, ...],
               datatype: str, at_least: bool = False) -> np.ndarray:
        """A (shape, dtype) view of the region a tensor names. ``at_least``: the byte size may be
        larger than the tensor (an output's region), else it must equal it (an input's)."""
        region, offset, size = self.reference(where, params)
        needed = math.prod(shape) * dtype.itemsize
        if size < needed if at_least else size != needed:
            raise InvalidInput(f"{where}: shared_memory_byte_size is {size} bytes but shape {list(shape)} of "
                               f"{datatype} {'needs at least' if at_least else 'is'} {needed}")
        try:
            return np.frombuffer(region.view, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)
        except ValueError as exc:  # the view was released: unregistered since the lookup above
            raise InvalidInput(f"{where}: shared memory region {region.name!r} was unregistered") from exc
