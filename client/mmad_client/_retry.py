"""When the client sends a request again: :class:`Retry`, and the tenacity settings made from it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import httpx
import tenacity

from .errors import HTTPStatusError, TransportError, parse_retry_after

log = logging.getLogger("mmad_client")

# Failures where the server cannot have acted on the request, or dropped the connection before
# answering. Read/write/pool timeouts are not among them: the request may still be running, and
# another try would multiply the caller's timeout.
RETRIED_TRANSPORT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError)


@dataclass(frozen=True)
class Retry:
    """How :class:`~mmad_client.Client` and :class:`~mmad_client.AsyncClient` try a call again.

    A call is tried again when the connection failed or was dropped before an answer, or when the
    server answered one of ``statuses`` (503: not ready or a full batcher queue; 502 and 504 from a
    proxy in front of it). The wait before try *n+1* is the server's ``Retry-After`` when it sent
    one, else ``backoff * 2**(n-1)``; plus up to ``jitter`` seconds at random (so clients refused
    at once do not all come back at once); at most ``max_wait``. A ``Retry-After`` longer than
    ``max_wait`` is not waited for: the error is raised at once.

    Only calls that can be repeated without changing the outcome are tried again (health,
    metadata, ``infer``, reading weights, versions, jobs, statistics, load/unload); calls that
    create or change something (``create_model``, ``set_weights``, ``checkpoint``, ``train_step``,
    dataset uploads, ``start_job``, deletes) are sent once unless ``non_idempotent=True``, which
    is only safe when doing one twice does no harm. ``Retry(attempts=1)`` (or ``retry=None`` on
    the client) sends every call once.
    """

    attempts: int = 4
    backoff: float = 0.25
    max_wait: float = 10.0
    jitter: float = 0.25
    statuses: frozenset[int] = frozenset({502, 503, 504})
    non_idempotent: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"Retry.attempts is the number of tries, at least 1; got {self.attempts!r}")
        for name in ("backoff", "max_wait", "jitter"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"Retry.{name} is seconds, 0 or more; got {value!r}")
        statuses = frozenset(self.statuses)
        if not all(isinstance(s, int) and 400 <= s <= 599 for s in statuses):
            raise ValueError(f"Retry.statuses are HTTP error statuses (400-599); got {sorted(self.statuses)!r}")
        object.__setattr__(self, "statuses", statuses)

    def applies(self, idempotent: bool) -> bool:
        return self.attempts > 1 and (idempotent or self.non_idempotent)

    def should_retry(self, exc: BaseException) -> bool:
        if isinstance(exc, TransportError):
            return isinstance(exc.__cause__, RETRIED_TRANSPORT_ERRORS)
        if isinstance(exc, HTTPStatusError) and exc.status_code in self.statuses:
            after = _retry_after(exc)
            return after is None or after <= self.max_wait
        return False

    def wait(self, state: tenacity.RetryCallState) -> float:
        jitter = tenacity.wait_random(0, self.jitter)(state)
        after = _retry_after(state.outcome.exception())
        if after is not None:
            # never sooner than the server asked (should_retry saw it within max_wait); the jitter
            # spreads the clients it refused at once so they do not all come back at once
            return max(after, min(after + jitter, self.max_wait))
        return min(self.max_wait, tenacity.wait_exponential(multiplier=self.backoff)(state) + jitter)

    def tenacity_options(self, method: str, path: str) -> dict[str, Any]:
        """``Retrying``/``AsyncRetrying`` arguments for one call (its sleep function aside)."""
        def before_sleep(state: tenacity.RetryCallState) -> None:
            log.info("%s %s: %s; try %d of %d in %.2f s", method, path, state.outcome.exception(),
                     state.attempt_number + 1, self.attempts, state.upcoming_sleep)

        return {"stop": tenacity.stop_after_attempt(self.attempts), "wait": self.wait,
                "retry": tenacity.retry_if_exception(self.should_retry), "before_sleep": before_sleep,
                "reraise": True}


def _retry_after(exc: BaseException | None) -> float | None:
    if isinstance(exc, HTTPStatusError) and exc.response is not None:
        return parse_retry_after(exc.response.headers.get("retry-after"))
    return None


DEFAULT_RETRY = Retry()
