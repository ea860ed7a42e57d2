"""The routers' typed dependencies: the engine the routes call, the API-key check and the caller it
admitted, and the process's runtime for the routes that read it directly (the infer fast path's
parsing and request counters, Prometheus text, the workers' internal routes: none takes a model
lock or touches a device array)."""

from __future__ import annotations

import hmac

from fastapi import Request

from mmad.engine.api import Caller, EngineClient
from mmad.engine.peers import peer_of
from mmad.engine.repository_poll import refuse_changes
from mmad.engine.runtime import Runtime
from mmad.errors import Forbidden, NotReady, Unauthorized
from mmad.server.internal import check_token


async def runtime(request: Request) -> Runtime:  # async: FastAPI runs sync dependencies in a thread pool
    rt: Runtime = request.app.state.runtime
    if not rt.ready:
        raise NotReady("the daemon is starting or stopping")
    return rt


async def engine(request: Request) -> EngineClient:
    """The engine the routes call (:class:`~mmad.engine.api.EngineClient`): parse, call it, encode."""
    return request.app.state.engine


async def require_key(request: Request) -> None:  # async: no thread hop per request
    """Dependency of every mutating endpoint: ``Authorization: Bearer <key>`` when a key is set;
    a change to a model is refused on a daemon that follows a model repository."""
    settings = request.app.state.runtime.settings
    expected = settings.api_key_value
    if expected is not None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("this endpoint needs 'Authorization: Bearer <api key>'")
        if not hmac.compare_digest(token.strip().encode(), expected.encode()):
            raise Forbidden("the API key is not valid")
    if "model" in request.path_params:
        refuse_changes(settings, request.path_params["model"])


def admitted_caller(request: Request) -> Caller:
    """The engine's :class:`~mmad.engine.api.Caller` of a request :func:`require_key` admitted:
    the key verified where one is set, and the client's TCP address, as the connection tells it
    or, for a request a serving worker passed on (``--workers``: it arrives without a client,
    beside the link's token), as the worker named it."""
    rt: Runtime = request.app.state.runtime
    via_worker = request.client is None and rt.workers is not None and check_token(request.headers, rt.workers.token)
    peer = peer_of(request.scope, via_worker)
    return Caller(key_verified=rt.settings.api_key_value is not None, loopback=peer is not None and peer.loopback,
                  address=None if peer is None else (peer.host, peer.port, peer.server_port))
