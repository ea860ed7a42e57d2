"""Infer messages at the wire: raw tensor contents kept out of protobuf's hands.

A ModelInferRequest of 65,536 FP16 rows of a 64-wide model carries 8 MiB of raw input. Parsed
by protobuf, those bytes are copied into the message and again into each Python object read
from ``raw_input_contents``; written by protobuf, an output is copied into a ``bytes`` object,
then into the message, then into the serialized reply. Here a request's ``raw_input_contents``
entries stay views of the bytes gRPC received (protobuf parses the rest, without them), and a
reply is the serialized message without its outputs' bytes followed by those bytes as the
fields protobuf would have written, joined once (the protobuf wire format lets repeated fields
follow the others). Everything else of the messages is protobuf's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from google.protobuf.message import DecodeError

from mmad.grpc.generated import grpc_service_pb2 as pb

RAW_INPUT_FIELD = pb.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number
RAW_OUTPUT_FIELD = pb.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number
STREAM_RESPONSE_FIELD = pb.ModelStreamInferResponse.DESCRIPTOR.fields_by_name["infer_response"].number
LENGTH_DELIMITED = 2


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise DecodeError("a varint longer than 10 bytes")


def varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def split_field(data: bytes, number: int) -> tuple[bytes, list[memoryview]]:
    """(the message without its length-delimited field ``number``, that field's values as views
    of ``data``, in order)."""
    view = memoryview(data)
    rest, values, pos, end = [], [], 0, len(data)
    while pos < end:
        start = pos
        key, pos = _read_varint(view, pos)
        kind = key & 7
        if kind == 0:
            _, pos = _read_varint(view, pos)
        elif kind == 1:
            pos += 8
        elif kind == LENGTH_DELIMITED:
            length, pos = _read_varint(view, pos)
            if key >> 3 == number:
                values.append(view[pos:pos + length])
            pos += length
        elif kind == 5:
            pos += 4
        else:
            raise DecodeError(f"wire type {kind} at byte {start}")
        if pos > end:
            raise DecodeError(f"a field runs past the end of the message (byte {start})")
        if key >> 3 != number or kind != LENGTH_DELIMITED:
            rest.append(view[start:pos])
    return b"".join(rest), values


@dataclass
class WireRequest:
    """A ModelInferRequest as received: the message without its raw contents, and those as
    views of the received bytes; ``error``: why the bytes are no ModelInferRequest."""

    message: pb.ModelInferRequest | None
    raw: list[memoryview] = field(default_factory=list)
    error: str | None = None


def read_infer_request(data: bytes) -> WireRequest:
    try:
        rest, raw = split_field(data, RAW_INPUT_FIELD)
        return WireRequest(pb.ModelInferRequest.FromString(rest), raw)
    except (DecodeError, IndexError) as exc:
        return WireRequest(None, error=f"the ModelInferRequest cannot be decoded: {exc}")


@dataclass
class WireResponse:
    """A ModelInferResponse to send: the serialized message without its raw outputs, then each
    output's bytes as a ``raw_output_contents`` field."""

    parts: list
    nbytes: int

    @classmethod
    def of(cls, message: pb.ModelInferResponse, raw: list[np.ndarray]) -> "WireResponse":
        head = message.SerializeToString()
        parts, nbytes = [head], len(head)
        tag = varint(RAW_OUTPUT_FIELD << 3 | LENGTH_DELIMITED)
        for array in raw:
            data = memoryview(np.ascontiguousarray(array)).cast("B")
            length = varint(data.nbytes)
            parts += [tag, length, data]
            nbytes += len(tag) + len(length) + data.nbytes
        return cls(parts, nbytes)


def write_infer_response(response: WireResponse) -> bytes:
    return b"".join(response.parts)


def write_stream_response(response: WireResponse | pb.ModelStreamInferResponse) -> bytes:
    """A ModelStreamInferResponse: a reply as its ``infer_response`` field, or an error message."""
    if isinstance(response, pb.ModelStreamInferResponse):
        return response.SerializeToString()
    return b"".join([varint(STREAM_RESPONSE_FIELD << 3 | LENGTH_DELIMITED), varint(response.nbytes), *response.parts])
