"""Wire formats with NumPy: the Triton binary tensor extension and safetensors.

Binary tensor extension (Triton ``binary_tensor_data.md``): the body is a JSON inference header
followed by the raw little-endian bytes of each binary tensor, in the order the tensors appear
in the header; the header's length is the ``Inference-Header-Content-Length`` HTTP header and
each binary tensor carries ``parameters.binary_data_size``.

safetensors (written by hand so that the client needs only httpx and NumPy): an 8-byte
little-endian header length N, N bytes of JSON ``{name: {"dtype", "shape", "data_offsets":
[begin, end]}}`` (offsets relative to the end of the header; we pad it with spaces to a multiple
of 8 so every tensor stays aligned), then the tensors' bytes back to back.

Decoding is zero-copy: the arrays returned are read-only views of the received bytes
(``np.frombuffer``); ``copy=True`` where the caller will own and modify them.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Mapping

import numpy as np

from .errors import ProtocolError

# Open Inference Protocol datatype <-> little-endian NumPy dtype (BYTES is not a numeric tensor)
OIP_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("?"), "UINT8": np.dtype("u1"), "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"), "UINT64": np.dtype("<u8"), "INT8": np.dtype("i1"),
    "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
}

SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("?"), "U8": np.dtype("u1"), "U16": np.dtype("<u2"), "U32": np.dtype("<u4"),
    "U64": np.dtype("<u8"), "I8": np.dtype("i1"), "I16": np.dtype("<i2"), "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
}
_SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
_OIP_NAMES = {dtype: name for name, dtype in OIP_DTYPES.items()}
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


def _json_bytes(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def oip_datatype(array: np.ndarray) -> str:
    """The OIP datatype name of an array's dtype."""
    name = _OIP_NAMES.get(array.dtype.newbyteorder("<"))
    if name is None:
        raise TypeError(f"dtype {array.dtype} has no Open Inference Protocol datatype")
    return name


def little_endian(array: np.ndarray) -> np.ndarray:
    """C-contiguous little-endian array; no copy when it already is one (the common case)."""
    return np.asarray(array, dtype=array.dtype.newbyteorder("<"), order="C")


