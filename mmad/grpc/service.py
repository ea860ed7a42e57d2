"""Triton's ``inference.GRPCInferenceService`` (KServe's ``grpc-v2`` protocol and Triton's
shared-memory, repository and statistics extensions) over an
:class:`~mmad.engine.api.InferenceClient`.

Each handler parses its message, awaits one engine method and builds the reply: the engine owns
the models, their locks and devices. Errors leave as Triton's status codes (:mod:`mmad.grpc.errors`).
The calls that need the API key over HTTP need it here, as ``authorization: Bearer <key>``
metadata: repository load and unload, shared-memory register and unregister. Trace and log
settings are not served (UNIMPLEMENTED).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import urllib.parse
from typing import AsyncIterator, Callable

import grpc

from mmad.engine.api import Caller, InferenceClient
from mmad.engine.auth import authenticate
from mmad.errors import InvalidInput
from mmad.grpc.errors import status_of
from mmad.grpc.generated import grpc_service_pb2 as pb, grpc_service_pb2_grpc as pb_grpc, model_config_pb2 as mc
from mmad.grpc.tensors import infer_request, infer_response
from mmad.grpc.wire import read_infer_request, write_infer_response, write_stream_response

log = logging.getLogger("mmad.grpc")

KEY_METADATA = "'authorization: Bearer <api key>' metadata"


def _rpc(handler: Callable) -> Callable:
    """A unary handler whose errors become gRPC statuses."""

    @functools.wraps(handler)
    async def wrapped(self, request, context):
        try:
            return await handler(self, request, context)
        except Exception as exc:  # noqa: BLE001 - mmad's tree by the table, anything else INTERNAL
            code, message, trailers = status_of(exc, handler.__name__)
            if trailers:
                context.set_trailing_metadata(trailers)
            await context.abort(code, message)

    return wrapped


def peer_address(peer: str) -> tuple[str, int] | None:
    """(host, port) of a gRPC TCP peer (``ipv4:127.0.0.1:5000``, ``ipv6:%5B::1%5D:5000``); None
    for any other (``unix:...``)."""
    kind, _, address = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = urllib.parse.unquote(address).rpartition(":")  # gRPC writes IPv6 as %5B::1%5D
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        return None


def is_loopback(peer: str) -> bool:
    """Whether a gRPC peer is this host (a loopback address, IPv4-mapped ones included, or a Unix socket)."""
    if peer.startswith("unix:"):
        return True
    address = peer_address(peer)
    if address is None:
        return False
    try:
        ip = ipaddress.ip_address(address[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _version(value: str) -> str | None:
    return value or None


def _repository(name: str) -> None:
    if name:
        raise InvalidInput(f"repository_name {name!r}: mmad serves one repository; leave it empty")


class _Stream:
    """An open ModelStreamInfer: the task reading its requests, whether it still reads them,
    and whether the daemon is stopping it."""

    def __init__(self) -> None:
        self.reader: asyncio.Task | None = None
        self.reading = True
        self.stopped = False


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    """The servicer; ``api_key``: the key administrative calls need (None: no key); ``port``:
    the port it is served on (a caller's address names it)."""

    def __init__(self, engine: InferenceClient, api_key: str | None, port: int = 0):
        self.engine = engine
        self.api_key = api_key
        self.port = port
        self._streams: set[_Stream] = set()

    def _caller(self, context) -> Caller:
        metadata = dict(context.invocation_metadata() or ())
        verified = authenticate(self.api_key, metadata.get("authorization"), KEY_METADATA)
        peer = context.peer()
        address = peer_address(peer)
        return Caller(key_verified=verified, loopback=is_loopback(peer),
                      address=None if address is None else (*address, self.port))

    # -- health and metadata --------------------------------------------------------------------
    @_rpc
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=await self.engine.live())

    @_rpc
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=(await self.engine.ready()).ready)

    @_rpc
    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=await self.engine.model_ready(request.name, _version(request.version)))

    @_rpc
    async def ServerMetadata(self, request, context):
        meta = await self.engine.server_metadata()
        return pb.ServerMetadataResponse(name=meta.name, version=meta.version, extensions=list(meta.extensions))

    @_rpc
    async def ModelMetadata(self, request, context):
        meta = await self.engine.model_metadata(request.name, _version(request.version))
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta.name, versions=meta.versions, platform=meta.platform,
            inputs=[tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in meta.inputs],
            outputs=[tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in meta.outputs])

    @_rpc
    async def ModelConfig(self, request, context):
        config = await self.engine.model_config(request.name, _version(request.version))
        message = mc.ModelConfig(
            name=config.name, platform=config.platform, backend=config.backend, max_batch_size=config.max_batch_size,
            input=[mc.ModelInput(name=t.name, data_type=mc.DataType.Value(t.data_type), dims=t.dims)
                   for t in config.inputs],
            output=[mc.ModelOutput(name=t.name, data_type=mc.DataType.Value(t.data_type), dims=t.dims)
                    for t in config.outputs],
            dynamic_batching=mc.ModelDynamicBatching(max_queue_delay_microseconds=config.max_queue_delay_us))
        for key, value in config.parameters.items():  # Triton's parameters are strings; unset ones are left out
            if value is not None:
                message.parameters[key].string_value = str(value).lower() if isinstance(value, bool) else str(value)
        return pb.ModelConfigResponse(config=message)

    @_rpc
    async def ModelStatistics(self, request, context):
        rows = await self.engine.statistics(request.name or None, _version(request.version))
        duration = pb.StatisticDuration
        reply = pb.ModelStatisticsResponse()
        for s in rows:
            stats = s.inference_stats
            reply.model_stats.add(
                name=s.name, version=s.version, last_inference=s.last_inference, inference_count=s.inference_count,
                execution_count=s.execution_count,
                inference_stats=pb.InferStatistics(**{k: duration(count=getattr(stats, k).count, ns=getattr(stats, k).ns)
                                                      for k in ("success", "fail", "queue", "compute_input",
                                                                "compute_infer", "compute_output", "cache_hit",
                                                                "cache_miss")}),
                batch_stats=[pb.InferBatchStatistics(
                    batch_size=b.batch_size,
                    compute_input=duration(count=b.compute_input.count, ns=b.compute_input.ns),
                    compute_infer=duration(count=b.compute_infer.count, ns=b.compute_infer.ns),
                    compute_output=duration(count=b.compute_output.count, ns=b.compute_output.ns))
                    for b in s.batch_stats])
        return reply

    # -- repository -----------------------------------------------------------------------------
    @_rpc
    async def RepositoryIndex(self, request, context):
        _repository(request.repository_name)
        index = pb.RepositoryIndexResponse.ModelIndex
        rows = await self.engine.repository_index(request.ready)
        return pb.RepositoryIndexResponse(models=[index(name=r.name, version=r.version, state=r.state,
                                                        reason=r.reason) for r in rows])

    @_rpc
    async def RepositoryModelLoad(self, request, context):
        caller = self._caller(context)
        _repository(request.repository_name)
        if request.parameters:  # Triton's config override and model files: mmad's models come from its store
            raise InvalidInput(f"load parameters ({', '.join(sorted(request.parameters))}) are not supported: a model "
                               f"loads as stored; PUT /v2/models/{request.model_name} to change it")
        await self.engine.load_model(request.model_name, caller)
        return pb.RepositoryModelLoadResponse()

    @_rpc
    async def RepositoryModelUnload(self, request, context):
        caller = self._caller(context)
        _repository(request.repository_name)
        # unload_dependents (tritonclient always sends it) has nothing to do: a model has no dependents
        unknown = sorted(set(request.parameters) - {"unload_dependents"})
        if unknown:
            raise InvalidInput(f"unload parameters ({', '.join(unknown)}) are not supported")
        await self.engine.unload_model(request.model_name, caller)
        return pb.RepositoryModelUnloadResponse()

    # -- shared memory --------------------------------------------------------------------------
    @_rpc
    async def SystemSharedMemoryStatus(self, request, context):
        status = pb.SystemSharedMemoryStatusResponse.RegionStatus
        regions = await self.engine.system_shm_status(request.name or None)
        return pb.SystemSharedMemoryStatusResponse(regions={
            r.name: status(name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size) for r in regions})

    @_rpc
    async def SystemSharedMemoryRegister(self, request, context):
        await self.engine.system_shm_register(request.name, request.key, request.offset, request.byte_size,
                                              self._caller(context))
        return pb.SystemSharedMemoryRegisterResponse()

    @_rpc
    async def SystemSharedMemoryUnregister(self, request, context):
        await self.engine.system_shm_unregister(request.name or None, self._caller(context))
        return pb.SystemSharedMemoryUnregisterResponse()

    @_rpc
    async def CudaSharedMemoryStatus(self, request, context):
        status = pb.CudaSharedMemoryStatusResponse.RegionStatus
        regions = await self.engine.cuda_shm_status(request.name or None)
        return pb.CudaSharedMemoryStatusResponse(regions={
            r.name: status(name=r.name, device_id=r.device_id, byte_size=r.byte_size) for r in regions})

    @_rpc
    async def CudaSharedMemoryRegister(self, request, context):
        if request.device_id < 0:
            raise InvalidInput(f"device_id must be a non-negative integer; got {request.device_id}")
        await self.engine.cuda_shm_register(request.name, request.raw_handle, request.device_id, request.byte_size,
                                            self._caller(context))
        return pb.CudaSharedMemoryRegisterResponse()

    @_rpc
    async def CudaSharedMemoryUnregister(self, request, context):
        await self.engine.cuda_shm_unregister(request.name or None, self._caller(context))
        return pb.CudaSharedMemoryUnregisterResponse()

    # -- not served ------------------------------------------------------------------------------
    async def TraceSetting(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "mmad does not serve Triton's trace settings")

    async def LogSettings(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "mmad does not serve Triton's log settings; "
                                                           "mmad serve --log-level sets the log level")

    # -- inference ------------------------------------------------------------------------------
    @_rpc
    async def ModelInfer(self, request, context):
        return infer_response(await self.engine.infer(infer_request(request)))

    async def ModelStreamInfer(self, request_iterator: AsyncIterator, context) -> AsyncIterator:
        """Each request of the stream runs as it arrives, beside the others (the batcher merges
        them), and its response is sent as it finishes; a request that fails answers with its
        error in ``error_message`` and the stream goes on, as Triton's does."""
        replies: asyncio.Queue = asyncio.Queue()
        running: set[asyncio.Task] = set()

        async def answer(request) -> None:
            try:
                reply = infer_response(await self.engine.infer(infer_request(request)))
            except Exception as exc:  # noqa: BLE001 - the stream carries the error, as Triton's
                _code, message, _ = status_of(exc, "ModelStreamInfer")
                sent = request.message or pb.ModelInferRequest()
                reply = pb.ModelStreamInferResponse(
                    error_message=message,
                    infer_response=pb.ModelInferResponse(model_name=sent.model_name,
                                                         model_version=sent.model_version, id=sent.id))
            replies.put_nowait(reply)

        stream = _Stream()

        async def read() -> None:
            try:
                try:
                    async for request in request_iterator:
                        task = asyncio.ensure_future(answer(request))
                        running.add(task)
                        task.add_done_callback(running.discard)
                except asyncio.CancelledError:
                    if not stream.stopped:
                        raise
                stream.reading = False
                while running:  # the requests taken are answered
                    await asyncio.wait(set(running))
            finally:
                replies.put_nowait(None)

        reader = stream.reader = asyncio.ensure_future(read())
        self._streams.add(stream)
        try:
            while (reply := await replies.get()) is not None:
                yield reply
            await reader  # the client's half closed cleanly, or its error ends the call
        finally:
            self._streams.discard(stream)
            reader.cancel()
            for task in list(running):
                task.cancel()
        if stream.stopped:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the daemon is stopping; open a new stream to "
                                                             "another server or after its restart")

    def stop_streams(self) -> None:
        """At shutdown: every open stream takes no more requests; those it took are answered, then
        it ends UNAVAILABLE (an idle stream at once: it would hold the shutdown for its whole grace)."""
        for stream in list(self._streams):
            stream.stopped = True
            if stream.reading:  # waiting for the client's next request: stop waiting
                stream.reader.cancel()


def method_handlers(service: InferenceService) -> grpc.GenericRpcHandler:
    """The service's calls as gRPC handlers, each with its messages' protobuf (de)serializers,
    but infer's, whose raw tensor contents :mod:`mmad.grpc.wire` reads and writes in place."""
    wire_io = {"ModelInfer": (read_infer_request, write_infer_response),
               "ModelStreamInfer": (read_infer_request, write_stream_response)}
    descriptor = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {}
    for method in descriptor.methods:
        read, write = wire_io.get(method.name, (getattr(pb, method.input_type.name).FromString,
                                                getattr(pb, method.output_type.name).SerializeToString))
        kind = (grpc.stream_stream_rpc_method_handler if method.client_streaming and method.server_streaming
                else grpc.unary_unary_rpc_method_handler)
        if method.client_streaming != method.server_streaming:
            raise TypeError(f"{method.name}: a call streaming one way only is not served")
        handlers[method.name] = kind(getattr(service, method.name), request_deserializer=read,
                                     response_serializer=write)
    return grpc.method_handlers_generic_handler(descriptor.full_name, handlers)
