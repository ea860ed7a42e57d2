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

It also bounds what a connection may cost (:class:`ConnectionLimits`, docs/reliability.md):

- past ``max_connections`` a connection gets one of ``health_slots`` kept for health probes: it
  may send one ``GET /v2/health/live`` or ``/ready`` (answered, then closed); any other request
  there is 503. A new connection finding every slot taken closes the slot connection that has
  waited longest for its request (503): a probe sends its request at once and is answered
  before others can push it out. Past the slots, 503 and close before anything is read;
- a connection that sends nothing is closed after uvicorn's keep-alive timeout; a request line
  and headers must arrive within ``head_timeout_s`` of their first byte (408, slowloris) and
  within ``max_header_bytes`` (431: httptools itself accumulates a header of any size);
- a request body must bring at least ``min_body_rate`` bytes a second in every
  ``body_timeout_s`` window (at least one byte: a stalled body is cut however fast it began),
  or it is answered 408 and closed; windows in which the daemon itself is not reading (the
  app has not taken what arrived, or has not yet asked for a ``100-continue`` body) do not count;
- the bodies still arriving hold at most ``max_pending_body_bytes`` together (per process,
  counted as their bytes arrive, so that only bytes sent hold any of it): the body whose bytes
  would pass it is answered 503 with ``Retry-After`` and closed;
- reads outside a direct body go into one scratch buffer per thread, not one per connection.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from mmad.server.bodies import tensor_buffer
from mmad.server.errors import error_response

DIRECT_BODY_MIN = 256 * 1024
SCRATCH_BYTES = 256 * 1024  # reads outside a direct body (uvloop's own read size)

log = logging.getLogger("mmad.server")


HEALTH_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 2048
    head_timeout_s: float = 10.0
    max_header_bytes: int = 64 * 1024
    health_slots: int = 16
    body_timeout_s: float = 10.0
    min_body_rate: int = 16 * 1024
    max_pending_body_bytes: int = 512 * 1024 * 1024


class BodyBudget:
    """The bytes of request bodies still arriving that the connections of one server hold."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0

    def take(self, nbytes: int) -> bool:
        if self.held + nbytes > self.limit:
            return False
        self.held += nbytes
        return True

    def give(self, nbytes: int) -> None:
        self.held -= nbytes


_scratch = threading.local()


def scratch_buffer() -> memoryview:
    """The event loop thread's read buffer, shared by its connections: each read is copied out
    (into the parser) in the ``buffer_updated`` call that follows it, before any other connection
    reads. One per connection held 256 KiB each: 2,000 idle sockets cost 523 MiB."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None:
        buffer = _scratch.buffer = memoryview(bytearray(SCRATCH_BYTES))
    return buffer


def raw_response(status: int, reason: str, message: str, extra: str = "") -> bytes:
    """A complete ``Connection: close`` response written by the protocol itself (no request cycle)."""
    body = orjson.dumps({"error": message})
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n").encode("latin-1") + body


WARN_EVERY_S = 10.0


class DirectBodyProtocol(asyncio.BufferedProtocol):
    """See the module docstring; ``max_body_bytes`` is set by :func:`protocol_class`."""

    max_body_bytes = 0
    limits = ConnectionLimits()
    _warned: ClassVar[list[float]] = [0.0]  # when a refusal was last logged (per server class)
    # per server class (protocol_class): the bodies' reservations, and the connections in health
    # slots, oldest first
    budget: ClassVar[BodyBudget] = BodyBudget(ConnectionLimits.max_pending_body_bytes)
    _health: ClassVar[dict[_HttpToolsDirect, None]] = {}

    def __init__(self, *args: Any, **kwargs: Any):
        self.http = _HttpToolsDirect(self.max_body_bytes, self.limits, self.budget, *args, **kwargs)
        self.refused = False

    # -- the transport's calls, for uvicorn's protocol --------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        open_now = len(self.http.connections) - len(self._health)
        if open_now >= self.limits.max_connections and not self._take_health_slot():
            # refused before uvicorn sees it: no parser state, no timers, the descriptor freed at once
            self.refused = True
            now = time.monotonic()
            if now - self._warned[0] >= WARN_EVERY_S:
                self._warned[0] = now
                log.warning("connection refused: %d connections are open (max_connections %d)",
                            open_now, self.limits.max_connections)
            transport.write(raw_response(  # type: ignore[attr-defined]
                503, "Service Unavailable", too_many_connections(open_now, self.limits), "retry-after: 1\r\n"))
            transport.close()
            return
        self.http.connection_made(transport)  # type: ignore[arg-type]

    def _take_health_slot(self) -> bool:
        """A health slot for this connection, pushing out the slot connection that has waited
        longest for its request when all are taken; False when none can be had."""
        if not self.limits.health_slots:
            return False
        if len(self._health) >= self.limits.health_slots:
            # a slot connection turned away is only finishing its 503: its slot is free
            waiting = next((c for c in self._health if c.in_head or c.turned_away), None)
            if waiting is None:  # every slot is answering a health probe
                return False
            del self._health[waiting]
            if not waiting.turned_away:
                waiting.health_only = False
                waiting.refuse(503, "Service Unavailable", too_many_connections(
                    len(self.http.connections) - len(self._health), self.limits), "retry-after: 1\r\n")
        self.http.health_only = True
        self._health[self.http] = None
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.refused:
            self._health.pop(self.http, None)
            self.http.connection_lost(exc)

    def eof_received(self) -> bool | None:
        return None if self.refused else self.http.eof_received()

    def pause_writing(self) -> None:
        self.http.pause_writing()

    def resume_writing(self) -> None:
        self.http.resume_writing()

    # -- buffered reads ---------------------------------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        http = self.http
        if http.direct is not None:  # never past the body: the next request goes to the parser
            return http.direct[http.filled:]
        return scratch_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        http = self.http
        if self.refused or http.parser is None:
            return
        if http.direct is None:
            if http.in_head:
                http.head_bytes += nbytes
            http.data_received(bytes(scratch_buffer()[:nbytes]))
            if http.in_head and http.head_bytes:  # a head began in this read or before and is not complete
                # counted per read, so a head may run past the cap by at most one read (256 KiB)
                if http.head_bytes > self.limits.max_header_bytes:
                    http.refuse(431, "Request Header Fields Too Large",
                                f"the request line and headers exceed {self.limits.max_header_bytes} bytes")
                else:
                    http.start_head_timer()
            return
        http.filled += nbytes
        if http.body_open and not http.hold(nbytes):
            return
        if http.filled == len(http.direct):
            # the parser saw only the start of this body: a fresh one reads the next request
            http.parser = httptools.HttpRequestParser(http)
            http.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn sets it
            http.finish_direct()


