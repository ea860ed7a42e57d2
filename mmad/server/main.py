"""``mmad serve``: run the daemon under uvicorn.

Options default to the ``MMAD_*`` environment (see :class:`~mmad.settings.Settings`).
On SIGINT/SIGTERM the daemon stops reporting ready, lets running training jobs write a final
checkpoint, lets in-flight requests finish (up to ``--graceful-timeout`` seconds) and frees the
devices.
"""

from __future__ import annotations

import argparse
import errno
import gc
import logging
import socket
import sys

from pydantic import ValidationError

from mmad.errors import MMADError
from mmad.server.serving import http_protocol, limit_blas_threads
from mmad.settings import Settings, default_store_dir

log = logging.getLogger("mmad.server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmad serve", description="Serve and train MLPs over the Open Inference Protocol v2.")
    p.add_argument("--host", help="address to listen on (MMAD_HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port (MMAD_PORT, default 8000)")
    p.add_argument("--grpc-port", type=int, help="gRPC (KServe v2 / Triton) port (MMAD_GRPC_PORT, default 8001; "
                                                 "0: no gRPC)")
    p.add_argument("--store", dest="store_dir",
                   help=f"model store directory (MMAD_STORE_DIR, default {default_store_dir()}, "
                        "i.e. $XDG_DATA_HOME/mmad/store)")
    p.add_argument("--backend", help="cuda|vulkan|wgpu|cpu[:variant] (MMAD_BACKEND, default: best available)")
    p.add_argument("--probe", help="backends listed in /v2/devices: 'all' or a comma list (MMAD_PROBE)")
    p.add_argument("--api-key-file", help="file holding the key that mutating endpoints require as "
                                          "'Authorization: Bearer KEY' (MMAD_API_KEY_FILE)")
    p.add_argument("--api-key", help="the key itself; visible to every user of the host in the process list, "
                                     "prefer --api-key-file or MMAD_API_KEY (MMAD_API_KEY)")
    p.add_argument("--allow-origin", action="append",
                   help="an origin (scheme://host[:port], or *) whose web pages may send requests that change "
                        "something, besides the daemon's own pages; repeatable or comma-separated "
                        "(MMAD_ALLOW_ORIGIN, default none)")
    p.add_argument("--max-body-bytes", type=int, help="request body cap (MMAD_MAX_BODY_BYTES, default 64 MiB)")
    p.add_argument("--max-dataset-bytes", type=int,
                   help="one dataset's size as stored, all its chunks (MMAD_MAX_DATASET_BYTES, default 16 GiB)")
    p.add_argument("--max-response-bytes", type=int,
                   help="infer response cap, JSON outputs estimated (MMAD_MAX_RESPONSE_BYTES, default 256 MiB)")
    p.add_argument("--max-connections", type=int, help="open connections before 503 (MMAD_MAX_CONNECTIONS, default 2048)")
    p.add_argument("--idle-timeout", dest="idle_timeout_s", type=float,
                   help="seconds a connection may wait between requests (MMAD_IDLE_TIMEOUT_S, default 5)")
    p.add_argument("--head-timeout", dest="head_timeout_s", type=float,
                   help="seconds for a request line and headers to arrive (MMAD_HEAD_TIMEOUT_S, default 10)")
    p.add_argument("--max-header-bytes", type=int,
                   help="request line + headers cap, 431 beyond (MMAD_MAX_HEADER_BYTES, default 64 KiB)")
    p.add_argument("--health-slots", type=int,
                   help="connections past --max-connections kept for health probes (MMAD_HEALTH_SLOTS, default 16)")
    p.add_argument("--body-timeout", dest="body_timeout_s", type=float,
                   help="window in which a request body must bring --min-body-rate bytes a second, else 408 "
                        "(MMAD_BODY_TIMEOUT_S, default 10)")
    p.add_argument("--min-body-rate", type=int,
                   help="bytes a second a request body must arrive at (MMAD_MIN_BODY_RATE, default 16384)")
    p.add_argument("--max-pending-body-bytes", type=int,
                   help="request bodies still arriving, all connections together; past it 503 "
                        "(MMAD_MAX_PENDING_BODY_BYTES, default 512 MiB)")
    p.add_argument("--max-batch-rows", type=int, help="dynamic batching: rows per launch (MMAD_MAX_BATCH_ROWS)")
    p.add_argument("--max-queue-delay-us", type=int, help="dynamic batching: longest wait (MMAD_MAX_QUEUE_DELAY_US)")
    p.add_argument("--max-queue-requests", type=int, help="queued requests per model before 503 (MMAD_MAX_QUEUE_REQUESTS)")
    p.add_argument("--checkpoint-every", type=int, help="training jobs' default checkpoint interval in steps")
    p.add_argument("--compute-threads", type=int, help="threads that run device work (MMAD_COMPUTE_THREADS)")
    p.add_argument("--workers", type=int,
                   help="inference worker processes serving the port: each answers infer for the live weights "
                        "and passes every other request to the primary behind them (MMAD_WORKERS, default 0: "
                        "the primary serves the port itself; docs/service.md)")
    p.add_argument("--pinned-body-bytes", type=int,
                   help="page-locked memory for request and response bodies on a GPU backend "
                        "(MMAD_PINNED_BODY_BYTES, default 1 GiB; 0: ordinary memory)")
    p.add_argument("--forward-threads", type=int,
                   help="threads sharing the row chunks of one large cpu forward (MMAD_FORWARD_THREADS, 0: one per CPU)")
    p.add_argument("--model-repository", help="folder with one folder per model (config.json, optional mmad.json, "
                                              "and model.safetensors or version folders 1/model.safetensors, "
                                              "2/...), created at start where the store lacks them "
                                              "(MMAD_MODEL_REPOSITORY; docs/service.md)")
    p.add_argument("--model-control-mode", choices=("none", "poll"),
                   help="none: the repository seeds the store at start; poll: serve the repository read-only and "
                        "pick up new versions and models as they appear, refusing training and uploads "
                        "(MMAD_MODEL_CONTROL_MODE, default none)")
    p.add_argument("--repository-poll-secs", type=float,
                   help="poll mode: seconds between two reads of the repository (MMAD_REPOSITORY_POLL_SECS, "
                        "default 15)")
    p.add_argument("--no-demo", dest="demo", action="store_const", const=False,
                   help="do not create the demo model in an empty store")
    p.add_argument("--graceful-timeout", dest="graceful_timeout_s", type=float,
                   help="seconds to wait for in-flight requests at shutdown (default 30)")
    p.add_argument("--blas-threads", type=int,
                   help="threads of NumPy's BLAS (MMAD_BLAS_THREADS, default 1; 0 keeps the library's own)")
    p.add_argument("--loop", choices=("auto", "asyncio", "uvloop"),
                   help="uvicorn event loop (MMAD_LOOP, default auto: uvloop when installed)")
    p.add_argument("--http", choices=("auto", "h11", "httptools"),
                   help="uvicorn HTTP parser (MMAD_HTTP, default auto: httptools when installed)")
    # shared memory, the store and held datasets
    p.add_argument("--shared-memory", choices=("off", "loopback", "on"),
                   help="who may register shared-memory regions: off, loopback (clients on this host; keyless: "
                        "objects of the client's own user only) or on (any client, needs an API key) "
                        "(MMAD_SHARED_MEMORY, default loopback)")
    p.add_argument("--max-shm-regions", type=int,
                   help="shared-memory regions registered at once (MMAD_MAX_SHM_REGIONS, default 256)")
    p.add_argument("--keep-versions", type=int,
                   help="versions kept per model, the newest; a model's config keep_versions overrides it "
                        "(MMAD_KEEP_VERSIONS, default 100; 0: all)")
    p.add_argument("--max-host-dataset-bytes", type=int,
                   help="datasets held in host memory for training at once, least recently used dropped first "
                        "(cpu backend; MMAD_MAX_HOST_DATASET_BYTES, default a quarter of the host's memory)")
    p.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), help="(MMAD_LOG_LEVEL)")
    return p