def _raw_bytes(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without copying (also for empty and 0-d arrays)."""
    return memoryview(array.reshape(-1).view(np.uint8))


def encode_binary_request(header: dict[str, Any], tensors: list[np.ndarray]) -> tuple[bytes, int]:
    """Body of a binary-extension request and the JSON header's length.

    ``header["inputs"]`` must list, in order, one entry per array in ``tensors``; each gets
    ``parameters.binary_data_size``. The one copy made is the final concatenation.
    """
    arrays = [little_endian(t) for t in tensors]
    binary_inputs = [i for i in header["inputs"] if "data" not in i]
    if len(binary_inputs) != len(arrays):
        raise ValueError(f"{len(binary_inputs)} binary inputs in the header but {len(arrays)} arrays")
    for entry, array in zip(binary_inputs, arrays, strict=True):
        entry.setdefault("parameters", {})["binary_data_size"] = array.nbytes
    head = _json_bytes(header)
    body = b"".join([head, *map(_raw_bytes, arrays)])
    return body, len(head)


def decode_infer_response(body: bytes, header_length: int | None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Split an inference response into its JSON header and ``{output name: array}``.

    ``header_length`` is ``Inference-Header-Content-Length`` (``None``: the body is all JSON).
    Binary outputs are read-only views of ``body``; JSON outputs are new arrays.
    """
    if header_length is None:
        header_length = len(body)
    if not 0 <= header_length <= len(body):
        raise ProtocolError(f"Inference-Header-Content-Length {header_length} is outside the "
                            f"{len(body)}-byte body")
    try:
        header = json.loads(bytes(memoryview(body)[:header_length]))
    except ValueError as exc:
        raise ProtocolError(f"the inference response header is not JSON: {exc}") from exc
    if not isinstance(header, dict) or not isinstance(header.get("outputs"), list):
        raise ProtocolError("the inference response has no 'outputs' list")
    outputs: dict[str, np.ndarray] = {}
    offset = header_length
    for out in header["outputs"]:
        name, datatype, shape = out.get("name"), out.get("datatype"), out.get("shape")
        if datatype not in OIP_DTYPES or not isinstance(shape, list) or not all(
                isinstance(d, int) and d >= 0 for d in shape):
            raise ProtocolError(f"output {name!r} has datatype {datatype!r} and shape {shape!r}; "
                                f"expected one of {sorted(OIP_DTYPES)} and non-negative integer dims")
        dtype = OIP_DTYPES[datatype]
        count = int(np.prod(shape, dtype=np.int64))
        size = (out.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if size != count * dtype.itemsize:
                raise ProtocolError(f"output {name!r}: binary_data_size {size} but shape {shape} of "
                                    f"{datatype} needs {count * dtype.itemsize} bytes")
            if offset + size > len(body):
                raise ProtocolError(f"output {name!r} needs bytes {offset}..{offset + size} but the body "
                                    f"has {len(body)}")
            outputs[name] = np.frombuffer(body, dtype=dtype, count=count, offset=offset).reshape(shape)
            offset += size
        elif "data" in out:
            data = np.asarray(out["data"], dtype=dtype)
            if data.size != count:
                raise ProtocolError(f"output {name!r} has {data.size} values for shape {shape}")
            outputs[name] = data.reshape(shape)
        else:
            raise ProtocolError(f"output {name!r} has neither data nor binary_data_size")
    if offset != len(body):
        raise ProtocolError(f"{len(body) - offset} bytes after the last binary output")
    return header, outputs


def _safetensors_head(arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None) -> bytes:
    """The JSON header of ``arrays`` (little-endian already), padded with spaces to a multiple of 8."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, array in arrays.items():
        dtype = _SAFETENSORS_NAMES.get(array.dtype.newbyteorder("<"))
        if dtype is None:
            raise TypeError(f"tensor {name!r}: dtype {array.dtype} cannot be stored in safetensors")
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    head = _json_bytes(header)
    return head + b" " * (-len(head) % 8)


def safetensors_size(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> int:
    """How many bytes :func:`encode_safetensors` makes of ``tensors``, without encoding them."""
    arrays = {name: np.asarray(a) for name, a in tensors.items()}
    return 8 + len(_safetensors_head(arrays, metadata)) + sum(a.nbytes for a in arrays.values())


def encode_safetensors(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    """safetensors bytes of ``tensors`` (written in the given order, little-endian)."""
    arrays = {name: little_endian(np.asarray(a)) for name, a in tensors.items()}
    head = _safetensors_head(arrays, metadata)
    return b"".join([struct.pack("<Q", len(head)), head, *map(_raw_bytes, arrays.values())])


def decode_safetensors(data: bytes, *, copy: bool = False) -> dict[str, np.ndarray]:
    """``{name: array}`` from safetensors bytes, checking the framing as the reference reader does.

    Views of ``data`` unless ``copy`` (then writable arrays the caller owns).
    """
    if len(data) < 8:
        raise ProtocolError(f"safetensors data is {len(data)} bytes; the header length alone needs 8")
    (header_length,) = struct.unpack_from("<Q", data)
    if header_length > MAX_SAFETENSORS_HEADER or 8 + header_length > len(data):
        raise ProtocolError(f"safetensors header length {header_length} does not fit the {len(data)}-byte data")
    try:
        header = json.loads(bytes(memoryview(data)[8:8 + header_length]))
    except ValueError as exc:
        raise ProtocolError(f"safetensors header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ProtocolError("safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    start = 8 + header_length
    payload = len(data) - start
    spans = []
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"safetensors tensor {name!r} has a malformed or unsupported entry {info!r}") from exc
        count = int(np.prod(shape, dtype=np.int64))
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= payload or end - begin != count * dtype.itemsize:
            raise ProtocolError(f"safetensors tensor {name!r}: offsets {begin}..{end} do not hold shape "
                                f"{shape} of {info['dtype']} within {payload} bytes")
        spans.append((begin, end, name))
        array = np.frombuffer(data, dtype=dtype, count=count, offset=start + begin).reshape(shape)
        out[name] = array.copy() if copy else array
    # the tensors must tile the payload exactly (no gaps, no overlaps), as the reference reader checks
    cursor = 0
    for begin, end, name in sorted(spans):
        if begin != cursor:
            raise ProtocolError(f"safetensors tensor {name!r} starts at {begin}, expected {cursor}")
        cursor = end
    if cursor != payload:
        raise ProtocolError(f"safetensors data has {payload - cursor} bytes after the last tensor")
    return out
