"""Triton's gRPC infer messages to the engine's types and back.

Inputs come as raw bytes (``raw_input_contents``, what tritonclient sends: one entry per input
that names no shared-memory region, in input order) or as typed contents (``contents.fp32_contents``
...); either becomes a NumPy array of the declared shape, a view of the received bytes where they
are raw (:mod:`mmad.grpc.wire`). Only the transport is checked here (the bytes or values match the declared shape); the
engine checks the tensors against the model. Outputs always leave as raw bytes, as Triton's gRPC
server sends them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mmad.engine.api import DATATYPES, InferInput, InferRequest, InferResponse, RequestedOutput, ShmRef
from mmad.errors import InvalidInput
from mmad.grpc.generated import grpc_service_pb2 as pb
from mmad.grpc.wire import WireRequest, WireResponse

MAX_ELEMENTS = 1 << 31
# typed contents: the field each datatype's values travel in (FP16 has none: it travels raw)
CONTENTS_FIELDS = {
    "BOOL": "bool_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents",
}
SHM_KEYS = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")
NO_BYTES = np.empty(0, np.uint8)  # the raw entry of an output written into shared memory


def parameters(params: Any) -> dict[str, Any]:
    """A ``map<string, InferParameter>`` as plain values."""
    out = {}
    for key, value in params.items():
        choice = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, choice) if choice is not None else None
    return out


def _shm_ref(where: str, params: dict[str, Any]) -> ShmRef | None:
    if "shared_memory_region" not in params:
        return None
    region, offset, size = (params.get(k) for k in SHM_KEYS)
    if not isinstance(region, str) or not region:
        raise InvalidInput(f"{where}: shared_memory_region must be a region's name (string_param)")
    if offset is None:
        offset = 0
    for name, value in (("shared_memory_offset", offset), ("shared_memory_byte_size", size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidInput(f"{where}: {name} must be a non-negative integer (int64_param); got {value!r}")
    return ShmRef(region, offset, size)


def _shape(where: str, dims: Any) -> tuple[int, ...]:
    shape = tuple(int(d) for d in dims)
    if not shape or any(d < 0 for d in shape):
        raise InvalidInput(f"{where}: shape must be a non-empty list of non-negative integers; got {list(shape)}")
    if math.prod(shape) > MAX_ELEMENTS:
        raise InvalidInput(f"{where}: shape {list(shape)} has more than {MAX_ELEMENTS} elements")
    return shape


def _dtype(where: str, datatype: str) -> np.dtype:
    dtype = DATATYPES.get(datatype)
    if dtype is None:
        raise InvalidInput(f"{where}: datatype {datatype!r} is not one mmad serves (FP32, FP16)")
    return dtype


def _output_datatype(where: str, params: dict[str, Any], default: str) -> str:
    """mmad's ``output_datatype`` parameter (the request's, or an output's): FP16 outputs halve
    the bytes sent."""
    datatype = params.get("output_datatype", default)
    if not isinstance(datatype, str):
        raise InvalidInput(f"{where}: output_datatype must be a datatype's name (string_param); got {datatype!r}")
    return datatype


def infer_request(wire: WireRequest) -> InferRequest:
    """The engine's request for a ModelInferRequest (raw contents: views of the received bytes)."""
    if wire.error is not None:
        raise InvalidInput(wire.error)
    request, raw = wire.message, wire.raw
    inputs, used = [], 0
    for i, tensor in enumerate(request.inputs):
        where = f"input {tensor.name!r}" if tensor.name else f"inputs[{i}]"
        shape = _shape(where, tensor.shape)
        params = parameters(tensor.parameters)
        shm = _shm_ref(where, params)
        if shm is not None:
            inputs.append(InferInput(tensor.name, tensor.datatype, shape, shm=shm))
            continue
        dtype = _dtype(where, tensor.datatype)
        if raw:
            if used == len(raw):
                raise InvalidInput(f"{where}: raw_input_contents has {len(raw)} entries, fewer than the inputs "
                                   "that carry data; give every such input one, in input order")
            data, used = raw[used], used + 1
            needed = math.prod(shape) * dtype.itemsize
            if data.nbytes != needed:
                raise InvalidInput(f"{where}: its raw_input_contents entry is {data.nbytes} bytes but shape "
                                   f"{list(shape)} of {tensor.datatype} needs {needed}")
            array = np.frombuffer(data, dtype=dtype).reshape(shape)
        else:
            field = CONTENTS_FIELDS.get(tensor.datatype)
            if field is None:
                raise InvalidInput(f"{where}: {tensor.datatype} has no typed contents; send it in raw_input_contents")
            values = getattr(tensor.contents, field)
            if len(values) != math.prod(shape):
                raise InvalidInput(f"{where}: contents.{field} holds {len(values)} values but shape {list(shape)} "
                                   f"needs {math.prod(shape)}")
            with np.errstate(over="ignore"):  # out-of-range values become Inf, which the engine refuses
                array = np.asarray(values, dtype=dtype).reshape(shape)
        inputs.append(InferInput(tensor.name, tensor.datatype, shape, data=array))
    if raw and used != len(raw):
        raise InvalidInput(f"raw_input_contents has {len(raw)} entries but {used} input(s) carry data")
    defaults = parameters(request.parameters)
    default_datatype = _output_datatype("parameters", defaults, "FP32")
    outputs = None
    if request.outputs:
        outputs = []
        for o in request.outputs:
            params = parameters(o.parameters)
            where = f"output {o.name!r}"
            if params.get("classification"):
                raise InvalidInput(f"{where}: the classification extension is not supported")
            outputs.append(RequestedOutput(o.name, _output_datatype(where, params, default_datatype), True,
                                           _shm_ref(where, params)))
    elif default_datatype != "FP32":
        outputs = [RequestedOutput("OUTPUT", default_datatype)]
    return InferRequest(request.model_name, inputs, outputs, request.model_version or None,
                        request.id or None, defaults)


def infer_response(response: InferResponse) -> WireResponse:
    """The ModelInferResponse of the engine's response: each output's bytes in
    ``raw_output_contents`` at the output's position (an output written into shared memory
    holds an empty entry there when an output with bytes follows it)."""
    message = pb.ModelInferResponse(model_name=response.model, model_version=response.version,
                                    id=response.id or "")
    raws = []
    for out in response.outputs:
        tensor = message.outputs.add(name=out.name, datatype=out.datatype, shape=out.shape)
        if out.shm is not None:
            tensor.parameters["shared_memory_region"].string_param = out.shm.region
            tensor.parameters["shared_memory_offset"].int64_param = out.shm.offset
            tensor.parameters["shared_memory_byte_size"].int64_param = out.shm.byte_size
            raws.append(NO_BYTES)
        else:
            raws.append(out.data)
    while raws and raws[-1] is NO_BYTES:
        raws.pop()
    return WireResponse.of(message, raws)
