"""The routers' typed dependencies: the engine the routes call, the API-key check and the caller it
admitted, and the process's runtime for the routes that read it directly (the infer fast path's
parsing, the shared-memory, devices, metrics and dashboard routes: none takes a model lock or
touches a device array)."""

from __future__ import annotations

import hmac
import ipaddress

from fastapi import Request

from mmad.engine.api import Caller, EngineClient
from mmad.engine.repository_poll import refuse_changes
from mmad.engine.runtime import Runtime
from mmad.errors import Forbidden, NotReady, Unauthorized


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
    the key verified where one is set."""
    client = request.client
    try:
        loopback = client is not None and ipaddress.ip_address(client.host).is_loopback
    except ValueError:  # a Unix socket's or test client's name
        loopback = False
    return Caller(key_verified=request.app.state.runtime.settings.api_key_value is not None, loopback=loopback)
