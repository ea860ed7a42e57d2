"""The model store: one directory, every write atomic (temp file, fsync, rename, fsync dir).

Layout::

    <store>/models/<name>/model.json           spec + config
    <store>/models/<name>/versions.json        the acknowledged versions (the commit record)
    <store>/models/<name>/weights/<v>.safetensors     fp32 W{i}, b{i}
    <store>/models/<name>/optimizer/<v>.safetensors   optimizer slots + step
    <store>/datasets/<name>/<id>/00000000.safetensors   x, y of an uploaded training set, chunk 0
    <store>/datasets/<name>/<id>/00000001.safetensors   ... chunk 1 (appended), and so on
    <store>/datasets/<name>/<id>.safetensors    a dataset as an earlier mmad wrote it (one chunk)
    <store>/datasets/.incoming/                 uploads being received (swept at startup)

A version exists once ``versions.json`` lists it: its weight and optimizer files are written
(and fsynced) first, the listing last, so a crash at any point leaves either the old listing or
the new one, never a listed version without its files. Files no listing names are leftovers of
an interrupted write and are removed at startup. No pickle: JSON and safetensors only.

Every writer of a model's directory (create, replace, delete, new versions and their pruning,
datasets) holds that model's lock, and a version writer names the *incarnation* of the model it
read its weights from: a model replaced or deleted meanwhile fails the write (409/404) instead of
receiving versions of another model or bringing a deleted directory back. An OSError of a write
leaves as ``StorageFull`` / ``StoreUnwritable`` / ``MMADError`` in the user's terms, without paths.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import orjson
from safetensors.numpy import load as st_load, save as st_save

from mmad.errors import (
    ConflictError, InvalidInput, ModelNotFound, MMADError, PayloadTooLarge, StorageFull, StoreDamaged, StoreUnwritable,
)

MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
VERSION_RE = re.compile(r"^[1-9][0-9]{0,17}$")
DATASET_RE = re.compile(r"^[0-9a-f]{32}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_FULL = {errno.ENOSPC, errno.EDQUOT}
_UNWRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM}


@contextlib.contextmanager
def store_write(what: str):
    """Turn an OSError of a store write into mmad's tree: 507 for a full or read-only store, else a
    plain error; the messages say what was not saved, never the path (it is the daemon's business)."""
    try:
        yield
    except OSError as exc:
        if exc.errno in _FULL:
            raise StorageFull(f"the model store is full (no space left on its disk or quota); {what} was "
                              "not saved and nothing served changed") from exc
        if exc.errno in _UNWRITABLE:
            raise StoreUnwritable(f"the model store is read-only or not writable by the daemon; {what} was "
                                  "not saved and nothing served changed") from exc
        raise MMADError(f"the model store could not save {what}: "
                        f"{exc.strerror or type(exc).__name__}") from exc


def check_model_name(name: str) -> str:
    if not MODEL_NAME_RE.match(name) or ".." in name:
        raise InvalidInput(
            f"invalid model name {name!r}: 1-64 characters from A-Z a-z 0-9 _ . -, starting with a "
            "letter or digit, no '..'")
    return name


def check_version(version: str) -> str:
    if not VERSION_RE.match(version):
        raise InvalidInput(f"invalid version {version!r}: a positive integer")
    return version


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def _dump_json(doc: Any) -> bytes:
    # orjson: a listing of 4,000 versions took the standard library 0.14 s to write (indented), 1 ms here
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)


def tensors_to_bytes(tensors: dict[str, np.ndarray]) -> bytes:
    return st_save({k: np.ascontiguousarray(v) for k, v in sorted(tensors.items())})


def check_safetensors_header(data: bytes, what: str, max_header_bytes: int) -> None:
    """Refuse a safetensors file whose header (8-byte little-endian length, then JSON) is longer
    than ``max_header_bytes``, before anything parses it: parsing holds the GIL (the event loop
    with it) and builds an object per entry, so a 200,000-entry header stalled every request for
    seconds and left the process hundreds of MiB larger."""
    if len(data) < 8:
        raise InvalidInput(f"{what} is not a safetensors file: it has {len(data)} bytes; the header length "
                           "alone needs 8")
    (length,) = struct.unpack_from("<Q", data)
    if length > max_header_bytes:
        raise InvalidInput(f"{what} has a safetensors header of {length} bytes; this model's parameters need at "
                           f"most {max_header_bytes}")


