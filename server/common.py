"""What every router shares: the runtime object, the body cap, auth, and the error mapping."""

from __future__ import annotations

import hmac
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmad.backends.contract import Backend, ProbeRow
from mmad.errors import (
    BackendUnavailable, CacheError, CompileError, ConflictError, InvalidInput, LaunchError,
    MMADError, ModelNotFound, Overloaded, PayloadTooLarge, SpecError,
)
from mmad.server.metrics import Metrics
from mmad.server.settings import Settings

log = logging.getLogger("mmad.server")


class Unauthorized(MMADError):
    """No API key was sent to a daemon that requires one (HTTP 401)."""


class Forbidden(MMADError):
    """The API key sent is wrong (HTTP 403)."""


class NotReady(MMADError):
    """The daemon or a model cannot serve yet (HTTP 503)."""


def status_for(exc: MMADError) -> int:
    from mmad.server.registry import ModelNotReady  # registry imports this module's neighbours

    table: list[tuple[type, int]] = [
        (Unauthorized, 401), (Forbidden, 403), (ModelNotFound, 404), (ConflictError, 409),
        (PayloadTooLarge, 413), (SpecError, 400), (InvalidInput, 400), (Overloaded, 503),
        (ModelNotReady, 503), (NotReady, 503), (BackendUnavailable, 503), (CompileError, 500),
        (LaunchError, 500), (CacheError, 500),
    ]
    for cls, status in table:
        if isinstance(exc, cls):
            return status
    return 500


ERROR_BODY_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
ERROR_STATUSES = {
    400: "bad input (the message names the field)", 401: "no API key sent", 403: "wrong API key",
    404: "unknown model, version, dataset or job", 409: "conflicts with the current state",
    413: "body too large", 503: "not ready, unloading or overloaded (see Retry-After)",
}
# Documented on every route (routers pass it to APIRouter): any route can meet the body cap,
# a daemon that is not ready yet, or bad input; OpenAPI clients and fuzzers rely on the list.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": what, "content": {"application/json": {"schema": ERROR_BODY_SCHEMA}},
             **({"headers": {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}}}
                if status == 503 else {})}
    for status, what in ERROR_STATUSES.items()
}


# OpenAPI descriptions of the bodies routes read themselves (raw Request), so that clients and
# fuzzers see what is accepted: OIP v2 inference requests as JSON or binary tensor extension.
_OIP_TENSOR = {"type": "object", "required": ["name", "datatype", "shape"], "properties": {
    "name": {"type": "string"}, "datatype": {"type": "string", "enum": ["FP32", "FP16"]},
    "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "data": {"type": "array", "items": {"type": "number"}},
    "parameters": {"type": "object", "properties": {"binary_data_size": {"type": "integer", "minimum": 0}}}}}
_OIP_REQUEST = {"type": "object", "required": ["inputs"], "properties": {
    "id": {"type": "string"}, "parameters": {"type": "object"},
    "inputs": {"type": "array", "minItems": 1, "items": _OIP_TENSOR},
    "outputs": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "parameters": {"type": "object"}}}}}}
_BINARY = {"schema": {"type": "string", "format": "binary"}}
TENSOR_REQUEST_DOC: dict[str, Any] = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": _OIP_REQUEST},
                                                  "application/octet-stream": _BINARY}},
    "parameters": [{"name": "Inference-Header-Content-Length", "in": "header", "required": False,
                    "description": "binary tensor extension: bytes of JSON header before the tensors",
                    "schema": {"type": "integer"}}],
}
BINARY_REQUEST_DOC: dict[str, Any] = {
    "requestBody": {"required": True, "content": {"application/octet-stream": _BINARY}}}
TENSOR_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "JSON, or the binary tensor extension (Inference-Header-Content-Length)",
          "content": {"application/json": {}, "application/octet-stream": _BINARY}}}


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps({"error": message}), status_code=status,
                    media_type="application/json", headers=headers)


def mmad_error_response(request: Request, exc: MMADError) -> Response:
    """The response for an error of mmad's exception tree (status, Retry-After, WWW-Authenticate)."""
    status = status_for(exc)
    headers = {}
    if status == 503:  # overloaded, not ready, unloading: every 503 says when to retry
        headers["Retry-After"] = str(max(1, round(getattr(exc, "retry_after_s", 1.0))))
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    if status >= 500 and status != 503:
        log.error("%s %s failed: %s", request.method, request.url.path, exc)
    return error_response(status, str(exc), headers)


def install_error_handlers(app) -> None:
    """Every error leaves as ``{"error": ...}``; mmad's exception tree maps onto statuses here."""

    @app.exception_handler(MMADError)
    async def _mmad_error(request: Request, exc: MMADError) -> Response:
        return mmad_error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return error_response(400, f"{where}: {first.get('msg')}")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail), dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> Response:
        log.exception("%s %s raised", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


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
                message = f"the body is {declared} bytes; the limit is {self.max_bytes}"
                return await error_response(413, message, {"Connection": "close"})(scope, receive, send)
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise PayloadTooLarge(f"the body exceeds the limit of {self.max_bytes} bytes")
            return message

        return await self.app(scope, counted_receive, send)


@dataclass
class Runtime:
    """Everything the routers reach through ``request.app.state.runtime``."""

    settings: Settings
    metrics: Metrics
    executor: ThreadPoolExecutor
    forward_pool: ThreadPoolExecutor  # the chunks of one large host-side forward (never blocks on anything)
    backend: Backend | None = None
    selected: ProbeRow | None = None
    probe_rows: list[ProbeRow] | None = None
    store: Any = None
    registry: Any = None
    jobs: Any = None
    ready: bool = False
    shutting_down: bool = False


async def runtime(request: Request) -> Runtime:  # async: FastAPI runs sync dependencies in a thread pool
    rt: Runtime = request.app.state.runtime
    if not rt.ready:
        raise NotReady("the daemon is starting or stopping")
    return rt


async def require_key(request: Request) -> None:  # async: no thread hop per request
    """Dependency of every mutating endpoint: ``Authorization: Bearer <key>`` when a key is set."""
    expected = request.app.state.runtime.settings.api_key_value
    if expected is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("this endpoint needs 'Authorization: Bearer <api key>'")
    if not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise Forbidden("the API key is not valid")


BODY_ALIGN = 64


def tensor_buffer(size: int, header_length: str) -> memoryview:
    """An uninitialised buffer for a tensor request body of ``size`` bytes.

    Placed so that the binary tensors after the JSON header (``header_length``, the
    ``Inference-Header-Content-Length`` value) start at an address that is a multiple of
    ``BODY_ALIGN``: NumPy views of unaligned data take slow loops (measured: a 65,536-row FP16
    forward ~7 ms slower). NumPy's ``empty``: a ``bytearray`` would first zero the 8 MiB.
    """
    raw = np.empty(size + BODY_ALIGN, dtype=np.uint8)
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

    Large infer bodies arrive already read in place by :mod:`mmad.server.http` (one message,
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
