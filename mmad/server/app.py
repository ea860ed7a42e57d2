"""The FastAPI application: ``create_app(settings)``.

The lifespan probes the devices once, picks the backend (``settings.backend`` or the best
available, never a silent fallback from a forced one), opens the store, creates the demo model
when the store is empty, loads every model, creates those of the model repository the store
lacks (``mmad.engine.repository``) or, in poll mode, follows the repository
(``mmad.engine.repository_poll``), and on exit stops training jobs (each writes a
final checkpoint), stops the batchers and frees every device buffer.
"""

from __future__ import annotations

import contextlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI

import mmad
from mmad.backends import probe_all, select
from mmad.engine import hostmem
from mmad.engine.inprocess import InProcessEngine
from mmad.server.bodies import BodyLimitMiddleware
from mmad.engine.runtime import Runtime, ServingWorkers
from mmad.server.errors import install_error_handlers
from mmad.engine.jobs import JobManager
from mmad.engine.metrics import Metrics
from mmad.engine.registry import DEMO_NAME, DEMO_SPEC, ModelConfig, Registry
from mmad.engine.repository import load_repository
from mmad.engine.repository_poll import RepositoryPoller
from mmad.server.routers import ALL as ROUTERS, ui
from mmad.server.inference import InferFastPath
from mmad.server.origin import guarded
from mmad.settings import Settings
from mmad.engine.store import Store
from mmad.spec import MLPSpec

log = logging.getLogger("mmad.server")


def _probe_rows(settings: Settings, selected):
    """Rows for ``/v2/devices``: every backend, or the ones ``settings.probe`` lists."""
    if settings.probe.strip().lower() == "all":
        return probe_all()
    names = [n.strip() for n in settings.probe.split(",") if n.strip()]
    return probe_all(names) if names else [selected]


def use_backend(rt: Runtime, name: str) -> None:
    """Select the backend (``name``: forced, or '' for the best available) for the runtime: its
    shared-memory regions and, on a GPU backend, page-locked bodies (the primary's and each
    serving worker's start)."""
    backend, row = select(name)
    rt.backend, rt.selected = backend, row
    rt.shm.use_backend(backend, row.backend)
    alloc = backend.page_locked_allocator()
    if alloc is not None and rt.settings.pinned_body_bytes:
        hostmem.install(hostmem.PinnedPool(alloc, rt.settings.pinned_body_bytes))


async def release_runtime(rt: Runtime) -> None:
    """Close the models, the devices, the regions and the thread pools (the primary's and each
    serving worker's stop)."""
    if rt.registry is not None:
        await rt.registry.close()
    if rt.backend is not None:
        rt.backend.close()
    if rt.store is not None:
        rt.store.close()
    rt.shm.close()
    hostmem.install(None)
    rt.executor.shutdown(wait=True)
    rt.forward_pool.shutdown(wait=True)


async def start_runtime(rt: Runtime) -> None:
    settings = rt.settings
    use_backend(rt, settings.backend or "")
    backend, row = rt.backend, rt.selected
    rt.probe_rows = _probe_rows(settings, row)
    log.info("backend %s:%s on %s", row.backend, row.variant, row.device)
    rt.store = Store(settings.store_dir, keep_versions=settings.keep_versions)
    rt.registry = Registry(settings, rt.store, backend, row, rt.executor, rt.metrics, rt.forward_pool)
    rt.jobs = JobManager(rt.registry)
    rt.metrics.track(lambda: rt.registry.models)
    if rt.workers is not None:  # what inference can see is published to the serving workers
        rt.registry.publish = rt.workers.publish
        rt.shm.on_change = rt.registry.changed
        if rt.shm.cuda_enabled:
            from mmad.engine.region_forwards import RegionForwardRunner

            rt.region_service = RegionForwardRunner(rt, rt.workers.region_forwards_socket)
    # a daemon given a model repository serves what it holds, as Triton does: no demo model
    if settings.demo and settings.model_repository is None and not rt.store.list_models():
        await rt.registry.create(DEMO_NAME, MLPSpec.from_json(DEMO_SPEC), ModelConfig())
        log.info("created the demo model %r", DEMO_NAME)
    await rt.registry.load_all()
    if settings.model_repository is not None and settings.model_control_mode == "poll":
        rt.repository_poller = RepositoryPoller(rt.registry, settings.model_repository, settings.repository_poll_secs)
        await rt.repository_poller.sync()  # ready once it serves what the repository holds now
        rt.repository_poller.start()
    elif settings.model_repository is not None:
        await load_repository(rt.registry, settings.model_repository)
    rt.ready = True


async def stop_runtime(rt: Runtime) -> None:
    rt.shutting_down = True
    if rt.jobs is not None:
        await rt.jobs.shutdown()
    rt.ready = False
    if rt.repository_poller is not None:
        await rt.repository_poller.stop()
    if rt.region_service is not None:
        rt.region_service.stop()
    await release_runtime(rt)


async def start_grpc(rt: Runtime, engine: InProcessEngine):
    """The gRPC front end over this process's engine (None with ``grpc_port`` 0, and in a primary
    with serving workers: each of them serves the port, :mod:`mmad.server.worker`)."""
    settings = rt.settings
    if not settings.grpc_port or rt.workers is not None:
        return None
    from mmad.grpc.server import serve

    return await serve(engine, settings.host, settings.grpc_port, settings.api_key_value,
                       settings.max_body_bytes, settings.max_response_bytes, settings.max_connections)


class MMADApp(FastAPI):
    """FastAPI with the infer hot path in front of its middleware stack: each request meets the
    cross-site and body-type rules (:mod:`mmad.server.origin`), the body cap, then
    :class:`~mmad.server.inference.InferFastPath`, and only what that passes on reaches FastAPI
    (whose middleware layers cost ~10% of a large shared-memory request's event-loop time,
    measured on an H100)."""

    def __init__(self, runtime: Runtime, engine: InProcessEngine, settings: Settings, **kwargs):
        super().__init__(**kwargs)
        self._front = guarded(BodyLimitMiddleware(InferFastPath(super().__call__, runtime, engine),
                                                  max_bytes=settings.max_body_bytes), settings.allow_origin)

    async def __call__(self, scope, receive, send) -> None:
        await self._front(scope, receive, send)


def create_app(settings: Settings | None = None, workers: ServingWorkers | None = None) -> FastAPI:
    """The daemon's app; ``workers``: the serving workers (:class:`~mmad.server.workers.WorkerPool`)
    of a primary started with ``--workers``."""
    settings = settings or Settings()
    rt = Runtime(settings=settings, metrics=Metrics(), workers=workers,
                 executor=ThreadPoolExecutor(settings.compute_threads, thread_name_prefix="mmad-compute"),
                 forward_pool=ThreadPoolExecutor(settings.forward_threads or os.cpu_count() or 1,
                                                 thread_name_prefix="mmad-forward"))
    engine = InProcessEngine(rt)  # what the routes, the infer fast path and gRPC reach the engine through

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        grpc_server = None
        try:
            await start_runtime(rt)
            grpc_server = await start_grpc(rt, engine)
            yield
        finally:
            if grpc_server is not None:  # its calls in flight finish before the runtime goes
                await grpc_server.stop(settings.graceful_timeout_s)
            await stop_runtime(rt)

    app = MMADApp(rt, engine, settings, title="mmad", version=mmad.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, description="Open Inference Protocol v2 + mmad extensions (docs/api.md)")
    app.state.runtime = rt
    app.state.engine = engine
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    ui.install(app)  # /ui and /docs from the package's files
    return app