def too_many_connections(open_now: int, limits: ConnectionLimits) -> str:
    slots = f" (and {limits.health_slots} more for health probes)" if limits.health_slots else ""
    return f"too many connections: {open_now} are open, the limit is {limits.max_connections}{slots}"


def refusal_app(status: int, message: str):
    """An ASGI app answering ``status`` with ``message`` (Retry-After on 503), reading nothing."""
    headers = {"Retry-After": "1"} if status == 503 else None

    async def refuse(scope, receive, send) -> None:
        await error_response(status, message, headers)(scope, receive, send)

    return refuse


class _HttpToolsDirect(HttpToolsProtocol):
    """uvicorn's protocol, deciding at each request's headers whether its body is read in place."""

    def __init__(self, max_body_bytes: int, limits: ConnectionLimits, budget: BodyBudget, *args: Any,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.max_body_bytes = max_body_bytes
        self.limits = limits
        self.budget = budget
        self.direct: memoryview | None = None  # the body being read in place
        self.filled = 0
        self.in_head = True  # waiting for (the rest of) a request line and headers
        self.head_bytes = 0
        self.head_timer: asyncio.TimerHandle | None = None
        self.health_only = False  # in a health slot: one health probe, then closed
        self.turned_away = False  # in a health slot with another request: answered 503, closing
        # the request body arriving: its reservation, the bytes of the current window, its timer
        self.body_open = False
        self.body_held = 0
        self.body_window = 0
        self.body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # uvicorn arms its keep-alive timer only after a response: a connection that never sent a
        # request was never closed
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                            self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        self._end_body()
        super().connection_lost(exc)

    # -- the request head: its time and its size ------------------------------------------
    def start_head_timer(self) -> None:
        """From the first read of an incomplete head (a head that arrives whole in one read needs
        none): uvicorn's keep-alive timer stops at the first byte, so one byte a second held a
        connection for ever."""
        if self.head_timer is None and not self.transport.is_closing():
            self.head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.in_head:
            self.refuse(408, "Request Timeout",
                        f"the request line and headers did not arrive within {self.limits.head_timeout_s:g} s")

    def _stop_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _next_head(self) -> None:
        self.in_head, self.head_bytes = True, 0

    def refuse(self, status: int, reason: str, message: str, extra: str = "") -> None:
        """Answer ``status`` and close, unless a response is still being sent on this connection
        (pipelining): then the connection closes after it, and nothing more is read."""
        self._stop_head_timer()
        self.in_head = False
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
            self.flow.pause_reading()
            return
        self._log_refusal(status, message)
        self.transport.write(raw_response(status, reason, message, extra))
        self.transport.close()

    def _log_refusal(self, status: int, message: str) -> None:
        log.info("%s %d: %s", "{}:{}".format(*self.client) if self.client else "client", status, message)

    def on_headers_complete(self) -> None:
        self.in_head = False
        self._stop_head_timer()
        headers = dict(self.headers)
        refusal = self._turned_away()
        if refusal is not None:  # answered by a refusal in place of the app, then closed
            self.turned_away = True
            self._log_refusal(503, refusal)
            app, self.app = self.app, refusal_app(503, refusal)
            try:
                super().on_headers_complete()
            finally:
                self.app = app
            self.cycle.keep_alive = False
            return
        super().on_headers_complete()
        if self.health_only:
            self.cycle.keep_alive = False  # the slot is free again once the probe is answered
        self._start_body(headers)
        size = self._direct_size(headers)
        if size is None:
            return
        header_length = headers.get(b"inference-header-content-length", b"").decode("latin-1")
        self.direct, self.filled = tensor_buffer(size, header_length), 0
        self.cycle.receive = _DirectReceive(self.cycle)  # run_asgi looks it up when the task starts

    def _turned_away(self) -> str | None:
        """Why this request is answered 503 without reaching the app: a request other than a
        health probe in a health slot."""
        if not self.health_only:
            return None
        path = httptools.parse_url(self.url).path.decode("latin-1")
        if self.parser.get_method() not in (b"GET", b"HEAD") or path not in HEALTH_PATHS:
            return (f"too many connections: this one is past the limit of {self.limits.max_connections} "
                    "and may only ask GET /v2/health/live or /v2/health/ready")
        return None

    # -- the request body: its rate and the memory held ----------------------------------
    def _start_body(self, headers: dict[bytes, bytes]) -> None:
        if b"transfer-encoding" not in headers and headers.get(b"content-length", b"0") in (b"", b"0"):
            return  # no body
        self.body_open, self.body_window = True, 0
        self.body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_window_over)

    def hold(self, nbytes: int) -> bool:
        """Count ``nbytes`` more of the body against the budget of bodies still arriving and
        against this window's rate; past the budget, 503 and close (False)."""
        self.body_window += nbytes
        if self.budget.take(nbytes):
            self.body_held += nbytes
            return True
        self.cut_body(503, "Service Unavailable",
                      f"too many request bodies are arriving at once: {self.budget.held} bytes of them are held, the "
                      f"limit is {self.budget.limit} (--max-pending-body-bytes)", "retry-after: 1\r\n")
        return False

    def _body_window_over(self) -> None:
        self.body_timer = None
        if not self.body_open or self.transport.is_closing():
            return
        window, rate = self.limits.body_timeout_s, self.limits.min_body_rate
        cycle = self.cycle
        waiting = self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue)
        if not waiting and self.body_window < max(1, rate * window):
            self.cut_body(408, "Request Timeout",
                          f"the request body arrived at {self.body_window / window:.0f} bytes/s over the last "
                          f"{window:g} s; this daemon needs at least {rate} bytes/s (--min-body-rate)")
            return
        self.body_window = 0
        self.body_timer = self.loop.call_later(window, self._body_window_over)

    def _end_body(self) -> None:
        """The body is complete (or will never be): its reservation and its timer go."""
        self.body_open = False
        if self.body_held:
            self.budget.give(self.body_held)
            self.body_held = 0
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None

    def cut_body(self, status: int, reason: str, message: str, extra: str = "") -> None:
        """Stop reading the body now: answer ``status`` unless the app already began its
        response, tell the app the client is gone, close."""
        self._end_body()
        self.direct = None
        if self.transport.is_closing():
            return
        self._log_refusal(status, message)
        cycle = self.cycle
        if cycle is not None:
            if not cycle.response_started:
                self.transport.write(raw_response(status, reason, message, extra))
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    def on_body(self, body: bytes) -> None:
        if self.transport.is_closing():
            return  # cut, or answered and closing: the rest of this read is nobody's
        if self.body_open and not self.hold(len(body)):
            return
        if self.direct is None:
            super().on_body(body)
            return
        # the rest of the read that held the headers
        self.direct[self.filled:self.filled + len(body)] = body
        self.filled += len(body)

    def on_message_complete(self) -> None:
        self._end_body()
        if self.direct is None:
            self._next_head()
            super().on_message_complete()
            return
        self.finish_direct()  # the whole body came with the headers

    def _direct_size(self, headers: dict[bytes, bytes]) -> int | None:
        scope = self.scope
        if scope.get("method") != "POST" or not scope.get("path", "").endswith("/infer"):
            return None
        if self.parser.should_upgrade() or self.expect_100_continue:
            return None  # uvicorn's own receive sends the 100 Continue
        length = headers.get(b"content-length", b"")
        if b"transfer-encoding" in headers or not length.isdigit():
            return None
        size = int(length)
        return size if DIRECT_BODY_MIN <= size <= self.max_body_bytes else None

    def finish_direct(self) -> None:
        self._end_body()
        self._next_head()
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


def protocol_class(max_body_bytes: int, limits: ConnectionLimits | None = None) -> type[DirectBodyProtocol]:
    """The protocol for uvicorn's ``http=`` setting, reading direct bodies up to the body cap."""
    limits = limits or ConnectionLimits()
    # the budget holds at least one body of the cap
    budget = BodyBudget(max(limits.max_pending_body_bytes, max_body_bytes))
    return type("DirectBodyProtocol", (DirectBodyProtocol,),
                {"max_body_bytes": max_body_bytes, "limits": limits, "_warned": [0.0], "budget": budget,
                 "_health": {}})
