"""Start the gRPC front end (``mmad serve --grpc-port``, default 8001) on the running
event loop, beside the HTTP one, over the engine the daemon's start-up built."""

from __future__ import annotations

import logging

import grpc

from mmad.engine.api import InferenceClient
from mmad.errors import MMADError
from mmad.grpc.service import InferenceService, method_handlers

log = logging.getLogger("mmad.grpc")

# the protobuf framing around a response's tensor bytes (names, shapes, parameters)
RESPONSE_OVERHEAD_BYTES = 64 * 1024


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def port_taken(where: str, exc: BaseException | None = None) -> str:
    """The reason a start stops when its gRPC port cannot be had."""
    detail = f" ({exc})" if exc is not None else ""
    return (f"the gRPC port cannot be bound at {where}{detail}; is another server using it? "
            "--grpc-port picks another port, 0 turns gRPC off")


async def serve(engine: InferenceClient, host: str, port: int, api_key: str | None, max_request_bytes: int,
                max_response_bytes: int, max_calls: int, shared: bool = False) -> "GrpcFrontEnd":
    """A started gRPC server on ``host:port``. Messages are capped as HTTP bodies are: a request
    larger than ``max_request_bytes`` is refused RESOURCE_EXHAUSTED by gRPC itself, before it is
    read whole; so is a call past ``max_calls`` in progress at once (as HTTP caps connections:
    each call may hold a request's bytes).

    ``shared`` False: the port is this server's alone (no SO_REUSEPORT: a second daemon on the
    same port fails to start rather than sharing its clients). True (each serving worker of
    ``mmad serve --workers``): bound with SO_REUSEPORT beside the other workers, into the port
    the primary holds for them (:func:`mmad.server.workers.reserve_shared_port`)."""
    server = grpc.aio.server(maximum_concurrent_rpcs=max_calls, options=[
        ("grpc.max_receive_message_length", max_request_bytes),
        ("grpc.max_send_message_length", max_response_bytes + RESPONSE_OVERHEAD_BYTES),
        ("grpc.so_reuseport", 1 if shared else 0),
    ])
    service = InferenceService(engine, api_key, port)
    server.add_generic_rpc_handlers((method_handlers(service),))
    where = address(host, port)
    try:
        bound = server.add_insecure_port(where)
    except RuntimeError as exc:  # grpcio raises where older releases returned 0
        raise MMADError(port_taken(where, exc)) from exc
    if bound == 0:
        raise MMADError(port_taken(where))
    service.port = bound
    await server.start()
    log.info("serving gRPC (KServe v2 / Triton) on %s", address(host, bound))
    return GrpcFrontEnd(server, service)


class GrpcFrontEnd:
    """The started server and its service, stopped together."""

    def __init__(self, server: grpc.aio.Server, service: InferenceService):
        self.server, self.service = server, service

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls, end the open streams once they answered what they took, and let the
        calls in flight finish for up to ``grace_s`` seconds."""
        self.service.stop_streams()
        await self.server.stop(grace_s)
