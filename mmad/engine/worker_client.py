"""The engine as a serving worker of ``mmad serve --workers N`` reaches it: :class:`WorkerEngine`
serves the same :class:`~mmad.engine.api.InferenceClient` and
:class:`~mmad.engine.api.ModelStoreClient` methods as :class:`~mmad.engine.inprocess.InProcessEngine`,
so a front end (the worker's gRPC server) cannot tell which of the two it has.

Infer on the live weights of a model the worker holds runs here, through the worker's own
in-process engine over its compiled copies: the same checks, batching, shared-memory paths and
statistics as the worker's HTTP infer (and, on the cuda backend, the same region forwards run by
the primary). So does ``model_ready`` of such a model. Every other call (repository load and
unload, shared-memory registration and status, statistics, configuration, metadata, readiness,
an infer pinned to a version or of a model not held here, model management) is passed to the
primary's engine as a typed message (:func:`mmad.engine.messages.encode_call`) with the caller
as the worker's front end established it: the primary applies its API-key and
``--shared-memory`` rules to that caller, exactly as to one of its own. Before an infer the
worker follows the primary (``holds``), so a change the primary answered is seen here.
"""

from __future__ import annotations

import dataclasses

from typing import Any, Awaitable, Callable

from mmad.engine.api import (
    Caller, CudaRegion, InferRequest, InferResponse, ModelConfig, ModelMetadata, ModelStatistics, Readiness,
    RepositoryEntry, ServerMetadata, SystemRegion, VersionInfo, WeightsSnapshot,
)
from mmad.engine.inprocess import InProcessEngine
from mmad.engine.messages import ENGINE_METHODS, decode_answer, decode_call, encode_call, encode_error, encode_result
from mmad.errors import MMADError, NotReady

# (method, message) -> the primary's answer: the worker's link to the primary carries it
PrimaryCall = Callable[[str, bytes], Awaitable[bytes]]


async def answer_call(engine: InProcessEngine, method: str, message: bytes) -> bytes:
    """The primary's side of a call a worker passed on: run by the primary's own engine, with the
    caller the worker named (the link's token vouches for the worker; the engine applies the
    key and shared-memory rules to that caller). Its result, or the error of mmad's tree it
    raised, as the worker decodes it; anything else is the primary's bug and propagates."""
    if method not in ENGINE_METHODS:
        raise LookupError(f"{method!r} is not a method of the engine's interface")
    arguments = decode_call(method, message)
    try:
        value = await getattr(engine, method)(**arguments)
    except MMADError as exc:
        return encode_error(exc)
    return encode_result(method, value)


class WorkerEngine:
    """``local``: the worker's in-process engine; ``holds(model)``: whether the worker answers
    infer for ``model`` now (after following the primary); ``primary``: sends a call to the
    primary's engine and returns its answer (raising :class:`~mmad.errors.NotReady` when the
    primary cannot be reached)."""

    def __init__(self, local: InProcessEngine, holds: Callable[[str], Awaitable[bool]], primary: PrimaryCall):
        self.local = local
        self.holds = holds
        self.primary = primary

    async def _forward(self, method: str, **arguments: Any) -> Any:
        return decode_answer(method, await self.primary(method, encode_call(method, arguments)))

    # -- served here -----------------------------------------------------------------------------
    async def live(self) -> bool:
        return True

    async def infer(self, request: InferRequest) -> InferResponse:
        if request.version is None and await self.holds(request.model):
            return await self.local.infer(request)
        # the front end's output buffer is this process's memory: the primary's answer is copied out
        return await self._forward("infer", request=dataclasses.replace(request, allocate=None))

    async def model_ready(self, name: str, version: str | None = None) -> bool:
        if version is None and await self.holds(name):
            return True
        return await self._forward("model_ready", name=name, version=version)

    # -- the primary's -----------------------------------------------------------------------------
    async def ready(self) -> Readiness:
        try:
            return await self._forward("ready")
        except NotReady as exc:
            return Readiness(False, str(exc))

    async def server_metadata(self) -> ServerMetadata:
        return await self._forward("server_metadata")

    async def model_metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        # the primary's: it alone lists every stored version
        return await self._forward("model_metadata", name=name, version=version)

    async def model_config(self, name: str, version: str | None = None) -> ModelConfig:
        return await self._forward("model_config", name=name, version=version)

    async def statistics(self, name: str | None = None, version: str | None = None) -> list[ModelStatistics]:
        # the primary adds up every process's counts, this worker's included
        return await self._forward("statistics", name=name, version=version)

    async def repository_index(self, ready_only: bool = False) -> list[RepositoryEntry]:
        return await self._forward("repository_index", ready_only=ready_only)

    async def load_model(self, name: str, caller: Caller) -> None:
        await self._forward("load_model", name=name, caller=caller)

    async def unload_model(self, name: str, caller: Caller) -> None:
        await self._forward("unload_model", name=name, caller=caller)

    async def system_shm_register(self, name: str, key: str, offset: int, byte_size: int, caller: Caller) -> None:
        await self._forward("system_shm_register", name=name, key=key, offset=offset, byte_size=byte_size,
                            caller=caller)

    async def system_shm_unregister(self, name: str | None, caller: Caller) -> None:
        await self._forward("system_shm_unregister", name=name, caller=caller)

    async def system_shm_status(self, name: str | None = None) -> list[SystemRegion]:
        return await self._forward("system_shm_status", name=name)

    async def cuda_shm_register(self, name: str, raw_handle: bytes, device_id: int, byte_size: int,
                                caller: Caller) -> None:
        await self._forward("cuda_shm_register", name=name, raw_handle=raw_handle, device_id=device_id,
                            byte_size=byte_size, caller=caller)

    async def cuda_shm_unregister(self, name: str | None, caller: Caller) -> None:
        await self._forward("cuda_shm_unregister", name=name, caller=caller)

    async def cuda_shm_status(self, name: str | None = None) -> list[CudaRegion]:
        return await self._forward("cuda_shm_status", name=name)

    async def create_model(self, name: str, spec: dict[str, Any], config: dict[str, Any] | None,
                           caller: Caller) -> bool:
        return await self._forward("create_model", name=name, spec=spec, config=config, caller=caller)

    async def delete_model(self, name: str, caller: Caller) -> None:
        await self._forward("delete_model", name=name, caller=caller)

    async def versions(self, name: str) -> list[VersionInfo]:
        return await self._forward("versions", name=name)

    async def checkpoint(self, name: str, caller: Caller) -> VersionInfo:
        return await self._forward("checkpoint", name=name, caller=caller)

    async def get_weights(self, name: str, version: str | None = None) -> WeightsSnapshot:
        return await self._forward("get_weights", name=name, version=version)

    async def set_weights(self, name: str, safetensors: bytes, caller: Caller) -> VersionInfo:
        return await self._forward("set_weights", name=name, safetensors=safetensors, caller=caller)
