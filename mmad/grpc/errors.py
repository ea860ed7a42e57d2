"""How mmad's exception tree (:mod:`mmad.errors`) leaves the gRPC front end: status codes as
Triton's gRPC server gives them (``TRITONSERVER_ERROR_*`` to ``grpc::StatusCode``), plus the codes
Triton has no error of its own for (the API key, a full store)."""

from __future__ import annotations

import logging

from grpc import StatusCode

from mmad.errors import (
    BackendUnavailable, ConflictError, DeviceMemoryFull, Forbidden, InvalidInput, MMADError, ModelNotFound, NotReady,
    Overloaded, PayloadTooLarge, RegionFull, SpecError, StoreDamaged, StoreUnwritable, Unauthorized,
)

log = logging.getLogger("mmad.grpc")

# first match wins (subclasses before their bases); the rest, compile, launch and cache failures
# included, is INTERNAL
CODE_TABLE: list[tuple[type, StatusCode]] = [
    (Unauthorized, StatusCode.UNAUTHENTICATED), (Forbidden, StatusCode.PERMISSION_DENIED),
    (ModelNotFound, StatusCode.NOT_FOUND), (ConflictError, StatusCode.FAILED_PRECONDITION),
    (PayloadTooLarge, StatusCode.RESOURCE_EXHAUSTED), (SpecError, StatusCode.INVALID_ARGUMENT),
    (InvalidInput, StatusCode.INVALID_ARGUMENT), (Overloaded, StatusCode.UNAVAILABLE),
    (NotReady, StatusCode.UNAVAILABLE), (BackendUnavailable, StatusCode.UNAVAILABLE),
    (StoreUnwritable, StatusCode.RESOURCE_EXHAUSTED), (DeviceMemoryFull, StatusCode.RESOURCE_EXHAUSTED),
    (RegionFull, StatusCode.RESOURCE_EXHAUSTED), (StoreDamaged, StatusCode.FAILED_PRECONDITION),
]


def code_for(exc: MMADError) -> StatusCode:
    for cls, code in CODE_TABLE:
        if isinstance(exc, cls):
            return code
    return StatusCode.INTERNAL


def status_of(exc: BaseException, method: str) -> tuple[StatusCode, str, tuple[tuple[str, str], ...]]:
    """(code, message, trailing metadata) of an error a handler raised: mmad's tree by the
    table (an UNAVAILABLE says when to retry, as HTTP's Retry-After does), anything else a bug,
    logged with its traceback and answered INTERNAL."""
    if isinstance(exc, MMADError):
        code = code_for(exc)
        trailers = ()
        if code is StatusCode.UNAVAILABLE:
            trailers = (("retry-after", str(max(1, round(getattr(exc, "retry_after_s", 1.0))))),)
        if code is StatusCode.INTERNAL:
            log.error("gRPC %s failed: %s", method, exc)
        return code, str(exc), trailers
    log.error("gRPC %s raised", method, exc_info=exc)
    # an OSError's str() carries the file name: a path of the daemon's machine, not the client's business
    detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
    return StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {detail}", ()
