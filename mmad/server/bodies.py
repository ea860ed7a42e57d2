"""Request bodies: the size cap, tensor bodies read into aligned buffers, bodies streamed into
files (dataset chunks), JSON in and out."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
from fastapi import Request
from fastapi.responses import Response

from mmad.errors import InvalidInput, PayloadTooLarge
from mmad.engine import hostmem
from mmad.server.errors import error_response


def body_too_large(max_bytes: int, declared: int | None = None) -> PayloadTooLarge:
    """The body cap's refusal (413): from the Content-Length, or once the streamed count passes it."""
    if declared is not None:
        return PayloadTooLarge(f"the body is {declared} bytes; the limit is {max_bytes}")
    return PayloadTooLarge(f"the body exceeds the limit of {max_bytes} bytes")


class BodyLimitMiddleware:
    """Refuse bodies over the cap before anything parses them (Content-Length and streamed count)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await error_response(400, "Content-Length is not an integer")(scope, receive, send)
            if declared > self.max_bytes:
                message = str(body_too_large(self.max_bytes, declared))
                return await error_response(413, message, {"Connection": "close"})(scope, receive, send)
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise body_too_large(self.max_bytes)
            return message

        return await self.app(scope, counted_receive, send)


BODY_ALIGN = 64


def tensor_buffer(size: int, header_length: str) -> memoryview:
    """An uninitialised buffer for a tensor request body of ``size`` bytes.

    Placed so that the binary tensors after the JSON header (``header_length``, the
    ``Inference-Header-Content-Length`` value) start at an address that is a multiple of
    ``BODY_ALIGN``: NumPy views of unaligned data take slow loops (measured: a 65,536-row FP16
    forward ~7 ms slower). Uninitialised (:func:`mmad.engine.hostmem.empty`): a ``bytearray``
    would first zero the 8 MiB.
    """
    raw = hostmem.empty(size + BODY_ALIGN)  # page-locked where the backend copies to a GPU
    start = -(raw.ctypes.data + _tensor_offset(header_length, size)) % BODY_ALIGN
    return memoryview(raw[start:start + size])


def _placed(body: memoryview, header_length: str) -> bool:
    """Whether ``body`` is a buffer of :func:`tensor_buffer`'s placement."""
    address = np.frombuffer(body, dtype=np.uint8).ctypes.data
    return (address + _tensor_offset(header_length, len(body))) % BODY_ALIGN == 0


def _tensor_offset(header_length: str, size: int) -> int:
    """Where a body's binary tensors start: after its JSON header, if that length is valid."""
    return int(header_length) if header_length.isdigit() and int(header_length) <= size else 0


async def read_tensor_body(request: Request) -> bytes | memoryview:
    """The body of a tensor request in one buffer of its Content-Length, tensors aligned (no joins).

    Large infer bodies arrive already read in place by :mod:`mmad.server.http_protocol` (one message,
    a :func:`tensor_buffer`); anything else is streamed into a :func:`tensor_buffer`. The
    middleware has already refused a Content-Length over the cap and counts what streams in.
    """
    length = request.headers.get("content-length", "")
    if not length.isdigit():
        return await request.body()
    size = int(length)
    header_length = request.headers.get("inference-header-content-length", "")
    body, filled = None, 0
    async for chunk in request.stream():
        if body is None:
            if isinstance(chunk, memoryview) and len(chunk) == size and _placed(chunk, header_length):
                body, filled = chunk, size  # read in place by the protocol
                continue
            body = tensor_buffer(size, header_length)
        if filled + len(chunk) > size:
            raise InvalidInput(f"the body is longer than its Content-Length of {size} bytes")
        body[filled:filled + len(chunk)] = chunk
        filled += len(chunk)
    if filled != size:
        raise InvalidInput(f"the body has {filled} bytes but Content-Length says {size}")
    return body if body is not None else b""


def json_body(data: bytes, what: str = "the request body") -> Any:
    if not data:
        raise InvalidInput(f"{what} is empty; a JSON object is expected")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"{what} is not valid JSON: {exc}") from exc


def json_response(doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status,
                    media_type="application/json", headers=headers)