def tensors_from_bytes(data: bytes, what: str) -> dict[str, np.ndarray]:
    try:
        return st_load(data)
    except Exception as exc:  # safetensors raises its own SafetensorError on malformed input
        raise InvalidInput(f"{what} is not a valid safetensors file: {exc}") from exc


def _stored_tensors(data: bytes, what: str) -> dict[str, np.ndarray]:
    """A stored safetensors file's tensors: one that cannot be parsed is damaged (409), not bad input."""
    try:
        return tensors_from_bytes(data, what)
    except InvalidInput as exc:
        raise StoreDamaged(f"{exc} (damaged in the store)") from exc


class Store:
    """One store directory; methods are thread-safe per model (one lock each).

    ``keep_versions``: how many versions of a model to keep (the newest); 0 keeps every one (a
    model's own ``keep_versions``, passed to :meth:`add_version`, overrides it).

    Each model's version listing is read from disk once and then kept in memory, replaced by
    every listing this store writes (it alone writes the directory: ``daemon.lock``), so that
    neither start-up nor a new version re-reads a listing that grows with every version.
    """

    def __init__(self, root: Path, keep_versions: int = 0):
        if keep_versions < 0:
            raise InvalidInput(f"keep_versions must be 0 (keep all) or more; got {keep_versions}")
        self.keep_versions = keep_versions
        self.root = Path(root)
        self.models_dir = self.root / "models"
        self.datasets_dir = self.root / "datasets"
        try:
            self.models_dir.mkdir(parents=True, exist_ok=True)
            self.datasets_dir.mkdir(parents=True, exist_ok=True)
            self._lock_file = open(self.root / "daemon.lock", "a+b")
        except OSError as exc:
            raise MMADError(f"cannot create the model store at {self.root}: {exc}") from exc
        try:  # two daemons writing one store would interleave their version numbers
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self._lock_file.close()
            raise MMADError(f"the model store {self.root} is in use by another mmad daemon") from exc
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._incarnations: dict[str, str] = {}  # name -> id of the directory now in place
        self._listings: dict[str, list[dict[str, Any]]] = {}  # name -> the acknowledged listing as last written
        self.sweep_leftovers()

    def close(self) -> None:
        """Release the store for another daemon."""
        self._lock_file.close()

    def sweep_leftovers(self) -> int:
        """Remove what interrupted writes left: temp files, staging and trash directories (dot names)."""
        removed = 0
        for top in (self.models_dir, self.datasets_dir):
            for path in sorted(top.rglob(".*"), key=lambda p: -len(p.parts)):
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                removed += 1
        return removed

    def lock(self, name: str) -> threading.Lock:
        """The lock every writer of the model's directory holds (see the module docstring)."""
        with self._locks_guard:
            return self._locks.setdefault(name, threading.Lock())

    def incarnation(self, name: str) -> str:
        """An id of the model directory now in place; a replace or delete changes it."""
        with self.lock(name):
            if not self.exists(name):
                raise ModelNotFound(f"unknown model {name!r}")
            return self._incarnations.setdefault(name, uuid.uuid4().hex)

    def _check_incarnation(self, name: str, incarnation: str | None, what: str) -> None:
        """Under the model's lock: the directory is still the one the writer read its model from."""
        if not self.exists(name):
            raise ModelNotFound(f"model {name!r} was deleted; {what} was not saved")
        if incarnation is not None and self._incarnations.get(name) != incarnation:
            raise ConflictError(f"model {name!r} was replaced while {what} was being saved; it was not saved")

    def model_dir(self, name: str) -> Path:
        return self.models_dir / check_model_name(name)

    # -- models ---------------------------------------------------------------------------
    def list_models(self) -> list[str]:
        names = []
        for entry in sorted(self.models_dir.iterdir()):
            if (entry / "versions.json").is_file() and MODEL_NAME_RE.match(entry.name):
                names.append(entry.name)
        return names

    def exists(self, name: str) -> bool:
        return (self.model_dir(name) / "versions.json").is_file()

    def create_model(self, name: str, model_doc: dict[str, Any], params: dict[str, np.ndarray],
                     optimizer_state: dict[str, np.ndarray], version: str = "1") -> dict[str, Any]:
        """Write a complete model (its first version, ``version``: 1 unless it mirrors a model
        repository's numbers) next to the target, then swap it in.

        Replacing an existing model renames the old directory away first; a crash between the
        two renames loses the old model but never leaves a half-written one.
        """
        final = self.model_dir(name)
        staging = self.models_dir / f".new-{name}-{uuid.uuid4().hex}"
        try:
            with store_write(f"model {name!r}"):
                staging.mkdir()
                entry = self._write_version_files(staging, check_version(version), params, optimizer_state, step=0)
                atomic_write(staging / "model.json", _dump_json(model_doc))
                atomic_write(staging / "versions.json", _dump_json({"versions": [entry]}))
                with self.lock(name):  # the swap: no version writer is inside the old directory
                    if final.exists() or final.is_symlink():
                        trash = self.models_dir / f".old-{name}-{uuid.uuid4().hex}"
                        os.replace(final, trash)
                        os.replace(staging, final)
                        _fsync_dir(self.models_dir)
                        shutil.rmtree(trash, ignore_errors=True)
                    else:
                        os.replace(staging, final)
                        _fsync_dir(self.models_dir)
                    self._incarnations[name] = uuid.uuid4().hex
                    self._listings[name] = [entry]
                    shutil.rmtree(self.datasets_dir / name, ignore_errors=True)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return entry

    def delete_model(self, name: str) -> None:
        path = self.model_dir(name)
        with self.lock(name), store_write(f"the deletion of model {name!r}"):
            if not path.exists():
                raise ModelNotFound(f"unknown model {name!r}")
            trash = self.models_dir / f".old-{name}-{uuid.uuid4().hex}"
            os.replace(path, trash)
            _fsync_dir(self.models_dir)
            self._incarnations.pop(name, None)
            self._listings.pop(name, None)
            shutil.rmtree(trash, ignore_errors=True)
            shutil.rmtree(self.datasets_dir / name, ignore_errors=True)

    def read_model_doc(self, name: str) -> dict[str, Any]:
        """The model's description (spec and config); damaged or unreadable: StoreDamaged (409)."""
        try:
            doc = json.loads((self.model_dir(name) / "model.json").read_bytes())
        except FileNotFoundError as exc:
            raise ModelNotFound(f"unknown model {name!r}") from exc
        except OSError as exc:  # a directory in its place, no permission
            raise StoreDamaged(f"the description of model {name!r} (model.json) cannot be read: "
                               f"{exc.strerror or type(exc).__name__}") from exc
        except ValueError as exc:
            raise StoreDamaged(f"the description of model {name!r} (model.json) is damaged (not JSON)") from exc
        if not isinstance(doc, dict) or not isinstance(doc.get("spec"), dict):
            raise StoreDamaged(f"the description of model {name!r} (model.json) is damaged: it holds no spec")
        return doc

    # -- versions -------------------------------------------------------------------------
    def versions(self, name: str) -> list[dict[str, Any]]:
        """The acknowledged listing (a copy of the one kept in memory; read from disk the first
        time), its shape checked (a damaged one raises StoreDamaged); an entry's sha256 is checked
        with its file (``weights_bytes``), so one bad entry spoils only its version."""
        listing = self._listings.get(name)
        if listing is None:
            listing = self._listings[name] = self._read_versions(name)
        return list(listing)

    def _read_versions(self, name: str) -> list[dict[str, Any]]:
        path = self.model_dir(name) / "versions.json"
        try:
            data = path.read_bytes()
        except FileNotFoundError as exc:
            raise ModelNotFound(f"unknown model {name!r}") from exc
        except OSError as exc:
            raise StoreDamaged(f"the version listing of model {name!r} cannot be read: {exc.strerror}") from exc
        try:
            listing = orjson.loads(data)["versions"]
        except (ValueError, KeyError, TypeError) as exc:  # empty, truncated, flipped bytes, wrong shape
            raise StoreDamaged(f"the version listing of model {name!r} is damaged (not the expected JSON)") from exc
        if not isinstance(listing, list) or not listing:
            raise StoreDamaged(f"the version listing of model {name!r} is damaged: it lists no version")
        previous = 0
        for v in listing:
            if (not isinstance(v, dict) or not isinstance(v.get("version"), str)
                    or not VERSION_RE.match(v["version"]) or int(v["version"]) <= previous):
                raise StoreDamaged(f"the version listing of model {name!r} is damaged: bad entry {v!r:.80}")
            if isinstance(v.get("step"), bool) or not isinstance(v.get("step"), int):
                raise StoreDamaged(f"the version listing of model {name!r} is damaged: version {v['version']} "
                                   "has no step count")
            previous = int(v["version"])
        return listing

    def _write_version_files(self, model_dir: Path, version: str, params: dict[str, np.ndarray],
                             optimizer_state: dict[str, np.ndarray], step: int) -> dict[str, Any]:
        weights = tensors_to_bytes({k: np.asarray(v, dtype=np.float32) for k, v in params.items()})
        atomic_write(model_dir / "weights" / f"{version}.safetensors", weights)
        atomic_write(model_dir / "optimizer" / f"{version}.safetensors", tensors_to_bytes(optimizer_state))
        return {"version": version, "step": int(step), "created": time.time(),
                "sha256": hashlib.sha256(weights).hexdigest()}

    def add_version(self, name: str, params: dict[str, np.ndarray],
                    optimizer_state: dict[str, np.ndarray], step: int,
                    incarnation: str | None = None, keep_versions: int | None = None,
                    version: str | None = None) -> dict[str, Any]:
        """Persist a new version; when this returns, it survives a crash (it is acknowledged).

        ``version``: its number (a model repository's, mirrored), above the newest; by default the
        newest plus one.

        ``incarnation`` (from :meth:`incarnation`) is the model the weights belong to: a model
        replaced since raises ConflictError, a deleted one ModelNotFound, and nothing is written.

        With ``keep_versions`` (the model's, else the store's) set, the same listing write drops
        the oldest versions beyond it; their files go after it (a crash in between leaves files no
        listing names, which ``remove_unlisted_files`` clears when the model loads).
        """
        model_dir = self.model_dir(name)
        keep = self.keep_versions if keep_versions is None else keep_versions
        with self.lock(name), store_write(f"a new version of model {name!r}"):
            self._check_incarnation(name, incarnation, "a new version")
            listing = self.versions(name)
            newest = int(listing[-1]["version"])  # the listing is in increasing order, never empty
            if version is None:
                version = str(newest + 1)
            elif int(check_version(version)) <= newest:
                raise ConflictError(f"model {name!r} has version {newest} already; a new version is numbered "
                                    f"above it, not {version}")
            entry = self._write_version_files(model_dir, version, params, optimizer_state, step)
            listing.append(entry)
            dropped = listing[:-keep] if keep else []
            kept = listing[len(dropped):]
            atomic_write(model_dir / "versions.json", _dump_json({"versions": kept}))
            self._listings[name] = kept
            for old in dropped:
                for sub in ("weights", "optimizer"):
                    (model_dir / sub / f"{old['version']}.safetensors").unlink(missing_ok=True)
        return entry

    def version_entry(self, name: str, version: str) -> dict[str, Any]:
        check_version(version)
        for entry in self.versions(name):
            if entry["version"] == version:
                return entry
        raise ModelNotFound(f"model {name!r} has no version {version!r}")

    def _version_file(self, name: str, version: str, sub: str, what: str) -> bytes:
        """A stored file of a listed version: one the retention dropped meanwhile is ModelNotFound
        (404), one that is missing or unreadable otherwise StoreDamaged (409)."""
        try:
            return (self.model_dir(name) / sub / f"{version}.safetensors").read_bytes()
        except OSError as exc:
            if not any(v["version"] == version for v in self.versions(name)):
                raise ModelNotFound(f"model {name!r} has no version {version!r} (dropped by keep_versions)") from exc
            raise StoreDamaged(f"stored {what} of {name!r} version {version} cannot be read "
                               f"({exc.strerror or type(exc).__name__})") from exc

    def weights_bytes(self, name: str, version: str, entry: dict[str, Any] | None = None) -> bytes:
        """A version's weights file, checked against its listing entry's sha256 (``entry``: that
        entry, when the caller holds the listing already)."""
        entry = entry if entry is not None else self.version_entry(name, version)
        data = self._version_file(name, version, "weights", "weights")
        expected = entry.get("sha256")
        if not isinstance(expected, str) or not SHA256_RE.match(expected):  # this version only: others serve
            raise StoreDamaged(f"the listing of {name!r} version {version} has no valid sha256")
        if hashlib.sha256(data).hexdigest() != expected:
            raise StoreDamaged(f"stored weights of {name!r} version {version} do not match their sha256")
        return data

    def version_files_present(self, name: str, version: str) -> None:
        """StoreDamaged unless the version's weights file is there (what start-up checks of the
        versions it does not load: their sha256 is checked when they are read)."""
        path = self.model_dir(name) / "weights" / f"{version}.safetensors"
        try:
            if path.stat().st_size > 0:
                return
        except OSError as exc:
            raise StoreDamaged(f"stored weights of {name!r} version {version} cannot be read "
                               f"({exc.strerror or type(exc).__name__})") from exc
        raise StoreDamaged(f"stored weights of {name!r} version {version} are empty")

    def load_version(self, name: str, version: str, entry: dict[str, Any] | None = None,
                     optimizer: bool = True) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
        """(params, optimizer state or None without ``optimizer``) of one acknowledged version,
        sha256-checked; a damaged one is StoreDamaged (409)."""
        params = _stored_tensors(self.weights_bytes(name, version, entry), f"the weights of {name!r} version {version}")
        if not optimizer:
            return params, None
        data = self._version_file(name, version, "optimizer", "optimizer state")
        return params, _stored_tensors(data, f"the optimizer state of {name!r} version {version}")

    def remove_unlisted_files(self, name: str) -> int:
        """Delete weight/optimizer files of versions that were never acknowledged."""
        removed = 0
        with self.lock(name):
            listed = {v["version"] for v in self.versions(name)}
            for sub in ("weights", "optimizer"):
                folder = self.model_dir(name) / sub
                if not folder.is_dir():  # missing or not a directory: the load reports the damage
                    continue
                for path in folder.glob("*"):
                    if path.name.startswith(".") or path.name.removesuffix(".safetensors") not in listed:
                        path.unlink(missing_ok=True)
                        removed += 1
        return removed

    # -- datasets -------------------------------------------------------------------------
    # A dataset is a directory of chunk files ``00000000.safetensors``, ``00000001.safetensors``,
    # ... (x, y each), added one at a time, each complete when it appears (renamed into place after
    # an fsync); rows, dtypes and sizes come from the chunk headers, nothing else is kept. A store
    # written by an earlier mmad holds datasets as one file ``<id>.safetensors``: read as a
    # dataset of one chunk (and turned into a directory when a chunk is appended to it).
    def incoming_path(self) -> Path:
        """Where a received upload is written before it is checked and moved into place: a dot
        directory of the store (on its filesystem, so the move is a rename; swept at startup)."""
        folder = self.datasets_dir / ".incoming"
        with store_write("the upload"):
            folder.mkdir(exist_ok=True)
        return folder / f"{uuid.uuid4().hex}.tmp"

    def _dataset_dir(self, name: str) -> Path:
        return self.datasets_dir / check_model_name(name)

    def _chunk_paths(self, name: str, dataset_id: str) -> list[Path]:
        """The dataset's chunk files in order; ModelNotFound when it has none."""
        check_dataset_id(dataset_id)
        folder = self._dataset_dir(name) / dataset_id
        try:
            paths = sorted(p for p in folder.iterdir() if CHUNK_RE.match(p.name))
        except (FileNotFoundError, NotADirectoryError):
            paths = []
        if not paths:
            legacy = folder.with_name(f"{dataset_id}.safetensors")  # written by an earlier mmad
            if legacy.is_file():
                return [legacy]
            raise ModelNotFound(f"model {name!r} has no dataset {dataset_id!r}")
        return paths

    def dataset_info(self, name: str, dataset_id: str) -> DatasetInfo:
        """Rows, dtypes, sizes and chunks of one dataset, from the chunk headers only."""
        chunks = []
        for i, path in enumerate(self._chunk_paths(name, dataset_id)):
            try:
                chunks.append((path, read_chunk_header(path)))
            except FileNotFoundError as exc:
                raise ModelNotFound(f"model {name!r} has no dataset {dataset_id!r} (it was deleted)") from exc
            except InvalidInput as exc:  # changed behind the daemon's back: not the request's fault
                raise MMADError(f"chunk {i} of dataset {dataset_id!r} of model {name!r} is damaged: {exc}") from exc
        return DatasetInfo.of(name, dataset_id, chunks)

    def list_datasets(self, name: str) -> list[DatasetInfo]:
        folder = self._dataset_dir(name)
        ids = set()
        if folder.is_dir():
            for p in folder.iterdir():
                stem = p.name.removesuffix(".safetensors")
                if DATASET_RE.match(stem) and (p.is_dir() or p.name.endswith(".safetensors")):
                    ids.add(stem)
        out = []
        for dataset_id in sorted(ids):
            try:
                out.append(self.dataset_info(name, dataset_id))
            except ModelNotFound:  # deleted meanwhile, or an empty directory
                continue
        return out

    def add_dataset(self, name: str, chunk: Path, header: ChunkHeader, max_bytes: int | None = None,
                    incarnation: str | None = None) -> DatasetInfo:
        """A new dataset of one chunk: ``chunk`` (a checked, fsynced file from :meth:`incoming_path`)
        is moved into a staging directory that is then renamed into place."""
        dataset_id = uuid.uuid4().hex
        check_dataset_size(chunk.stat().st_size, max_bytes)
        folder = self._dataset_dir(name)
        with self.lock(name), store_write(f"a dataset of model {name!r}"):
            self._check_incarnation(name, incarnation, "the dataset")  # a deleted model's datasets stay gone
            if not folder.is_dir():
                folder.mkdir(parents=True)
                _fsync_dir(folder.parent)
            staging = folder / f".new-{dataset_id}"
            staging.mkdir()
            try:
                os.replace(chunk, staging / chunk_name(0))
                _fsync_dir(staging)
                os.replace(staging, folder / dataset_id)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            _fsync_dir(folder)
        return DatasetInfo.of(name, dataset_id, [(folder / dataset_id / chunk_name(0), header)])

    def append_dataset_chunk(self, name: str, dataset_id: str, chunk: Path, header: ChunkHeader,
                             max_bytes: int | None = None, incarnation: str | None = None) -> DatasetInfo:
        """Add ``chunk`` (a checked, fsynced file) as the dataset's next chunk; its dtypes and column
        counts must be the first chunk's, and the dataset must stay within ``max_bytes``."""
        with self.lock(name), store_write(f"a chunk of dataset {dataset_id!r}"):
            self._check_incarnation(name, incarnation, "the chunk")
            info = self.dataset_info(name, dataset_id)
            check_same_layout(info.chunks[0][1], header)
            check_dataset_size(info.bytes + chunk.stat().st_size, max_bytes)
            folder = self._dataset_dir(name) / dataset_id
            if len(info.chunks) == 1 and info.chunks[0][0].parent != folder:
                self._legacy_to_directory(info.chunks[0][0], folder)
            target = folder / chunk_name(len(info.chunks))
            os.replace(chunk, target)
            _fsync_dir(folder)
            return DatasetInfo.of(name, dataset_id, [*((folder / chunk_name(i), h) for i, (_, h) in
                                                       enumerate(info.chunks)), (target, header)])

    @staticmethod
    def _legacy_to_directory(legacy: Path, folder: Path) -> None:
        """An earlier mmad's one-file dataset becomes a directory holding it as chunk 0: linked (or
        copied) into a staging directory renamed into place, and only then the file removed, so
        a crash leaves the file, the directory, or both (the directory is read first)."""
        staging = folder.with_name(f".new-{folder.name}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            try:
                os.link(legacy, staging / chunk_name(0))
            except OSError:
                shutil.copyfile(legacy, staging / chunk_name(0))
                with open(staging / chunk_name(0), "rb") as f:
                    os.fsync(f.fileno())
            _fsync_dir(staging)
            os.replace(staging, folder)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _fsync_dir(folder.parent)
        legacy.unlink()
        _fsync_dir(folder.parent)

    def delete_dataset(self, name: str, dataset_id: str) -> None:
        check_dataset_id(dataset_id)
        folder = self._dataset_dir(name)
        with self.lock(name), store_write(f"the deletion of dataset {dataset_id!r}"):
            self._chunk_paths(name, dataset_id)  # ModelNotFound when there is no such dataset
            if (folder / dataset_id).exists():
                trash = folder / f".old-{dataset_id}-{uuid.uuid4().hex}"
                os.replace(folder / dataset_id, trash)
                shutil.rmtree(trash, ignore_errors=True)
            (folder / f"{dataset_id}.safetensors").unlink(missing_ok=True)
            _fsync_dir(folder)

    def dataset_chunks(self, info: DatasetInfo) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(x, y) of each chunk in order, memory-mapped one chunk at a time (read-only views of the
        files: the whole dataset is never in host memory at once)."""
        for path, header in info.chunks:
            try:
                yield chunk_arrays(path, header)
            except FileNotFoundError as exc:
                raise ModelNotFound(f"dataset {info.dataset!r} of model {info.model!r} was deleted while "
                                    "it was being read") from exc

    def load_dataset(self, name: str, dataset_id: str) -> dict[str, np.ndarray]:
        """The whole dataset in host memory ({"x", "y"}, the chunks concatenated): for callers that
        need it at once; training jobs read the chunks (:meth:`dataset_chunks`) instead."""
        info = self.dataset_info(name, dataset_id)
        chunks = list(self.dataset_chunks(info))
        return {"x": np.concatenate([c[0] for c in chunks]), "y": np.concatenate([c[1] for c in chunks])}


# -- dataset chunks: safetensors files read by their header ----------------------------------
CHUNK_RE = re.compile(r"^[0-9]{8}\.safetensors$")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
_CHUNK_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2")}
_TYPE_WORDS = {"F64": "float64 values", "BF16": "bfloat16 values", "F8_E4M3": "float8 values",
               "F8_E5M2": "float8 values", "BOOL": "true/false values",
               "I8": "integers (int8)", "I16": "integers (int16)", "I32": "integers (int32)",
               "I64": "integers (int64)", "U8": "integers (uint8)", "U16": "integers (uint16)",
               "U32": "integers (uint32)", "U64": "integers (uint64)"}


def chunk_name(index: int) -> str:
    return f"{index:08d}.safetensors"


def check_dataset_id(dataset_id: str) -> str:
    if not DATASET_RE.match(dataset_id):
        raise InvalidInput(f"invalid dataset id {dataset_id!r}: 32 hexadecimal digits, as uploading it answered")
    return dataset_id


def dtype_words(dtype: Any) -> str:
    """float32 / float16, never NumPy's type codes."""
    return np.dtype(dtype).name


def size_words(n: int) -> str:
    """Bytes in the largest unit that keeps a number of at least 1: 17.2 GiB, 3.0 MiB, 512 bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def check_dataset_size(total: int, max_bytes: int | None) -> None:
    """PayloadTooLarge (413) when a dataset of ``total`` bytes exceeds the daemon's limit."""
    if max_bytes is not None and total > max_bytes:
        would, limit = size_words(total), size_words(max_bytes)
        if would == limit:  # "1.0 MiB; the limit is 1.0 MiB" would say nothing
            would, limit = f"{would} ({total} bytes)", f"{limit} ({max_bytes} bytes)"
        raise PayloadTooLarge(f"the dataset would hold {would}; this daemon's limit (--max-dataset-bytes) is {limit}")


@dataclass(frozen=True)
class ChunkHeader:
    """What a chunk's safetensors header says: rows, each tensor's dtype, columns and byte offset."""

    rows: int
    x_dtype: np.dtype
    y_dtype: np.dtype
    x_cols: int
    y_cols: int
    x_offset: int  # from the start of the file
    y_offset: int
    nbytes: int  # the file's size


def read_chunk_header(path: Path, what: str = "the dataset chunk") -> ChunkHeader:
    """Parse a chunk's header (8-byte little-endian length + JSON) without reading its data, and
    check it as the reference reader does (the tensors tile the data exactly) plus mmad's rules:
    exactly ``x`` and ``y``, 2-D, float32 or float16, the same rows (at least one)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise InvalidInput(f"{what} is not a safetensors file: it has {size} bytes; the header length "
                               "alone needs 8")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise InvalidInput(f"{what} is not a safetensors file: its header length {length} does not fit "
                               f"its {size} bytes")
        raw = f.read(length)
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise InvalidInput(f"{what} is not a safetensors file: its header is not JSON") from exc
    if not isinstance(doc, dict):
        raise InvalidInput(f"{what} is not a safetensors file: its header is not a JSON object")
    doc.pop("__metadata__", None)
    if set(doc) != {"x", "y"}:
        raise InvalidInput(f"a dataset chunk holds exactly the tensors x and y; {what} holds "
                           f"{', '.join(sorted(map(str, doc))) or 'none'}")
    start, payload = 8 + length, size - 8 - length
    spans, parsed = [], {}
    for name in ("x", "y"):
        entry = doc[name]
        try:
            kind, shape = entry["dtype"], [int(d) for d in entry["shape"]]
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInput(f"{what} is not a safetensors file: the entry of {name} is malformed") from exc
        if kind not in _CHUNK_DTYPES:
            raise InvalidInput(f"dataset {name} must be float32 or float16 numbers; {what} holds "
                               f"{_TYPE_WORDS.get(kind, str(kind))}")
        if len(shape) != 2 or min(shape) < 0:
            raise InvalidInput(f"dataset {name} must have shape [rows, columns]; {what} has {shape}")
        dtype = _CHUNK_DTYPES[kind]
        if not 0 <= begin <= end <= payload or end - begin != shape[0] * shape[1] * dtype.itemsize:
            raise InvalidInput(f"{what} is not a safetensors file: the bytes {begin}..{end} of {name} do not hold "
                               f"{shape[0]} x {shape[1]} {dtype_words(dtype)} values within its {payload} bytes")
        spans.append((begin, end, name))
        parsed[name] = (dtype, shape, start + begin)
    cursor = 0
    for begin, end, name in sorted(spans):
        if begin != cursor:
            raise InvalidInput(f"{what} is not a safetensors file: {name} starts at byte {begin}, not {cursor}")
        cursor = end
    if cursor != payload:
        raise InvalidInput(f"{what} is not a safetensors file: {payload - cursor} bytes follow its tensors")
    (x_dtype, x_shape, x_offset), (y_dtype, y_shape, y_offset) = parsed["x"], parsed["y"]
    if x_shape[0] != y_shape[0] or x_shape[0] == 0:
        raise InvalidInput(f"dataset x has {x_shape[0]} rows and y {y_shape[0]} in {what}; they must match and "
                           "be > 0")
    return ChunkHeader(x_shape[0], x_dtype, y_dtype, x_shape[1], y_shape[1], x_offset, y_offset, size)


def chunk_arrays(path: Path, header: ChunkHeader) -> tuple[np.ndarray, np.ndarray]:
    """A chunk's (x, y) as read-only memory maps of its file."""
    x = np.memmap(path, dtype=header.x_dtype, mode="r", offset=header.x_offset, shape=(header.rows, header.x_cols))
    y = np.memmap(path, dtype=header.y_dtype, mode="r", offset=header.y_offset, shape=(header.rows, header.y_cols))
    return x, y


def check_same_layout(first: ChunkHeader, chunk: ChunkHeader) -> None:
    """A chunk appended to a dataset has the first chunk's dtypes and columns (400 naming what differs)."""
    for name in ("x", "y"):
        ours, theirs = getattr(chunk, f"{name}_dtype"), getattr(first, f"{name}_dtype")
        if ours != theirs:
            raise InvalidInput(f"{name} is {dtype_words(ours)} in this chunk but {dtype_words(theirs)} in the "
                               "dataset's first chunk; every chunk of a dataset has the same types")
        ours, theirs = getattr(chunk, f"{name}_cols"), getattr(first, f"{name}_cols")
        if ours != theirs:
            raise InvalidInput(f"{name} has {ours} columns in this chunk but {theirs} in the dataset's first chunk")


@dataclass(frozen=True)
class DatasetInfo:
    """One stored dataset: its chunks (path, header) in order and what they add up to."""

    model: str
    dataset: str
    chunks: list[tuple[Path, ChunkHeader]]
    rows: int
    bytes: int
    x_dtype: np.dtype
    y_dtype: np.dtype

    @classmethod
    def of(cls, model: str, dataset: str, chunks: list[tuple[Path, ChunkHeader]]) -> "DatasetInfo":
        first = chunks[0][1]
        return cls(model, dataset, chunks, sum(h.rows for _, h in chunks), sum(h.nbytes for _, h in chunks),
                   first.x_dtype, first.y_dtype)

    def to_json(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "rows": self.rows, "bytes": self.bytes,
                "x_dtype": dtype_words(self.x_dtype), "y_dtype": dtype_words(self.y_dtype), "chunks": len(self.chunks)}


__all__ = ["Store", "atomic_write", "check_model_name", "check_version", "check_safetensors_header", "store_write",
           "tensors_to_bytes",
           "tensors_from_bytes", "MODEL_NAME_RE", "ChunkHeader", "DatasetInfo", "read_chunk_header", "chunk_arrays",
           "check_dataset_id", "check_dataset_size", "size_words"]
