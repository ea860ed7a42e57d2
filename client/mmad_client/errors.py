"""Every error the mmad client raises, in one tree.

::

    MMADClientError                  base of everything below
    ├── HTTPStatusError              the server answered with an error status; ``.status_code``,
    │   │                            ``.message`` (the server's ``{"error": ...}`` text),
    │   │                            ``.response`` (the ``httpx.Response``)
    │   ├── BadRequest               400: malformed tensor, spec or request
    │   ├── Unauthorized             401: missing or wrong API key
    │   ├── Forbidden                403: the key may not do this
    │   ├── NotFound                 404: unknown model, version or job
    │   ├── Conflict                 409: the request conflicts with the server's state
    │   ├── PayloadTooLarge          413: the body exceeds the server's limit
    │   └── ServerError              any 5xx
    │       └── ServiceUnavailable   503: not ready or overloaded; ``.retry_after`` is the
    │                                server's ``Retry-After`` in seconds (or ``None``)
    ├── TransportError               the request never got an answer (connection refused, reset,
    │   │                            ...); the ``httpx`` exception is the ``__cause__``
    │   └── TimeoutError             a connect/read/write/pool timeout; also a builtin
    │                                ``TimeoutError``, so ``except TimeoutError`` catches it
    ├── ProtocolError                the server's answer is not what the API document says
    │                                (bad binary header, truncated tensor, malformed safetensors)
    └── JobFailed                    a training job ended in state ``failed``; ``.status`` is the
                                     final job status (with the server's ``error``)

Errors in the caller's own arguments (a 3-D array, FP16 over JSON) are ``ValueError`` /
``TypeError`` raised before anything is sent.
"""

from __future__ import annotations

import builtins
import email.utils
import time
from typing import Any

import httpx


class MMADClientError(Exception):
    """Base class of every error the mmad client raises."""


class HTTPStatusError(MMADClientError):
    """The server answered with a status of 400 or above."""

    def __init__(self, message: str, *, status_code: int, response: httpx.Response | None = None):
        self.message = message
        self.status_code = status_code
        self.response = response
        where = ""
        if response is not None and response.request is not None:
            where = f" ({response.request.method} {response.request.url.path})"
        super().__init__(f"{status_code}{where}: {message}")


class BadRequest(HTTPStatusError):
    """400: the request (tensor, spec, parameters) is malformed."""


class Unauthorized(HTTPStatusError):
    """401: the endpoint needs ``Authorization: Bearer <key>`` and none or a wrong one was sent."""


class Forbidden(HTTPStatusError):
    """403: the key is not allowed to do this."""


class NotFound(HTTPStatusError):
    """404: unknown model, version or job."""


class Conflict(HTTPStatusError):
    """409: the request conflicts with the current state."""


class PayloadTooLarge(HTTPStatusError):
    """413: the request body exceeds the server's limit."""


class ServerError(HTTPStatusError):
    """A 5xx answer."""


class ServiceUnavailable(ServerError):
    """503: the server or model is not ready, or its queue is full.

    ``retry_after`` is the ``Retry-After`` header in seconds (``None`` when absent).
    """

    def __init__(self, message: str, *, status_code: int = 503, response: httpx.Response | None = None,
                 retry_after: float | None = None):
        self.retry_after = retry_after
        super().__init__(message, status_code=status_code, response=response)


class TransportError(MMADClientError):
    """No answer: the connection failed or broke. The ``httpx`` error is the ``__cause__``."""


class TimeoutError(TransportError, builtins.TimeoutError):  # noqa: A001 - deliberately the builtin's name
    """A connect, read, write or pool timeout (see :class:`mmad_client.Timeout`)."""


class ProtocolError(MMADClientError):
    """The server's answer does not follow the API (bad binary framing, malformed safetensors)."""


class JobFailed(MMADClientError):
    """A training job ended in state ``failed``; ``status`` is its final status document."""

    def __init__(self, status: dict[str, Any]):
        self.status = status
        super().__init__(f"training job {status.get('job')!r} failed: {status.get('error') or 'no reason given'}")


_BY_STATUS: dict[int, type[HTTPStatusError]] = {
    400: BadRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Conflict,
    413: PayloadTooLarge,
}


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` as seconds: either delta-seconds or an HTTP date (RFC 9110 10.2.3)."""
    if value is None:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def error_message(response: httpx.Response) -> str:
    """The server's ``{"error": ...}`` text, or the raw body when it is not that shape."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return body["error"]
    text = response.text.strip()
    return text[:500] if text else response.reason_phrase or "no error message"


def status_error(response: httpx.Response) -> HTTPStatusError:
    """The typed exception for an error response (status >= 400)."""
    message = error_message(response)
    code = response.status_code
    if code == 503:
        return ServiceUnavailable(message, response=response,
                                  retry_after=parse_retry_after(response.headers.get("retry-after")))
    if code >= 500:
        return ServerError(message, status_code=code, response=response)
    return _BY_STATUS.get(code, HTTPStatusError)(message, status_code=code, response=response)


def transport_error(exc: httpx.TransportError) -> TransportError:
    """Our exception for an ``httpx`` transport failure (raise it ``from exc``)."""
    kind = TimeoutError if isinstance(exc, httpx.TimeoutException) else TransportError
    try:
        where = f" ({exc.request.method} {exc.request.url})"
    except RuntimeError:  # httpx raises this when the error is not tied to a request
        where = ""
    return kind(f"{type(exc).__name__}{where}: {exc}")


__all__ = [
    "MMADClientError", "HTTPStatusError", "BadRequest", "Unauthorized", "Forbidden", "NotFound",
    "Conflict", "PayloadTooLarge", "ServerError", "ServiceUnavailable", "TransportError",
    "TimeoutError", "ProtocolError", "JobFailed",
]
