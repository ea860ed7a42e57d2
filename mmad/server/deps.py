"""The routers' typed dependencies: the runtime every route reaches, and the API-key check."""

from __future__ import annotations

import hmac
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from mmad.backends.contract import Backend, ProbeRow
from mmad.errors import Forbidden, NotReady, Unauthorized
from mmad.server.metrics import Metrics
from mmad.server.repository_poll import refuse_changes
from mmad.server.settings import Settings
from mmad.server.shm import SharedMemoryRegistry


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
    shm: SharedMemoryRegistry = field(default_factory=SharedMemoryRegistry)  # Triton's system shared-memory regions
    ready: bool = False
    shutting_down: bool = False
    workers: Any = None  # the serving workers (mmad.server.workers.WorkerPool) of a primary with --workers
    # --workers on the cuda backend (mmad.server.region_forwards): the primary runs its workers'
    # forwards between CUDA regions and between system regions (its RegionForwardRunner); a
    # worker sends them (its RegionForwardClient)
    region_service: Any = None
    region_forwards: Any = None
    repository_poller: Any = None  # --model-control-mode poll (mmad.server.repository_poll.RepositoryPoller)


async def runtime(request: Request) -> Runtime:  # async: FastAPI runs sync dependencies in a thread pool
    rt: Runtime = request.app.state.runtime
    if not rt.ready:
        raise NotReady("the daemon is starting or stopping")
    return rt


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
