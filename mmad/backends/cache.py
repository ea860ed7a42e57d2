"""On-disk kernel cache: content-keyed, checksummed, written atomically (CuPy's scheme).

The key is a SHA-256 over everything that changes the compiled bytes: backend, device or
architecture, compiler version, options, the source text and the layout version. An entry is
``<dir>/<key[:2]>/<key>.bin``: a JSON header line (key parts, payload SHA-256, length) followed
by the payload. A reader that finds a truncated, corrupt or mismatching entry deletes it and
rebuilds; writers go through a temp file, fsync and rename, so a crash never leaves a partial
entry under the real name. The directory is ``MMAD_CACHE_DIR`` or ``~/.cache/mmad/kernels``.

Within a process, concurrent ``get_or_build`` calls for one entry build it once: the others wait
for that build (kernels of several variants share modules, and the dispatcher compiles the
variants side by side on :func:`compile_pool`'s threads).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mmad.errors import CacheError

LAYOUT_VERSION = 1  # bump when packing or kernel-interface conventions change
# compilers that release the GIL (a subprocess: glslang, nvcc; NVRTC through CuPy) run this many
# at once: the kernels of one model, or the variants the dispatcher measures, compile side by side
COMPILE_THREADS = max(2, min(8, os.cpu_count() or 2))
COMPILE_THREAD_NAME = "mmad-compile"

_building: dict[tuple[str, str], threading.Event] = {}  # (directory, key) -> set when that build ends
_building_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def compile_pool() -> ThreadPoolExecutor:
    """The process's compiler threads (``COMPILE_THREADS``), made on first use."""
    global _pool
    with _building_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix=COMPILE_THREAD_NAME)
        return _pool


def build_all(builds: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Every ``builds[name]()`` run on :func:`compile_pool`'s threads; their results by name (the
    first exception, if any, raised once all have ended). Called on one of those threads (a
    build that builds several things), they run there in turn: a pool waiting on itself could
    hold every thread."""
    if len(builds) < 2 or threading.current_thread().name.startswith(COMPILE_THREAD_NAME):
        return {name: build() for name, build in builds.items()}
    futures = {name: compile_pool().submit(build) for name, build in builds.items()}
    return {name: future.result() for name, future in futures.items()}


def default_cache_dir() -> Path:
    env = os.environ.get("MMAD_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mmad" / "kernels"


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    rebuilt_corrupt: int = 0


class KernelCache:
    """Compile-once storage for kernel binaries (SPIR-V, cubin, PTX, WGSL pipelines...)."""

    def __init__(self, directory: str | os.PathLike[str] | None = None):
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.stats = CacheStats()
        self._lock = threading.Lock()

    @staticmethod
    def key(*, backend: str, device: str, compiler: str, options: Any, source: str,
            layout_version: int = LAYOUT_VERSION) -> tuple[str, dict[str, Any]]:
        parts = {
            "backend": backend, "device": device, "compiler": compiler, "options": options,
            "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
            "layout_version": layout_version,
        }
        blob = json.dumps(parts, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest(), parts

    def _path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.bin"

    def load(self, key: str) -> bytes | None:
        """The payload stored under ``key``, or None (a bad entry is removed)."""
        path = self._path(key)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CacheError(f"cannot read kernel cache entry {path}: {exc}") from exc
        header, sep, payload = raw.partition(b"\n")
        try:
            meta = json.loads(header) if sep else None
        except ValueError:
            meta = None
        if (not meta or meta.get("key") != key or meta.get("length") != len(payload)
                or meta.get("sha256") != hashlib.sha256(payload).hexdigest()):
            with self._lock:
                self.stats.rebuilt_corrupt += 1
            path.unlink(missing_ok=True)
            return None
        return payload

    def store(self, key: str, payload: bytes, parts: dict[str, Any] | None = None) -> Path:
        path = self._path(key)
        header = json.dumps({"key": key, "length": len(payload),
                             "sha256": hashlib.sha256(payload).hexdigest(), "parts": parts or {}},
                            sort_keys=True, default=str).encode()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".bin")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(header + b"\n" + payload)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            raise CacheError(f"cannot write kernel cache entry under {self.directory}: {exc}") from exc
        return path

    def get_or_build(self, build: Callable[[], bytes], **key_parts: Any) -> bytes:
        """The cached payload for these key parts, building (and storing) it on a miss. While
        another thread of this process builds the same entry, this one waits and reads it (or,
        should that build fail, builds it itself)."""
        key, parts = self.key(**key_parts)
        slot = (str(self.directory), key)
        while True:
            payload = self._load_counted(key)
            if payload is not None:
                return payload
            with _building_lock:
                running = _building.get(slot)
                if running is None:
                    _building[slot] = threading.Event()
                    break
            running.wait()
        try:
            payload = self._load_counted(key)  # stored between the look above and the claim
            if payload is not None:
                return payload
            with self._lock:
                self.stats.misses += 1
            payload = build()
            self.store(key, payload, parts)
            return payload
        finally:
            with _building_lock:
                _building.pop(slot).set()

    def _load_counted(self, key: str) -> bytes | None:
        payload = self.load(key)
        if payload is not None:
            with self._lock:
                self.stats.hits += 1
        return payload

    def clear(self) -> int:
        """Remove every entry; returns how many were removed."""
        removed = 0
        if self.directory.exists():
            for entry in self.directory.glob("*/*.bin"):
                entry.unlink(missing_ok=True)
                removed += 1
        return removed
