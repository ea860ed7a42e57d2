"""A serving worker of ``mmad serve --workers N`` (the design: :mod:`mmad.server.workers`).

It answers ``POST /v2/models/{m}/infer`` for the models it holds, through the same handler as
the primary (:func:`~mmad.server.inference.infer_request`: the same batching, checks, errors and
shared-memory paths), and passes every other request to the primary over its Unix socket,
bodies and responses streamed. It serves the gRPC port too (with the other workers, each
connection to one of them), over its own engine client
(:class:`~mmad.engine.worker_client.WorkerEngine`): infer for the models it holds here, every
other call passed to the primary's engine. Before an infer request it compares the primary's generation
counter with the one it last synced and, when it moved, re-reads the primary's state: models
created, replaced or gone, new live weights, new versions, shared-memory regions.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import httpx
from fastapi import Request

from mmad.errors import MMADError, NotReady, PayloadTooLarge
from mmad.engine.inprocess import InProcessEngine
from mmad.engine.worker_client import WorkerEngine
from mmad.server.app import release_runtime, use_backend
from mmad.server.bodies import BodyLimitMiddleware, json_response
from mmad.engine.runtime import Runtime
from mmad.server.errors import error_response, internal_error_response, mmad_error_response, status_for
from mmad.server.inference import InferFastPath, infer_request
from mmad.engine.messages import HeldModel, PrimaryState, ServedModel, WorkerRecords
from mmad.engine.metrics import Metrics
from mmad.server.origin import guarded
from mmad.engine.registry import ModelConfig, ModelEntry, Registry
from mmad.settings import Settings
from mmad.engine.store import tensors_from_bytes
from mmad.engine.peers import CLIENT_HEADER, peer_of
from mmad.server.internal import INTERNAL_PREFIX, TOKEN_HEADER, check_token
from mmad.server.workers import SharedCounter, WorkerLink
from mmad.spec import MLPSpec

log = logging.getLogger("mmad.server.worker")

# headers only a worker sets (the client's own are dropped): the client's address for the
# shared-memory admin routes, which the primary believes only beside the link's token
WORKER_SET = frozenset({CLIENT_HEADER.encode(), TOKEN_HEADER.encode()})
SHM_ROUTES = ("/v2/systemsharedmemory", "/v2/cudasharedmemory")
# headers of one connection, not of the request (RFC 9110 7.6.1): never passed on
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
                        b"upgrade"})
NOT_PASSED_ON = HOP_BY_HOP | WORKER_SET
# and the primary's own ``date`` and ``server``: this process's server writes its own
NOT_PASSED_BACK = HOP_BY_HOP | {b"date", b"server"}
PRIMARY_WAIT_LOG_S = 10.0
FOLLOW_INTERVAL_S = 0.02


class WorkerRegistry(Registry):
    """The models a worker serves: compiled copies of the primary's ready models, on the same
    devices and variant, with its live weights. No store: nothing here is ever written."""

    def __init__(self, settings: Settings, backend, row, executor, metrics: Metrics, forward_pool):
        super().__init__(settings, None, backend, row, executor, metrics, forward_pool)
        self.followed: dict[str, tuple[tuple, int]] = {}  # name -> (its shape, the generation of its weights)
        self._failed: dict[str, str] = {}  # name -> the incarnation that could not be compiled here

    async def follow(self, models: list[ServedModel], weights: Callable[[str], Any]) -> None:
        """Hold what ``models`` (the primary's state) lists: compile what is new or changed
        shape, load weights whose generation moved, drop what is gone. A model that cannot be
        compiled here is left out (logged once): its requests go to the primary."""
        wanted = {doc.name: doc for doc in models}
        for name in [n for n in self.models if n not in wanted]:
            await self._drop(name)
        for name, doc in wanted.items():
            shape = doc.shape
            held = self.followed.get(name)
            if held is None or held[0] != shape:
                if self._failed.get(name) == doc.incarnation:
                    continue
                try:
                    await self._replace(doc, await weights(name))
                except httpx.HTTPError:  # the primary unreachable: the whole sync fails, tried again later
                    raise
                except Exception as exc:  # noqa: BLE001 - whatever stops one model, the others serve
                    self._failed[name] = doc.incarnation
                    log.error("model %r cannot be served by this worker (%s); the primary answers its requests",
                              name, exc)
                    await self._drop(name)
                    continue
            elif held[1] != doc.generation:
                params = await weights(name)
                await self.run(self.models[name].put_all, params)
            self.followed[name] = (shape, doc.generation)
            self.models[name].versions = [{"version": doc.version}]

    async def _drop(self, name: str) -> None:
        self.followed.pop(name, None)
        entry = self.models.pop(name, None)
        if entry is not None:
            await self._deactivate(entry)

    async def _replace(self, doc: ServedModel, params) -> None:
        spec, config = MLPSpec.from_json(doc.spec), ModelConfig.parse(doc.config)

        def build():
            compiled = self._compile_replicas(spec, doc.devices, doc.variant,
                                              config.limits(self.settings).max_batch_rows)
            try:
                for model in compiled:
                    model.set_params(params)
            except BaseException:
                for model in compiled:
                    model.close()
                raise
            return compiled

        compiled = await self.run(build)
        held = self.models.get(doc.name)
        entry = ModelEntry(doc.name, spec, config)
        entry.incarnation = doc.incarnation
        if held is not None and held.incarnation == entry.incarnation:
            entry.stats = held.stats  # the same model compiled again: its counts go on
        if held is not None:
            await self._deactivate(held)
        self.models[entry.name] = entry
        self._activate(entry, compiled)
        self._failed.pop(entry.name, None)


class PrimaryLink:
    """The worker's side of the link: the counter, the primary's routes, and the sync."""

    def __init__(self, link: WorkerLink, idle_timeout_s: float):
        self.link = link
        self.counter = SharedCounter(link.counter_path)
        self.client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=link.primary_socket), base_url="http://primary",
            # SSE streams and long training requests pass through: no read timeout
            timeout=httpx.Timeout(connect=10.0, read=None, write=None, pool=None),
            # idle connections are let go well before the primary closes them (its --idle-timeout),
            # so a request is never sent on one the primary is closing
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                keepalive_expiry=idle_timeout_s / 2))
        self.synced = -1
        self._lock = asyncio.Lock()

    async def internal(self, path: str) -> httpx.Response:
        response = await self.client.get(INTERNAL_PREFIX + path, headers={TOKEN_HEADER: self.link.token})
        response.raise_for_status()
        return response

    async def wait_for_primary(self) -> PrimaryState:
        """The primary's state, once it answers (it may still be loading its models)."""
        waited = 0.0
        while True:
            try:
                return PrimaryState.from_json((await self.internal("/state")).json())
            except httpx.HTTPError:
                if not self.link.primary_alive:
                    raise RuntimeError("the primary process is gone") from None
                await asyncio.sleep(0.2)
                waited += 0.2
                if waited >= PRIMARY_WAIT_LOG_S and waited - 0.2 < PRIMARY_WAIT_LOG_S:
                    log.info("worker %d waits for the primary to finish its start-up", self.link.index)

    async def engine_call(self, method: str, message: bytes) -> bytes:
        """A call of the engine's interface, answered by the primary's engine
        (:func:`mmad.engine.worker_client.answer_call`)."""
        try:
            response = await self.client.post(f"{INTERNAL_PREFIX}/engine/{method}", content=message,
                                              headers={TOKEN_HEADER: self.link.token})
        except httpx.HTTPError as exc:
            raise NotReady("the daemon's primary process is not answering; try again") from exc
        if response.status_code == 413:  # a call past the primary's body cap (a pinned infer near it)
            raise PayloadTooLarge(response.json().get("error", "the request is larger than the daemon takes"))
        if response.status_code != 200:  # the primary failed on it: its bug, answered as one here
            raise RuntimeError(f"the primary process answered {method} with {response.status_code}: "
                               f"{response.text[:300]}")
        return response.content

    async def said_ready(self) -> None:
        response = await self.client.post(f"{INTERNAL_PREFIX}/ready/{self.link.index}",
                                          headers={TOKEN_HEADER: self.link.token})
        response.raise_for_status()

    @property
    def stale(self) -> bool:
        return self.counter.value != self.synced

    async def sync(self, rt: Runtime, state: PrimaryState | None = None) -> None:
        """Follow the primary's state if the counter moved since the last sync (one sync at a
        time; requests arriving meanwhile wait for it)."""
        async with self._lock:
            if state is None:
                if not self.stale:
                    return
                state = PrimaryState.from_json((await self.internal("/state")).json())

            async def weights(name: str):
                return tensors_from_bytes((await self.internal(f"/weights/{name}")).content, "the live weights")

            await rt.registry.follow(state.models, weights)
            await rt.registry.run(rt.shm.follow, state.shm)
            self.synced = state.generation


class WorkerApp:
    """The worker's ASGI app: the lifespan (device, first sync), infer for held models, the
    statistics route for the primary, and the pass-through for everything else."""

    def __init__(self, settings: Settings, link: WorkerLink):
        self.settings = settings
        self.link = link
        self.primary = PrimaryLink(link, settings.idle_timeout_s)
        self._follower: asyncio.Future | None = None
        self.grpc = None  # this worker's gRPC server, when the daemon serves gRPC
        self.rt = Runtime(settings=settings, metrics=Metrics(process=link.index, gpu=False),
                          executor=ThreadPoolExecutor(settings.compute_threads, thread_name_prefix="mmad-compute"),
                          forward_pool=ThreadPoolExecutor(settings.forward_threads or os.cpu_count() or 1,
                                                          thread_name_prefix="mmad-forward"))
        self.engine = InProcessEngine(self.rt)  # its HTTP infer's; its gRPC server's passes the rest on

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self.lifespan(receive, send)
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == INTERNAL_PREFIX + "/records":
            return await self.records(scope, receive, send)
        if scope["method"] == "POST" and path.startswith(InferFastPath.PREFIX) and path.endswith(InferFastPath.SUFFIX):
            model = path[len(InferFastPath.PREFIX):-len(InferFastPath.SUFFIX)]
            if model and "/" not in model and await self.holds(model):
                return await self.infer(scope, receive, send, model)
        await self.pass_on(scope, receive, send)

    async def holds(self, model: str) -> bool:
        """Whether this worker answers infer for ``model`` (after following the primary)."""
        if not self.rt.ready:
            return False
        if self.primary.stale:
            try:
                await self.primary.sync(self.rt)
            except httpx.HTTPError as exc:  # the primary will say what is wrong, or the pass-on will
                log.warning("worker %d could not follow the primary (%s)", self.link.index, exc)
                return False
        entry = self.rt.registry.models.get(model)
        return entry is not None and entry.ready

    async def infer(self, scope, receive, send, model: str) -> None:
        request = Request(scope, receive)
        try:
            response = await infer_request(request, self.engine, self.rt, model, None)
        except MMADError as exc:
            response = mmad_error_response(request, exc)
        except Exception as exc:  # noqa: BLE001 - a bug: a 500 that says so, as the primary gives
            response = internal_error_response(request, exc)
        await response(scope, receive, send)

    async def records(self, scope, receive, send) -> None:
        """This worker's statistics (per model, with its incarnation) and metric samples."""
        request = Request(scope, receive)
        if not check_token(request.headers, self.link.token):
            return await error_response(404, "Not Found")(scope, receive, send)
        registry = self.rt.registry
        held = {} if registry is None else {
            name: HeldModel(entry.incarnation, entry.stats.to_json(name, registry.latest_version(name)),
                            entry.batcher.queued if entry.batcher is not None else 0)
            for name, entry in list(registry.models.items())}
        records = WorkerRecords(held, self.rt.metrics.samples())
        await json_response(records.to_json())(scope, receive, send)

    async def pass_on(self, scope, receive, send) -> None:
        """The request to the primary and its answer back, both streamed; the primary's
        status, headers and body unchanged."""
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in NOT_PASSED_ON]
        peer = peer_of(scope, False)
        if peer is not None and scope["path"].startswith(SHM_ROUTES):  # who registers: the primary decides
            headers += [(CLIENT_HEADER.encode(), peer.header().encode()),
                        (TOKEN_HEADER.encode(), self.link.token.encode())]
        disconnected = asyncio.Event()

        async def body():
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected.set()
                    return
                yield message.get("body", b"")
                if not message.get("more_body", False):
                    return

        target = scope["raw_path"].decode("latin-1") if scope.get("raw_path") else scope["path"]
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        client = self.primary.client
        try:
            upstream = await client.send(client.build_request(scope["method"], target, headers=headers,
                                                              content=body()), stream=True)
        except httpx.HTTPError as exc:
            log.warning("worker %d could not reach the primary: %s", self.link.index, exc)
            if not disconnected.is_set():
                await error_response(503, "the daemon's primary process is not answering; try again")(
                    scope, receive, send)
            return
        except MMADError as exc:  # the body cap, counted while the body streamed through
            await error_response(status_for(exc), str(exc), {"Connection": "close"})(scope, receive, send)
            return
        watch = asyncio.ensure_future(self._until_disconnect(receive, disconnected))
        try:
            await send({"type": "http.response.start", "status": upstream.status_code,
                        "headers": [(k, v) for k, v in upstream.headers.raw if k.lower() not in NOT_PASSED_BACK]})
            async for chunk in upstream.aiter_raw():
                if disconnected.is_set():  # the client left: stop reading the primary's stream
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except httpx.HTTPError as exc:  # the primary went away mid-answer: the client sees a cut body
            log.warning("worker %d: the primary's answer to %s %s broke off: %s", self.link.index,
                        scope["method"], scope["path"], exc)
        finally:
            watch.cancel()
            await upstream.aclose()

    @staticmethod
    async def _until_disconnect(receive, disconnected: asyncio.Event) -> None:
        while True:
            if (await receive())["type"] == "http.disconnect":
                disconnected.set()
                return

    async def lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as exc:  # noqa: BLE001 - reported to uvicorn, which stops the worker
                    log.exception("worker %d could not start", self.link.index)
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def start(self) -> None:
        rt, settings = self.rt, self.settings
        state = await self.primary.wait_for_primary()
        use_backend(rt, state.backend)  # the primary's backend, whatever MMAD_BACKEND says here
        backend, row = rt.backend, rt.selected
        rt.registry = WorkerRegistry(settings, backend, row, rt.executor, rt.metrics, rt.forward_pool)
        if rt.shm.cuda_enabled:  # requests all in CUDA regions, or all in system regions, run in the
            # primary's context
            from mmad.engine.region_forwards import RegionForwardClient

            rt.region_forwards = rt.registry.row_forwards = RegionForwardClient(self.link.region_forwards_socket)
        rt.metrics.track(lambda: rt.registry.models)
        rt.ready = True
        await self.primary.sync(rt, state)
        self._follower = asyncio.ensure_future(self.follow_primary())
        if settings.grpc_port:
            from mmad.grpc.server import serve

            engine = WorkerEngine(self.engine, self.holds, self.primary.engine_call)
            self.grpc = await serve(engine, settings.host, settings.grpc_port, settings.api_key_value,
                                    settings.max_body_bytes, settings.max_response_bytes, settings.max_connections,
                                    shared=True)
        log.info("serving worker %d ready: %d model(s) on %s:%s", self.link.index, len(rt.registry.models),
                 row.backend, row.variant)

    async def follow_primary(self) -> None:
        """Sync soon after the primary changed something, not only at the next infer request:
        an unload or delete then drains this worker's queue at once, as it does the primary's,
        and the next request rarely waits for a sync."""
        while True:
            await asyncio.sleep(FOLLOW_INTERVAL_S)
            if self.primary.stale:
                try:
                    await self.primary.sync(self.rt)
                except httpx.ConnectError as exc:  # the primary stops (it stops this worker next) or restarts
                    log.debug("worker %d could not reach the primary (%s)", self.link.index, exc)
                except httpx.HTTPError as exc:
                    log.warning("worker %d could not follow the primary (%s)", self.link.index, exc)
                except Exception:  # noqa: BLE001 - logged; the next infer request syncs (and reports) again
                    log.exception("worker %d: following the primary failed", self.link.index)

    async def stop_grpc(self) -> None:
        """No more gRPC calls; those in flight finish (up to the graceful timeout)."""
        server, self.grpc = self.grpc, None
        if server is not None:
            await server.stop(self.settings.graceful_timeout_s)

    async def stop(self) -> None:
        await self.stop_grpc()
        rt = self.rt
        rt.ready = False
        if self._follower is not None:
            self._follower.cancel()
        if rt.region_forwards is not None:
            await rt.region_forwards.close()
        await release_runtime(rt)
        await self.primary.client.aclose()


