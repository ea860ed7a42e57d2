"""How mmad's exception tree (``mmad/errors.py``) leaves the daemon: status codes, bodies,
headers, and the documented error responses of every route."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmad.errors import (
    BackendUnavailable, CacheError, CompileError, ConflictError, CrossSiteRequest, DeviceMemoryFull, Forbidden,
    InvalidInput, LaunchError, MMADError, ModelNotFound, NotReady, Overloaded, PayloadTooLarge, RegionFull, SpecError,
    StoreUnwritable, Unauthorized, UnsupportedMediaType,
)

log = logging.getLogger("mmad.server")

# first match wins (subclasses before their bases)
STATUS_TABLE: list[tuple[type, int]] = [
    (Unauthorized, 401), (Forbidden, 403), (CrossSiteRequest, 403), (ModelNotFound, 404), (ConflictError, 409),
    (PayloadTooLarge, 413), (UnsupportedMediaType, 415), (SpecError, 400), (InvalidInput, 400), (Overloaded, 503),
    (NotReady, 503), (BackendUnavailable, 503), (StoreUnwritable, 507), (DeviceMemoryFull, 507), (RegionFull, 507),
    (CompileError, 500), (LaunchError, 500), (CacheError, 500),
]


def status_for(exc: MMADError) -> int:
    for cls, status in STATUS_TABLE:
        if isinstance(exc, cls):
            return status
    return 500


ERROR_BODY_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
ERROR_STATUSES = {
    400: "bad input (the message names the field)", 401: "no API key sent",
    403: "wrong API key, or a request from a page of another site (docs/service.md, Security)",
    404: "unknown model, version, dataset or job", 409: "conflicts with the current state",
    413: "body too large", 415: "the body's Content-Type is not one the route reads",
    503: "not ready, unloading or overloaded (see Retry-After)",
    507: "the model store is full or read-only, the device lacks the memory asked for, or a shared-memory "
         "region's filesystem has no room for an output; nothing was saved and nothing served changed",
}
# Documented on every route (routers pass it to APIRouter): any route can meet the body cap,
# a daemon that is not ready yet, or bad input; OpenAPI clients and fuzzers rely on the list.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": what, "content": {"application/json": {"schema": ERROR_BODY_SCHEMA}},
             **({"headers": {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}}}
                if status == 503 else {})}
    for status, what in ERROR_STATUSES.items()
}


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
        return internal_error_response(request, exc)


def internal_error_response(request: Request, exc: Exception) -> Response:
    """The 500 of an exception outside mmad's tree (a bug), logged with its traceback."""
    log.exception("%s %s raised", request.method, request.url.path, exc_info=exc)
    # an OSError's str() carries the file name: a path of the daemon's machine, not the client's business
    detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
    return error_response(500, f"internal error: {type(exc).__name__}: {detail}")