def bind_listening_sockets(host: str, port: int) -> list[socket.socket]:
    """The daemon's sockets, bound as uvicorn's event loop would bind them (one per address ``host``
    resolves to, SO_REUSEADDR, IPv6 sockets IPv6 only) but not listening until the server starts:
    a taken port ends ``mmad serve`` before the backends are probed, and stays this daemon's."""
    bound: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(
                socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)):
            sock = socket.socket(family, kind, proto)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError:
        for sock in bound:
            sock.close()
        raise
    return bound


def startup_error(settings: Settings, exc: OSError) -> str:
    """One line for a port that cannot be had."""
    where = f"{settings.host}:{settings.port}"
    if exc.errno == errno.EADDRINUSE:
        return f"{where} is already in use (another mmad daemon or another server): stop it or choose another --port"
    return f"cannot listen on {where}: {exc.strerror or exc}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.allow_origin is not None:
        args.allow_origin = ",".join(args.allow_origin)
    try:
        settings = Settings(**{k: v for k, v in vars(args).items() if v is not None})
    except ValidationError as exc:
        print(f"mmad serve: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.api_key is not None:
        log.warning("--api-key puts the key in the process list, where every user of this host can read it "
                    "(/proc/PID/cmdline); use --api-key-file or MMAD_API_KEY")

    # what start-up would fail on late, after probing the devices, with uvicorn's traceback: a
    # store another daemon holds, a taken port. Each ends here with one line.
    from mmad.engine.store import Store

    pool, sockets, reserved, grpc_reserved = None, None, None, None
    try:
        Store(settings.store_dir, keep_versions=settings.keep_versions).close()
        if settings.workers:
            from mmad.server.workers import reserve_grpc_port, reserve_shared_port

            # the port, bound and never listened on: it stays this daemon's (a port of 0 is resolved
            # once) while the pool's dealer listens beside it only when a worker is ready to take
            # connections; the primary serves the workers on its own socket. The gRPC port likewise,
            # each worker's gRPC server listening beside it
            reserved = reserve_shared_port(settings.host, settings.port)
            grpc_reserved = reserve_grpc_port(settings.host, settings.grpc_port)
        else:
            sockets = bind_listening_sockets(settings.host, settings.port)
    except MMADError as exc:
        print(f"mmad serve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"mmad serve: {startup_error(settings, exc)}", file=sys.stderr)
        return 2
    limit_blas_threads(settings.blas_threads)
    import uvicorn

    from mmad.server.app import create_app

    if settings.workers:
        from mmad.server.worker import run_worker
        from mmad.server.workers import WorkerPool, bind_unix

        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per statistics read otherwise

        pool = WorkerPool(settings, settings.workers, run_worker)
        sockets = [bind_unix(pool.primary_socket)]
    app = create_app(settings, workers=pool)
    runtime = app.state.runtime

    class GracefulServer(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started and pool is None:  # uvicorn names the address only of sockets it bound itself
                host = f"[{settings.host}]" if ":" in settings.host else settings.host
                log.info("serving http://%s:%d (Ctrl-C stops)", host, sockets[0].getsockname()[1])
            runtime.metrics.process_connections.set_function(lambda: len(self.server_state.connections))
            # what start-up loaded (modules, the app, the models) lives as long as the daemon;
            # frozen, the collector's full passes skip it: they paused requests ~50 ms before
            gc.freeze()

        def handle_exit(self, sig, frame) -> None:
            # stop jobs first: their SSE streams are in-flight requests the drain would wait for
            runtime.shutting_down = True
            if runtime.jobs is not None:
                runtime.jobs.stop_all()
            if pool is not None:  # the workers drain their requests while this process drains its own
                pool.signal_stop()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            loop=settings.loop, http=http_protocol(settings),
                            timeout_keep_alive=settings.idle_timeout_s,
                            timeout_graceful_shutdown=settings.graceful_timeout_s, lifespan="on",
                            access_log=settings.log_level == "debug")
    server = GracefulServer(config)
    if pool is None:
        server.run(sockets=sockets)
        return 0 if server.started else 1
    # the workers start now: their imports and device set-up overlap this process's start-up,
    # and each waits for the primary before it syncs its models and listens
    port = reserved.getsockname()[1]
    log.info("serving http://%s:%d through %d inference worker(s)", settings.host, port, settings.workers)
    pool.start(port=port)
    try:
        server.run(sockets=sockets)
    finally:
        pool.stop(settings.graceful_timeout_s + 10)
        reserved.close()
        if grpc_reserved is not None:
            grpc_reserved.close()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