def _exit_with_primary(link: WorkerLink, grace_s: float) -> None:
    """Stop this worker when the primary is gone (killed without stopping its workers): the
    graceful way first (its requests finish), then at once if that has not ended it."""

    def watch() -> None:
        while link.primary_alive:
            threading.Event().wait(1.0)
        log.error("the primary process %d is gone; this worker stops", link.primary_pid)
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="mmad-primary-watch", daemon=True).start()


class DealtConnections:
    """The worker's end of the primary's dealer (:class:`~mmad.server.workers.WorkerPool`): the
    connections it passes arrive as descriptors on ``channel`` and are served by the same
    protocol as a listening server's; each one closed is counted in this worker's slot of the
    shared ``closed`` counter, which the dealer reads to find the least loaded worker. ``open``:
    the passed connections open now (``mmad_process_connections``)."""

    RECEIVE_BYTES, RECEIVE_FDS = 1024, 256

    def __init__(self, channel: socket.socket, link: WorkerLink):
        self.channel = channel
        self.index = link.index
        self.closed = SharedCounter(link.closed_path, slots=link.index + 1)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.protocol: Callable[[], asyncio.BaseProtocol] | None = None
        self.open = 0

    def start(self, server: Any) -> None:
        """Serve each passed connection as ``server`` (a started uvicorn server) would an accepted one."""
        config, loop, dealt = server.config, asyncio.get_running_loop(), self

        class DealtConnection(config.http_protocol_class):
            def connection_lost(self, exc: Exception | None) -> None:
                try:
                    super().connection_lost(exc)
                finally:
                    dealt.closed_one()

        def protocol() -> asyncio.BaseProtocol:  # as uvicorn's Server.startup makes its protocols
            return DealtConnection(config=config, server_state=server.server_state, app_state=server.lifespan.state,
                                   _loop=loop)

        self.loop, self.protocol = loop, protocol
        self.channel.setblocking(False)
        loop.add_reader(self.channel.fileno(), self._receive)

    def stop(self) -> None:
        """No more connections (the daemon stops); those open are uvicorn's to drain."""
        if self.loop is not None:
            self.loop.remove_reader(self.channel.fileno())
            self.loop = None
        self.channel.close()

    def closed_one(self) -> None:
        self.open -= 1
        self.closed.store(self.closed.get(self.index) + 1, self.index)

    def _receive(self) -> None:
        try:
            message, fds, _, _ = socket.recv_fds(self.channel, self.RECEIVE_BYTES, self.RECEIVE_FDS)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            message, fds = b"", []
            log.error("worker %d: the primary's connections channel failed (%s)", self.index, exc)
        if not message and not fds:  # the primary closed its end: it stops (and stops this worker)
            self.stop()
            return
        for fd in fds:
            self.open += 1
            conn = socket.socket(fileno=fd)
            conn.setblocking(False)
            asyncio.ensure_future(self._serve(conn))

    async def _serve(self, conn: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(self.protocol, conn)
        except Exception as exc:  # noqa: BLE001 - this connection only; the client sees it closed
            log.warning("worker %d could not serve a connection (%s)", self.index, exc)
            conn.close()
            self.closed_one()


def run_worker(settings: Settings, link: WorkerLink, channel: socket.socket) -> None:
    """The spawned process: uvicorn serving :class:`WorkerApp` on the connections the primary
    passes over ``channel`` and on its own Unix socket (the primary reads its statistics there)."""
    logging.basicConfig(level=settings.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[worker {link.index}]: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per passed-on request otherwise
    from mmad.server.serving import http_protocol, limit_blas_threads
    from mmad.server.workers import bind_unix

    limit_blas_threads(settings.blas_threads)
    _exit_with_primary(link, settings.graceful_timeout_s + 5)
    import uvicorn

    worker = WorkerApp(settings, link)
    app = guarded(BodyLimitMiddleware(worker, max_bytes=settings.max_body_bytes), settings.allow_origin)
    dealt = DealtConnections(channel, link)

    class WorkerServer(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:  # serving now: the primary passes this worker connections from here on
                worker.rt.metrics.process_connections.set_function(lambda: dealt.open)
                dealt.start(self)
                await worker.primary.said_ready()

        async def shutdown(self, sockets=None) -> None:
            dealt.stop()
            # gRPC's calls drain beside HTTP's requests, not after them
            await asyncio.gather(worker.stop_grpc(), super().shutdown(sockets=sockets))

    config = uvicorn.Config(app, loop=settings.loop, http=http_protocol(settings), lifespan="on",
                            timeout_keep_alive=settings.idle_timeout_s,
                            timeout_graceful_shutdown=settings.graceful_timeout_s,
                            log_level=settings.log_level, access_log=settings.log_level == "debug")
    WorkerServer(config).run(sockets=[bind_unix(link.worker_socket())])
