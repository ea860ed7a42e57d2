"""Inference request/response bodies: OIP v2 JSON and Triton's binary tensor extension.

A binary request is a JSON header of ``Inference-Header-Content-Length`` bytes followed by the
raw little-endian tensors, in input order, each ``parameters.binary_data_size`` bytes long.
Every length is checked against the body before any tensor is read (``np.frombuffer`` views,
no copies); anything inconsistent is an :class:`~mmad.errors.InvalidInput` (HTTP 400).
FP16 travels only as binary data, as Triton does.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson

from mmad.errors import InvalidInput
from mmad.engine import hostmem
from mmad.engine.api import WIRE_DTYPES
from mmad.engine.inference import OutputChoice, ParsedRequest

JSON_DTYPES = ("FP32",)
MAX_ELEMENTS = 1 << 31
# Binary tensor data starts at a multiple of this in a response body (the JSON header is padded
# with spaces): NumPy runs its fast loops only on aligned arrays; unaligned FP16/FP32 views made
# a 65,536-row request's casts several ms slower.
DATA_ALIGN = 64


def _padded_header(doc: dict[str, Any]) -> bytes:
    json_bytes = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    return json_bytes + b" " * (-len(json_bytes) % DATA_ALIGN)


def _response_body(json_bytes: bytes, data_bytes: int) -> np.ndarray:
    """A response body: ``json_bytes`` then ``data_bytes`` left for the tensors to be written.

    Uninitialised, not a ``bytearray``, which would first zero the whole body (8 MiB for a
    65,536-row FP16 response) on the event loop; page-locked where the backend copies from a
    GPU (:mod:`mmad.engine.hostmem`), so the forward's output lands in it straight off the device.
    """
    body = hostmem.empty(len(json_bytes) + data_bytes)
    body[:len(json_bytes)] = np.frombuffer(json_bytes, dtype=np.uint8)
    return body


def parse_header_length(value: str | None, body_len: int) -> int | None:
    if value is None:
        return None
    try:
        length = int(value)
    except ValueError as exc:
        raise InvalidInput(f"Inference-Header-Content-Length must be an integer; got {value!r}") from exc
    if length < 0:
        raise InvalidInput(f"Inference-Header-Content-Length must not be negative; got {length}")
    if length > body_len:
        raise InvalidInput(
            f"Inference-Header-Content-Length {length} is past the end of the body ({body_len} bytes)")
    return length


def _shape(where: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise InvalidInput(f"{where}.shape must be a non-empty list of non-negative integers; got {value!r}")
    if math.prod(value) > MAX_ELEMENTS:
        raise InvalidInput(f"{where}.shape {value} has more than {MAX_ELEMENTS} elements")
    return tuple(value)


def _bool_parameter(where: str, params: dict[str, Any], name: str) -> None:
    """Triton refuses parameters of the wrong type (the string "false" is no boolean: read as
    truthy, it asked for the opposite)."""
    if name in params and not isinstance(params[name], bool):
        raise InvalidInput(f"{where}.{name} must be a boolean (true or false); got {_json_word(params[name])}")


def _has_bool(data: Any) -> bool:
    """Whether nested JSON arrays hold a boolean: NumPy reads ``[true, 0.5]`` as ``[1.0, 0.5]``."""
    if isinstance(data, list):
        if data and isinstance(data[0], list):
            return any(_has_bool(row) for row in data)
        return bool in map(type, data)
    return type(data) is bool


def _json_data(where: str, data: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Nested or flat JSON numbers → float32 of ``shape``; errors in the request's own terms."""
    try:
        array = np.array(data)
    except (ValueError, TypeError) as exc:  # ragged nesting, or numbers beside lists
        raise InvalidInput(f"{where}.data must be numbers, nested like the shape or flat; its rows have "
                           "different lengths (or mix numbers and lists)") from exc
    if _has_bool(data):  # NumPy would read true as 1.0 (Triton refuses it)
        raise InvalidInput(f"{where}.data must hold only numbers; got true or false (booleans)")
    if array.dtype.kind not in "fiu":  # text, null, or integers too large for 64 bits
        for v in array.flat:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise InvalidInput(f"{where}.data must hold only numbers; got {_json_word(v)}")
        array = array.astype(np.float64)  # Python integers beyond 64 bits: become Inf below
    with np.errstate(over="ignore"):  # out-of-range numbers become Inf, refused by the finiteness check
        array = array.astype(np.float32)
    if array.size != math.prod(shape):
        raise InvalidInput(f"{where}.data holds {array.size} numbers but shape {list(shape)} needs "
                           f"{math.prod(shape)}")
    if array.ndim > 1 and array.shape != shape:
        raise InvalidInput(f"{where}.data is nested as {list(array.shape)} but shape is {list(shape)}")
    return array.reshape(shape)


