"""The messages between a primary and its serving workers (``mmad serve --workers``), typed on
both sides and carried over the private sockets: JSON, and the engine calls a worker passes on
(JSON with the raw bytes of their tensors beside it)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import struct
import typing
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, create_model

from mmad.engine.api import InferenceClient, ModelStoreClient
from mmad.errors import MMADError


@dataclass(frozen=True)
class ServedModel:
    """One ready model of the primary, as a worker compiles and follows it."""

    name: str
    incarnation: str | None  # a new one each time the model is created or replaced
    generation: int  # moves whenever its live weights change
    spec: dict[str, Any]  # tiny-cuda-nn's JSON
    config: dict[str, Any]  # its serving config
    devices: list[Any]  # the devices of its replicas
    variant: str
    version: str  # its latest version

    @property
    def shape(self) -> tuple:
        """What, if it changes, needs the model compiled again (weights alone do not)."""
        return (self.incarnation, repr(self.spec), repr(sorted(self.config.items())), tuple(self.devices),
                self.variant)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ServedModel:
        return cls(**doc)


@dataclass(frozen=True)
class PrimaryState:
    """What a worker follows: the primary's ready models and shared-memory registrations, at
    least as new as ``generation`` (read first)."""

    generation: int
    backend: str
    models: list[ServedModel]
    shm: list[dict[str, Any]]  # the shared-memory registry's registrations, as it replays them

    def to_json(self) -> dict[str, Any]:
        return {"generation": self.generation, "backend": self.backend,
                "models": [m.to_json() for m in self.models], "shm": self.shm}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> PrimaryState:
        return cls(doc["generation"], doc["backend"], [ServedModel.from_json(m) for m in doc["models"]], doc["shm"])


@dataclass(frozen=True)
class HeldModel:
    """A worker's counts of one model it holds."""

    incarnation: str | None
    stats: dict[str, Any]  # Triton's statistics document of the model
    queued: int  # requests waiting in the worker's batcher


@dataclass(frozen=True)
class WorkerRecords:
    """A worker's statistics (per model) and metric samples, added to the primary's when asked for."""

    models: dict[str, HeldModel] = field(default_factory=dict)
    samples: list[list[Any]] = field(default_factory=list)  # Metrics.samples()

    def to_json(self) -> dict[str, Any]:
        return {"models": {name: asdict(held) for name, held in self.models.items()}, "samples": self.samples}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> WorkerRecords:
        return cls({name: HeldModel(**held) for name, held in doc["models"].items()}, doc["samples"])


# -- engine calls a serving worker passes to the primary --------------------------------------
#
# A worker's engine client (:mod:`mmad.engine.worker_client`) answers infer for the models it
# holds and passes every other call of the engine's interface to the primary's engine: the call's
# typed arguments (the caller among them) go as one message, and its typed result or error comes
# back. A message is an 8-byte little-endian length, a JSON document, then the raw bytes of the
# arrays and byte strings it names ({"$array": i, "dtype", "shape"}, {"$bytes": i}), each at a
# multiple of 64 bytes, so that tensors cross without a base64 or JSON copy of their values. The
# types are the method's annotations in :mod:`mmad.engine.api`, validated by pydantic on receipt.

_HEAD = struct.Struct("<Q")
_BLOB_ALIGN = 64
FORWARDED_PROTOCOLS = (InferenceClient, ModelStoreClient)
# every coroutine of the interfaces the in-process engine serves
ENGINE_METHODS = frozenset(name for proto in FORWARDED_PROTOCOLS for name in vars(proto)
                           if not name.startswith("_") and inspect.iscoroutinefunction(vars(proto)[name]))
_ARBITRARY = ConfigDict(arbitrary_types_allowed=True)  # NumPy arrays pass as themselves


def _protocol_method(method: str) -> Callable:
    for proto in FORWARDED_PROTOCOLS:
        if method in vars(proto):
            return vars(proto)[method]
    raise KeyError(f"{method!r} is not a method of the engine's interface")


@functools.cache
def _arguments_model(method: str) -> type[BaseModel]:
    hints = typing.get_type_hints(_protocol_method(method))
    hints.pop("return")
    params = inspect.signature(_protocol_method(method)).parameters
    fields = {name: (hint, ... if params[name].default is inspect.Parameter.empty else params[name].default)
              for name, hint in hints.items()}
    return create_model(f"{method}_arguments", __config__=_ARBITRARY, **fields)


@functools.cache
def _result_model(method: str) -> type[BaseModel]:
    return create_model(f"{method}_result", __config__=_ARBITRARY,
                        result=(typing.get_type_hints(_protocol_method(method))["return"], ...))


