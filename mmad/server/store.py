"""The model store: one directory, every write atomic (temp file, fsync, rename, fsync dir).

Layout::

    <store>/models/<name>/model.json           spec + config
    <store>/models/<name>/versions.json        the acknowledged versions (the commit record)
    <store>/models/<name>/weights/<v>.safetensors     fp32 W{i}, b{i}
    <store>/models/<name>/optimizer/<v>.safetensors   optimizer slots + step
    <store>/datasets/<name>/<id>.safetensors    x, y of an uploaded training set

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
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load, save as st_save

from mmad.errors import (
    ConflictError, InvalidInput, ModelNotFound, MMADError, StorageFull, StoreUnwritable,
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
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def tensors_to_bytes(tensors: dict[str, np.ndarray]) -> bytes:
    return st_save({k: np.ascontiguousarray(v) for k, v in sorted(tensors.items())})


def tensors_from_bytes(data: bytes, what: str) -> dict[str, np.ndarray]:
    try:
        return st_load(data)
    except Exception as exc:  # safetensors raises its own SafetensorError on malformed input
        raise InvalidInput(f"{what} is not a valid safetensors file: {exc}") from exc


class Store:
    """One store directory; methods are thread-safe per model (one lock each).

    ``keep_versions``: how many versions of a model to keep (the newest); 0 keeps every one.
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
                     optimizer_state: dict[str, np.ndarray]) -> dict[str, Any]:
        """Write a complete model (version 1) next to the target, then swap it in.

        Replacing an existing model renames the old directory away first; a crash between the
        two renames loses the old model but never leaves a half-written one.
        """
        final = self.model_dir(name)
        staging = self.models_dir / f".new-{name}-{uuid.uuid4().hex}"
        try:
            with store_write(f"model {name!r}"):
                staging.mkdir()
                entry = self._write_version_files(staging, "1", params, optimizer_state, step=0)
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
            shutil.rmtree(trash, ignore_errors=True)
            shutil.rmtree(self.datasets_dir / name, ignore_errors=True)

    def read_model_doc(self, name: str) -> dict[str, Any]:
        return json.loads((self.model_dir(name) / "model.json").read_bytes())

    # -- versions -------------------------------------------------------------------------
    def versions(self, name: str) -> list[dict[str, Any]]:
        """The acknowledged listing, its shape checked (a damaged one raises MMADError); an entry's
        sha256 is checked with its file (``weights_bytes``), so one bad entry spoils only its version."""
        path = self.model_dir(name) / "versions.json"
        try:
            data = path.read_bytes()
        except FileNotFoundError as exc:
            raise ModelNotFound(f"unknown model {name!r}") from exc
        except OSError as exc:
            raise MMADError(f"the version listing of model {name!r} cannot be read: {exc.strerror}") from exc
        try:
            listing = json.loads(data)["versions"]
        except (ValueError, KeyError, TypeError) as exc:  # empty, truncated, flipped bytes, wrong shape
            raise MMADError(f"the version listing of model {name!r} is damaged (not the expected JSON)") from exc
        if not isinstance(listing, list) or not listing:
            raise MMADError(f"the version listing of model {name!r} is damaged: it lists no version")
        previous = 0
        for v in listing:
            if (not isinstance(v, dict) or not isinstance(v.get("version"), str)
                    or not VERSION_RE.match(v["version"]) or int(v["version"]) <= previous):
                raise MMADError(f"the version listing of model {name!r} is damaged: bad entry {v!r:.80}")
            if isinstance(v.get("step"), bool) or not isinstance(v.get("step"), int):
                raise MMADError(f"the version listing of model {name!r} is damaged: version {v['version']} "
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
                    incarnation: str | None = None) -> dict[str, Any]:
        """Persist a new version; when this returns, it survives a crash (it is acknowledged).

        ``incarnation`` (from :meth:`incarnation`) is the model the weights belong to: a model
        replaced since raises ConflictError, a deleted one ModelNotFound, and nothing is written.

        With ``keep_versions`` set, the same listing write drops the oldest versions beyond it;
        their files go after it (a crash in between leaves files no listing names, which
        ``remove_unlisted_files`` clears when the model loads).
        """
        model_dir = self.model_dir(name)
        with self.lock(name), store_write(f"a new version of model {name!r}"):
            self._check_incarnation(name, incarnation, "a new version")
            listing = self.versions(name)
            version = str(max((int(v["version"]) for v in listing), default=0) + 1)
            entry = self._write_version_files(model_dir, version, params, optimizer_state, step)
            listing.append(entry)
            dropped = listing[:-self.keep_versions] if self.keep_versions else []
            atomic_write(model_dir / "versions.json", _dump_json({"versions": listing[len(dropped):]}))
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

    def weights_bytes(self, name: str, version: str) -> bytes:
        entry = self.version_entry(name, version)
        try:
            data = (self.model_dir(name) / "weights" / f"{version}.safetensors").read_bytes()
        except OSError as exc:
            raise MMADError(f"stored weights of {name!r} version {version} cannot be read "
                            f"({exc.strerror or type(exc).__name__})") from exc
        expected = entry.get("sha256")
        if not isinstance(expected, str) or not SHA256_RE.match(expected):  # this version only: others serve
            raise MMADError(f"the listing of {name!r} version {version} has no valid sha256")
        if hashlib.sha256(data).hexdigest() != expected:
            raise MMADError(f"stored weights of {name!r} version {version} do not match their sha256")
        return data

    def load_version(self, name: str, version: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(params, optimizer state) of one acknowledged version, sha256-checked."""
        params = tensors_from_bytes(self.weights_bytes(name, version), f"weights of {name} v{version}")
        opt_path = self.model_dir(name) / "optimizer" / f"{version}.safetensors"
        try:
            data = opt_path.read_bytes()
        except OSError as exc:
            raise MMADError(f"stored optimizer state of {name!r} version {version} cannot be read "
                            f"({exc.strerror or type(exc).__name__})") from exc
        optimizer_state = tensors_from_bytes(data, f"optimizer state of {name} v{version}")
        return params, optimizer_state

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
    def add_dataset(self, name: str, data: bytes) -> str:
        dataset_id = uuid.uuid4().hex
        with self.lock(check_model_name(name)), store_write(f"a dataset of model {name!r}"):
            if not self.exists(name):  # a deleted model's datasets directory is not brought back
                raise ModelNotFound(f"unknown model {name!r}")
            atomic_write(self.datasets_dir / name / f"{dataset_id}.safetensors", data)
        return dataset_id

    def load_dataset(self, name: str, dataset_id: str) -> dict[str, np.ndarray]:
        if not DATASET_RE.match(dataset_id):
            raise InvalidInput(f"invalid dataset id {dataset_id!r}")
        path = self.datasets_dir / check_model_name(name) / f"{dataset_id}.safetensors"
        try:
            data = path.read_bytes()
        except FileNotFoundError as exc:
            raise ModelNotFound(f"model {name!r} has no dataset {dataset_id!r}") from exc
        return tensors_from_bytes(data, "dataset")


__all__ = ["Store", "atomic_write", "check_model_name", "check_version", "store_write", "tensors_to_bytes",
           "tensors_from_bytes", "MODEL_NAME_RE"]