def _json_word(value: Any) -> str:
    """How a JSON value that is not a number reads in an error: null, true, "text"."""
    if value is None:
        return "null"
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, (str, np.str_)):
        text = str(value)
        return "the text " + orjson.dumps(text if len(text) <= 20 else text[:17] + "...").decode()
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    return f"a {type(value).__name__}"


def parse_infer_request(body: bytes, header_length: int | None, shm: Any = None,
                        resolve_shm: bool = True) -> ParsedRequest:
    """Split and validate a request body; tensors come back as float32/float16 arrays.

    ``shm``: the :class:`~mmad.engine.shm.SharedMemoryRegistry` of the regions that inputs
    naming a ``shared_memory_region`` lie in: device arrays in a CUDA region; for a system
    region, a buffer of the daemon's, filled by ``ShmTensor.load`` once the caller knows where
    the forward runs (``shm_inputs``). ``resolve_shm`` False: those inputs are left as the
    references the request gives (``shm_refs``: name -> datatype, shape, ``shared_memory_*``
    parameters) for the engine to resolve.
    """
    json_part = body if header_length is None else memoryview(body)[:header_length]
    if not json_part:
        raise InvalidInput("the request body is empty; a JSON object is expected")
    try:
        header = orjson.loads(json_part)
    except orjson.JSONDecodeError as exc:
        what = ("the request body" if header_length is None else
                f"the request's JSON part (its first {header_length} bytes, per Inference-Header-Content-Length)")
        raise InvalidInput(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise InvalidInput("the request must be a JSON object")
    if "id" in header and not isinstance(header["id"], str):  # Triton: 400 "Unable to parse 'id'"
        raise InvalidInput(f"id must be a string; got {_json_word(header['id'])}")
    parameters = header.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInput("parameters must be a JSON object")
    _bool_parameter("parameters", parameters, "binary_data_output")
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidInput("inputs must be a non-empty list of tensors")

    offset = header_length if header_length is not None else len(body)
    tensors: dict[str, np.ndarray] = {}
    shm_inputs: dict[str, Any] = {}
    shm_refs: dict[str, tuple[str, tuple[int, ...], dict[str, Any]]] = {}
    binary_inputs = uses_shm = False
    for i, tensor in enumerate(inputs):
        where = f"inputs[{i}]"
        if not isinstance(tensor, dict):
            raise InvalidInput(f"{where} must be a JSON object")
        name = tensor.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidInput(f"{where}.name must be a non-empty string")
        if name in tensors or name in shm_refs:
            raise InvalidInput(f"input {name!r} is given twice")
        where = f"input {name!r}"
        datatype = tensor.get("datatype")
        if datatype not in WIRE_DTYPES:
            raise InvalidInput(f"{where}: datatype must be one of {', '.join(WIRE_DTYPES)}; got {datatype!r}")
        shape = _shape(where, tensor.get("shape"))
        params = tensor.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidInput(f"{where}.parameters must be a JSON object")
        size = params.get("binary_data_size")
        if "shared_memory_region" in params:
            if size is not None or "data" in tensor:
                raise InvalidInput(f"{where} names a shared_memory_region and also carries "
                                   f"{'binary_data_size' if size is not None else 'data'}; give one source")
            if shm is None:
                raise InvalidInput(f"{where}: shared memory is not available on this endpoint")
            if resolve_shm:
                shm_inputs[name] = shm.tensor(where, params, WIRE_DTYPES[datatype], shape, datatype)
                tensors[name] = shm_inputs[name].array
            else:
                shm_refs[name] = (datatype, shape, params)
            uses_shm = True
        elif size is not None:
            if header_length is None:
                raise InvalidInput(f"{where} has binary_data_size but the request has no "
                                   "Inference-Header-Content-Length header")
            if "data" in tensor:
                raise InvalidInput(f"{where} has both data and binary_data_size")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InvalidInput(f"{where}: binary_data_size must be a non-negative integer; got {size!r}")
            dtype = WIRE_DTYPES[datatype]
            expected = math.prod(shape) * dtype.itemsize
            if size != expected:
                raise InvalidInput(f"{where}: binary_data_size is {size} bytes but shape {list(shape)} of "
                                   f"{datatype} needs {expected}")
            if offset + size > len(body):
                raise InvalidInput(f"{where}: the body is truncated: {size} bytes of tensor data expected at "
                                   f"offset {offset}, only {len(body) - offset} left")
            tensors[name] = np.frombuffer(body, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)
            offset += size
            binary_inputs = True
        else:
            if "data" not in tensor:
                raise InvalidInput(f"{where} has neither data nor parameters.binary_data_size")
            if datatype not in JSON_DTYPES:
                raise InvalidInput(f"{where}: datatype {datatype} is only accepted as binary data "
                                   "(binary tensor extension); JSON carries FP32")
            tensors[name] = _json_data(where, tensor["data"], shape)
    if header_length is not None and offset != len(body):
        raise InvalidInput(f"the body has {len(body) - offset} bytes after the last binary tensor")
    return ParsedRequest(header, tensors, binary_inputs, parameters, shm, uses_shm, shm_inputs, shm_refs)


def requested_outputs(request: ParsedRequest, available: tuple[str, ...]) -> list[OutputChoice]:
    """Which outputs to return, in which encoding (``binary_data``) and datatype."""
    _bool_parameter("parameters", request.parameters, "binary_data_output")
    default_binary = request.parameters.get("binary_data_output", False)
    default_dtype = request.parameters.get("output_datatype", "FP32")
    asked = request.header.get("outputs")
    if asked is None or asked == []:
        asked = [{"name": name} for name in available]
    if not isinstance(asked, list):
        raise InvalidInput("outputs must be a list")
    choices = []
    for i, out in enumerate(asked):
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise InvalidInput(f"outputs[{i}] must be an object with a name")
        if out["name"] not in available:
            raise InvalidInput(f"unknown output {out['name']!r}; this model has {', '.join(available)}")
        params = out.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidInput(f"outputs[{i}].parameters must be a JSON object")
        _bool_parameter(f"outputs[{i}].parameters", params, "binary_data")
        binary = params.get("binary_data", default_binary)
        datatype = params.get("output_datatype", default_dtype)
        if datatype not in WIRE_DTYPES:
            raise InvalidInput(f"output_datatype must be one of {', '.join(WIRE_DTYPES)}; got {datatype!r}")
        shm = None
        if "shared_memory_region" in params:  # written into the region, not the body (binary is moot)
            where = f"output {out['name']!r}"
            if request.shm is None:
                raise InvalidInput(f"{where}: shared memory is not available on this endpoint")
            shm = {k: params[k] for k in ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")
                   if k in params}
            request.uses_shm, binary = True, False
        elif datatype != "FP32" and not binary:
            raise InvalidInput(f"output {out['name']!r}: {datatype} is only returned as binary data; "
                               "set parameters.binary_data")
        if params.get("classification"):
            raise InvalidInput("the classification extension is not supported")
        choices.append(OutputChoice(out["name"], binary, datatype, shm))
    return choices


def encode_infer_response(header: dict[str, Any], outputs: list[tuple[OutputChoice, np.ndarray]]
                          ) -> tuple[bytes | memoryview, int | None]:
    """(body, header length or None when the body is all JSON).

    Binary outputs are cast straight into one preallocated body buffer after the JSON header
    (one pass over the data, no intermediate copies).
    """
    entries, binaries = [], []
    for choice, array in outputs:
        dtype = WIRE_DTYPES[choice.datatype]
        entry: dict[str, Any] = {"name": choice.name, "datatype": choice.datatype, "shape": list(array.shape)}
        if choice.shm is not None:  # already written into its region: the entry says where
            entry["parameters"] = choice.shm
        elif choice.binary:
            entry["parameters"] = {"binary_data_size": array.size * dtype.itemsize}
            binaries.append((array, dtype))
        else:
            entry["data"] = np.ascontiguousarray(array, dtype=dtype).reshape(-1)
        entries.append(entry)
    if not binaries:
        return orjson.dumps({**header, "outputs": entries}, option=orjson.OPT_SERIALIZE_NUMPY), None
    json_bytes = _padded_header({**header, "outputs": entries})
    body = _response_body(json_bytes, sum(a.size * d.itemsize for a, d in binaries))
    offset = len(json_bytes)
    for array, dtype in binaries:
        target = np.frombuffer(body, dtype=dtype, count=array.size, offset=offset).reshape(array.shape)
        np.copyto(target, array, casting="same_kind")
        offset += array.size * dtype.itemsize
    return memoryview(body), len(json_bytes)


def binary_response_buffer(header: dict[str, Any], choice: OutputChoice, shape: tuple[int, ...]
                           ) -> tuple[memoryview, int, np.ndarray]:
    """(body, header length, tensor): a response with one binary output whose data is still to be
    written into ``tensor``, a (shape, choice.datatype) view of the body after the JSON header.

    Lets the forward write (and cast) its output straight into the response: no float32 copy of
    the output and no separate encoding pass.
    """
    if not choice.binary:
        raise ValueError(f"output {choice.name!r} is not binary; encode it with encode_infer_response")
    dtype = WIRE_DTYPES[choice.datatype]
    size = math.prod(shape)
    entry = {"name": choice.name, "datatype": choice.datatype, "shape": list(shape),
             "parameters": {"binary_data_size": size * dtype.itemsize}}
    json_bytes = _padded_header({**header, "outputs": [entry]})
    body = _response_body(json_bytes, size * dtype.itemsize)
    tensor = np.frombuffer(body, dtype=dtype, count=size, offset=len(json_bytes)).reshape(shape)
    return memoryview(body), len(json_bytes), tensor