def _pack(value: Any, blobs: list) -> Any:
    """``value`` as JSON, its arrays and byte strings moved to ``blobs``."""
    if isinstance(value, np.ndarray):
        blobs.append(np.ascontiguousarray(value))
        return {"$array": len(blobs) - 1, "dtype": value.dtype.str, "shape": list(value.shape)}
    if isinstance(value, (bytes, bytearray, memoryview)):
        blobs.append(value)
        return {"$bytes": len(blobs) - 1}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # not asdict: it deep-copies arrays
        return {f.name: _pack(getattr(value, f.name), blobs) for f in dataclasses.fields(value)}
    if isinstance(value, dict):  # a key of the caller's own that starts with "$" gets one more
        return {"$" + key if key.startswith("$") else key: _pack(item, blobs) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_pack(item, blobs) for item in value]
    return value


def _unpack(doc: Any, blobs: list[memoryview]) -> Any:
    if isinstance(doc, dict):
        if "$array" in doc:
            return np.frombuffer(blobs[doc["$array"]], dtype=np.dtype(doc["dtype"])).reshape(doc["shape"])
        if "$bytes" in doc:
            return bytes(blobs[doc["$bytes"]])
        return {key[1:] if key.startswith("$") else key: _unpack(item, blobs) for key, item in doc.items()}
    if isinstance(doc, list):
        return [_unpack(item, blobs) for item in doc]
    return doc


def _encode(doc: dict[str, Any]) -> bytes:
    blobs: list = []
    packed = _pack(doc, blobs)
    views = [memoryview(b).cast("B") for b in blobs]
    offsets, at = [], 0
    for view in views:
        at = -(-at // _BLOB_ALIGN) * _BLOB_ALIGN
        offsets.append((at, view.nbytes))
        at += view.nbytes
    head = orjson.dumps({"doc": packed, "blobs": offsets})
    start = -(-(_HEAD.size + len(head)) // _BLOB_ALIGN) * _BLOB_ALIGN
    message = bytearray(start + at)
    _HEAD.pack_into(message, 0, len(head))
    message[_HEAD.size:_HEAD.size + len(head)] = head
    for view, (offset, size) in zip(views, offsets):
        message[start + offset:start + offset + size] = view
    return bytes(message)


def _decode(message: bytes) -> Any:
    (length,) = _HEAD.unpack_from(message)
    head = orjson.loads(memoryview(message)[_HEAD.size:_HEAD.size + length])
    start = -(-(_HEAD.size + length) // _BLOB_ALIGN) * _BLOB_ALIGN
    body = memoryview(message)[start:]
    return _unpack(head["doc"], [body[offset:offset + size] for offset, size in head["blobs"]])


def encode_call(method: str, arguments: dict[str, Any]) -> bytes:
    """A call of the engine's ``method`` with ``arguments`` (by name), as the primary reads it."""
    return _encode({"arguments": arguments})


def decode_call(method: str, message: bytes) -> dict[str, Any]:
    """The typed arguments of a call (:func:`encode_call`); a message that does not fit the
    method's annotations raises pydantic's ``ValidationError``."""
    arguments = _arguments_model(method).model_validate(_decode(message)["arguments"])
    return {name: getattr(arguments, name) for name in type(arguments).model_fields}


def encode_result(method: str, value: Any) -> bytes:
    return _encode({"result": value})


def _error_classes() -> dict[str, type[MMADError]]:
    found, todo = {}, [MMADError]
    while todo:
        cls = todo.pop()
        found[f"{cls.__module__}.{cls.__qualname__}"] = cls
        todo.extend(cls.__subclasses__())
    return found


def encode_error(exc: MMADError) -> bytes:
    """An error of mmad's tree as the caller's process raises it again: its class (with its bases,
    the nearest one this process knows is used), message and plain attributes (``retry_after_s``)."""
    names = [f"{cls.__module__}.{cls.__qualname__}" for cls in type(exc).__mro__ if issubclass(cls, MMADError)]
    attributes = {key: value for key, value in vars(exc).items()
                  if isinstance(value, (str, int, float, bool, type(None), list))}
    return _encode({"error": {"classes": names, "message": str(exc), "attributes": attributes}})


def decode_answer(method: str, message: bytes) -> Any:
    """The result of a call (:func:`encode_result`), or its error (:func:`encode_error`) raised."""
    doc = _decode(message)
    if "error" in doc:
        error, known = doc["error"], _error_classes()
        cls = next(known[name] for name in error["classes"] if name in known)
        exc = cls.__new__(cls)
        Exception.__init__(exc, error["message"])
        vars(exc).update(error["attributes"])
        raise exc
    return _result_model(method).model_validate({"result": doc["result"]}).result
