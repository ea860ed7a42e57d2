"""On-disk kernel cache: content-keyed, checksummed, written atomically (CuPy's scheme).

The key is a SHA-256 over everything that changes the compiled bytes: backend, device or
architecture, compiler version, options, the source text and the layout version. An entry is
``<dir>/<key[:2]>/<key>.bin``: a JSON header line (key parts, payload SHA-256, length) followed
by the payload. A reader that finds a truncated, corrupt or mismatching entry deletes it and
rebuilds; writers go through a temp file, fsync and rename, so a crash never leaves a partial
entry under the real name. The directory is ``MMAD_CACHE_DIR`` or ``~/.cache/mmad/kernels``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mmad.errors import CacheError

LAYOUT_VERSION = 1  # bump when packing or kernel-interface conventions change


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
        """The cached payload for these key parts, building (and storing) it on a miss."""
        key, parts = self.key(**key_parts)
        with self._lock:
            payload = self.load(key)
            if payload is not None:
                self.stats.hits += 1
                return payload
            self.stats.misses += 1
        payload = build()
        self.store(key, payload, parts)
        return payload

    def clear(self) -> int:
        """Remove every entry; returns how many were removed."""
        removed = 0
        if self.directory.exists():
            for entry in self.directory.glob("*/*.bin"):
                entry.unlink(missing_ok=True)
                removed += 1
        return removed
