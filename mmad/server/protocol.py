"""uvicorn's httptools protocol, with large infer bodies read by the socket straight into their buffer.

uvicorn hands a request body to the app in pieces: the parser copies each read (256 KiB from
uvloop) into a bytes object, the protocol appends it to a bytearray, ``receive`` copies that
again into bytes, and reading pauses once 64 KiB are held until the app asks for more. A
65,536-row FP16 request (8 MiB) took 8-10 ms of the event loop in ~35 such round trips, and the
daemon copied it once more into its aligned buffer (docs/service-performance.md).

:class:`DirectBodyProtocol` puts uvicorn's protocol behind a buffered protocol: for
``POST .../infer`` with a Content-Length of at least :data:`DIRECT_BODY_MIN` bytes (and within
the body cap), the socket reads go into one buffer of the body's size, placed so that its
tensors are aligned (:func:`mmad.server.bodies.tensor_buffer`), without pauses, and the app
receives the body as one message (a memoryview of that buffer). Request lines, headers and
every other body still go through uvicorn's parser and its own handling. (A wrapper, not a
subclass: uvloop reads into a buffered protocol's buffers only when it is no
``asyncio.Protocol``, which uvicorn's is.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from mmad.server.bodies import tensor_buffer

DIRECT_BODY_MIN = 256 * 1024
SCRATCH_BYTES = 256 * 1024  # reads outside a direct body (uvloop's own read size)


class DirectBodyProtocol(asyncio.BufferedProtocol):
    """See the module docstring; ``max_body_bytes`` is set by :func:`protocol_class`."""

    max_body_bytes = 0

    def __init__(self, *args: Any, **kwargs: Any):
        self.http = _HttpToolsDirect(self.max_body_bytes, *args, **kwargs)
        self._scratch = memoryview(bytearray(SCRATCH_BYTES))

    # -- the transport's calls, for uvicorn's protocol --------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.http.connection_made(transport)  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        self.http.connection_lost(exc)

    def eof_received(self) -> bool | None:
        return self.http.eof_received()

    def pause_writing(self) -> None:
        self.http.pause_writing()

    def resume_writing(self) -> None:
        self.http.resume_writing()

    # -- buffered reads ---------------------------------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        http = self.http
        if http.direct is not None:  # never past the body: the next request goes to the parser
            return http.direct[http.filled:]
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        http = self.http
        if http.direct is None:
            http.data_received(bytes(self._scratch[:nbytes]))
            return
        http.filled += nbytes
        if http.filled == len(http.direct):
            # the parser saw only the start of this body: a fresh one reads the next request
            http.parser = httptools.HttpRequestParser(http)
            http.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn sets it
            http.finish_direct()


class _HttpToolsDirect(HttpToolsProtocol):
    """uvicorn's protocol, deciding at each request's headers whether its body is read in place."""

    def __init__(self, max_body_bytes: int, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.max_body_bytes = max_body_bytes
        self.direct: memoryview | None = None  # the body being read in place
        self.filled = 0

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        size = self._direct_size()
        if size is None:
            return
        header_length = dict(self.headers).get(b"inference-header-content-length", b"").decode("latin-1")
        self.direct, self.filled = tensor_buffer(size, header_length), 0
        self.cycle.receive = _DirectReceive(self.cycle)  # run_asgi looks it up when the task starts

    def on_body(self, body: bytes) -> None:
        if self.direct is None:
            super().on_body(body)
            return
        # the rest of the read that held the headers
        self.direct[self.filled:self.filled + len(body)] = body
        self.filled += len(body)

    def on_message_complete(self) -> None:
        if self.direct is None:
            super().on_message_complete()
            return
        self.finish_direct()  # the whole body came with the headers

    def _direct_size(self) -> int | None:
        scope = self.scope
        if scope.get("method") != "POST" or not scope.get("path", "").endswith("/infer"):
            return None
        if self.parser.should_upgrade() or self.expect_100_continue:
            return None  # uvicorn's own receive sends the 100 Continue
        headers = dict(self.headers)
        length = headers.get(b"content-length", b"")
        if b"transfer-encoding" in headers or not length.isdigit():
            return None
        size = int(length)
        return size if DIRECT_BODY_MIN <= size <= self.max_body_bytes else None

    def finish_direct(self) -> None:
        body, self.direct = self.direct, None
        cycle = self.cycle
        cycle.receive.body = body  # the _DirectReceive set with the headers
        cycle.more_body = False
        cycle.message_event.set()


class _DirectReceive:
    """ASGI ``receive`` of a request whose body is read in place: the whole body in one message,
    then (as uvicorn's) ``http.disconnect`` once the client is gone or the response is sent."""

    def __init__(self, cycle: RequestResponseCycle):
        self.cycle = cycle
        self.body: memoryview | None = None

    async def __call__(self) -> dict[str, Any]:
        cycle = self.cycle
        if self.body is None and not cycle.disconnected and not cycle.response_complete:
            await cycle.message_event.wait()  # the body is complete, or the request is over
        cycle.message_event.clear()  # after the body, only a disconnect or the response's end wakes it
        if cycle.disconnected or cycle.response_complete or self.body is None:
            return {"type": "http.disconnect"}
        body, self.body = self.body, None
        return {"type": "http.request", "body": body, "more_body": False}


def protocol_class(max_body_bytes: int) -> type[DirectBodyProtocol]:
    """The protocol for uvicorn's ``http=`` setting, reading direct bodies up to the body cap."""
    return type("DirectBodyProtocol", (DirectBodyProtocol,), {"max_body_bytes": max_body_bytes})
