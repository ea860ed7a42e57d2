"""The engine in the front end's own process: :class:`InProcessEngine` serves the
:class:`~mmad.engine.api.InferenceClient` and :class:`~mmad.engine.api.ModelStoreClient`
methods with the daemon's components (the registry and its batchers, the shared-memory
regions, the store, the metrics) on the daemon's event loop and compute threads.

It knows no transport: a front end hands it typed requests and encodes what it returns. It
takes the model locks and moves the device arrays (through the registry's and the forwards'
own functions), so no front end does. A request's tensors are checked against the model once,
here (names, datatypes, shapes, rows, finiteness: small inputs on the host, large ones by their
forward, on the device where there is one). With ``mmad serve --workers`` it runs in the
primary process, which answers its own requests; the serving workers' counts are added to its
statistics.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Awaitable, Callable

import numpy as np

import mmad
from mmad.backends.contract import param_shapes
from mmad.engine.api import (
    DATATYPES, MODEL_DATATYPES, BatchStatistics, Caller, ChunkStream, CudaRegion, DatasetSummary, DevicesReport,
    Duration,
    InferInput, InferOutput, InferRequest, InferResponse, InferStatistics, JobEvent, JobLosses, JobRequest, JobStatus,
    ModelConfig, ModelMetadata, ModelStatistics, ModelStatus, Readiness, RepositoryEntry, RequestedOutput,
    ServerMetadata, ShmRef, SystemRegion, TensorConfig, TensorMetadata, TrainResult, VersionInfo, WeightsSnapshot,
)
from mmad.errors import InvalidInput, MMADError, ModelNotFound, ModelNotReady, NonFiniteInput, NotReady, Unauthorized
from mmad.engine import hostmem
from mmad.engine.inference import (
    INLINE_TENSOR_VALUES, OutputChoice, ParsedRequest, check_response_size, copy_regions, count_failure, count_success,
    model_tensors, nonfinite_input, run_forward, shm_outputs,
)
from mmad.engine.peers import Peer, shared_memory_owner
from mmad.engine.shm import ShmTensor
from mmad.engine.runtime import Runtime
from mmad.engine.statistics import model_statistics, worker_queued, worker_records
from mmad.engine.training import train_in_slices
from mmad.engine.registry import INPUT, OUTPUT, TARGET, ModelConfig as ServingConfig, ModelEntry
from mmad.engine.repository_poll import refuse_changes
from mmad.engine.store import (
    DatasetInfo, check_dataset_id, check_model_name, check_safetensors_header, dtype_words, tensors_from_bytes,
)
from mmad.spec import MLPSpec

# the extensions of Triton's protocol the engine serves (a front end adds its own)
EXTENSIONS = ("system_shared_memory", "model_repository", "statistics", "model_configuration")
PLATFORM = "mmad"


def _shm_params(ref: ShmRef) -> dict[str, Any]:
    """A reference as the shared-memory registry reads one (Triton's tensor parameters)."""
    return {"shared_memory_region": ref.region, "shared_memory_offset": ref.offset,
            "shared_memory_byte_size": ref.byte_size}


def _duration(doc: dict[str, int]) -> Duration:
    return Duration(doc["count"], doc["ns"])


def _statistics(doc: dict[str, Any]) -> ModelStatistics:
    """The registry's statistics document as the typed record."""
    stats = doc["inference_stats"]
    return ModelStatistics(
        doc["name"], doc["version"], doc["last_inference"], doc["inference_count"], doc["execution_count"],
        InferStatistics(**{key: _duration(value) for key, value in stats.items()}),
        [BatchStatistics(b["batch_size"], _duration(b["compute_input"]), _duration(b["compute_infer"]),
                         _duration(b["compute_output"])) for b in doc["batch_stats"]])


def device_report(rt: Runtime) -> list[dict[str, Any]]:
    """Every device models can be placed on: memory (bytes, read now; null where the backend
    cannot tell), the models with a replica there, and the forwards running or waiting there."""
    placed: dict[int, list[str]] = {}
    in_flight: dict[int, int] = {}
    for entry in rt.registry.models.values():
        for replica in entry.replicas:
            if replica.model is not None:
                placed.setdefault(replica.device, []).append(entry.name)
                in_flight[replica.device] = in_flight.get(replica.device, 0) + replica.in_flight
    return [{**d.to_json(), "models": sorted(placed.get(d.index, [])), "in_flight": in_flight.get(d.index, 0)}
            for d in rt.backend.devices()]


def dispatch_report(rt: Runtime) -> list[dict[str, Any]]:
    """One entry per loaded replica whose variant the backend chose by measurement: the model, its
    device and the decision (every variant's figures, or why it was skipped)."""
    return [{"model": entry.name, "device_index": replica.device, **replica.model.dispatch.to_json()}
            for entry in rt.registry.models.values() for replica in entry.replicas
            if replica.model is not None and replica.model.dispatch is not None]


def _version_info(doc: dict[str, Any]) -> VersionInfo:
    return VersionInfo(doc["version"], int(doc.get("step", 0)), float(doc.get("created", 0.0)), doc.get("sha256"))


class InProcessEngine:
    """The engine of this process, over the daemon's :class:`~mmad.engine.runtime.Runtime` (the
    registry, shared-memory regions and settings its start-up made)."""

    def __init__(self, runtime: Runtime):
        self.rt = runtime

    # -- the daemon -----------------------------------------------------------------------------
    def _serving(self) -> None:
        if not self.rt.ready:
            raise NotReady("the daemon is starting or stopping")

    def _admin(self, caller: Caller) -> None:
        """Administrative calls (load, unload, shared-memory registration) need the API key when
        one is set: the front end has checked what the caller sent."""
        if self.rt.settings.api_key_value is not None and not caller.key_verified:
            raise Unauthorized("this call needs the API key")

    async def live(self) -> bool:
        return True

    async def ready(self) -> Readiness:
        rt = self.rt
        if not rt.ready or rt.shutting_down:
            return Readiness(False, "the daemon is not ready")
        if rt.workers is not None and rt.workers.waiting:
            return Readiness(False, f"serving worker(s) {', '.join(map(str, rt.workers.waiting))} are still starting")
        return Readiness(True)

    async def server_metadata(self) -> ServerMetadata:
        extensions = EXTENSIONS + (("cuda_shared_memory",) if self.rt.shm.cuda_enabled else ())
        if self.rt.settings.shared_memory == "off":  # --shared-memory off: neither extension is offered
            extensions = tuple(e for e in extensions if not e.endswith("_shared_memory"))
        return ServerMetadata("mmad", mmad.__version__, extensions)

    async def devices(self) -> DevicesReport:
        self._serving()
        rt = self.rt
        report = await rt.registry.run(device_report, rt)  # memory queries talk to the driver: off the event loop
        return DevicesReport(rt.selected.to_json(), [r.to_json() for r in rt.probe_rows], report, dispatch_report(rt))

    # -- models ---------------------------------------------------------------------------------
    def _entry(self, name: str, version: str | None) -> ModelEntry:
        self._serving()
        entry = self.rt.registry.get(name)
        if version is not None:
            self.rt.registry.check_version(name, version)
        return entry

    async def model_metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        entry = self._entry(name, version)
        registry = self.rt.registry
        return ModelMetadata(
            name, [v["version"] for v in registry.versions(name)], PLATFORM,
            [TensorMetadata(INPUT, "FP32", (-1, entry.spec.n_input_dims))],
            [TensorMetadata(OUTPUT, "FP32", (-1, entry.spec.n_output_dims))],
            "READY" if entry.ready else "UNAVAILABLE", entry.reason, registry.backend_label)

    async def model_ready(self, name: str, version: str | None = None) -> bool:
        """As Triton: False for a model that is unknown, not loaded or lacks the version."""
        try:
            entry = self._entry(name, version)
        except (ModelNotFound, InvalidInput):
            return False
        return entry.ready

    def _serving_config(self, entry: ModelEntry) -> dict[str, Any]:
        """The model's serving config as it applies: its own settings, the daemon's defaults for
        the batching limits it leaves unset."""
        limits = entry.config.limits(self.rt.settings)
        return {"max_batch_rows": limits.max_batch_rows, "max_queue_delay_us": limits.max_queue_delay_us,
                "max_queue_requests": limits.max_queue_requests, "allow_nonfinite": entry.config.allow_nonfinite,
                "device": entry.config.device, "replicas": entry.config.replicas, "variant": entry.config.variant}

    async def model_config(self, name: str, version: str | None = None) -> ModelConfig:
        entry = self._entry(name, version)
        serving = self._serving_config(entry)
        return ModelConfig(name, PLATFORM, self.rt.registry.backend_label, 0,
                           [TensorConfig(INPUT, "TYPE_FP32", (-1, entry.spec.n_input_dims))],
                           [TensorConfig(OUTPUT, "TYPE_FP32", (-1, entry.spec.n_output_dims))],
                           serving["max_queue_delay_us"], serving)

    async def model_status(self, name: str, version: str | None = None) -> ModelStatus:
        entry = self._entry(name, version)
        versions = self.rt.registry.versions(name)
        live = entry.live  # read once: an unload may clear it meanwhile
        queued = entry.batcher.queued if entry.batcher is not None else 0
        if self.rt.workers is not None:  # the serving workers' queues count too
            queued += worker_queued(await worker_records(self.rt), entry)
        return ModelStatus(
            versions[-1]["version"] if versions else "",
            live.step_count if live is not None else (versions[-1]["step"] if versions else 0),
            queued, tuple(r.device for r in entry.replicas if r.model is not None),
            live.variant if live is not None else None,
            live.dispatch.to_json() if live is not None and live.dispatch is not None else None,
            entry.spec.to_json(), self._serving_config(entry))

    async def statistics(self, name: str | None = None, version: str | None = None) -> list[ModelStatistics]:
        self._serving()
        registry = self.rt.registry
        if name is not None:
            self._entry(name, version)  # an unknown name is answered before the workers are asked
        records = await worker_records(self.rt)
        return [_statistics(model_statistics(self.rt, records, model, version))
                for model in ([name] if name is not None else sorted(registry.models))]

    async def repository_index(self, ready_only: bool = False) -> list[RepositoryEntry]:
        self._serving()
        registry = self.rt.registry
        rows = []
        # the store's models, and the model repository's folders that gave none (unreadable holds both)
        for name in sorted(set(self.rt.store.list_models()) | set(registry.unreadable)):
            entry = registry.models.get(name)
            ready = entry is not None and entry.ready
            if ready_only and not ready:
                continue
            reason = entry.reason if entry else registry.unreadable.get(name, "not loaded")
            rows.append(RepositoryEntry(name, registry.latest_version(name) if entry else "",
                                        "READY" if ready else "UNAVAILABLE", reason))
        return rows

    async def load_model(self, name: str, caller: Caller) -> None:
        self._serving()
        self._admin(caller)
        refuse_changes(self.rt.settings, name)
        await self.rt.registry.load(name)

    async def unload_model(self, name: str, caller: Caller) -> None:
        self._serving()
        self._admin(caller)
        refuse_changes(self.rt.settings, name)
        await self.rt.registry.unload(name)

    # -- inference ------------------------------------------------------------------------------
    async def infer(self, request: InferRequest) -> InferResponse:
        """One request through the model's batcher (live weights), its pinned version, or (a
        CUDA region among its tensors) the replica on the regions' GPU; the statistics and
        Triton's metric families count it."""
        self._serving()
        rt, registry = self.rt, self.rt.registry
        rt.metrics.process_infers.inc()
        known = served = None
        t0 = time.perf_counter_ns()
        try:
            known = entry = registry.get(request.model)  # (the name checked) failures of a known model count,
            if not entry.ready:  # not-ready included
                raise ModelNotReady(request.model)
            version = request.version
            if version is not None:
                registry.check_version(request.model, version)
            served = version or registry.latest_version(request.model)
            try:
                x, parsed, check_finite, small = await self._input(entry, request.inputs)
                outputs, out, targets = self._outputs(entry, request, served, parsed,
                                                      (x.shape[0], entry.spec.n_output_dims))
                t1 = time.perf_counter_ns()
                out, queue_ns, compute_ns = await run_forward(rt, entry, version, x, parsed, outputs, out=out,
                                                              targets=targets, check_finite=check_finite,
                                                              load_inputs=not small)
            except NonFiniteInput as exc:
                raise nonfinite_input(INPUT) from exc
            t2 = time.perf_counter_ns()
            results = self._results(outputs, out, targets)
        except MMADError:
            count_failure(rt, known, served, t0)
            raise
        count_success(rt, entry, served, x.shape[0], t0, t1, t2, time.perf_counter_ns(), queue_ns, compute_ns)
        return InferResponse(request.model, served, results, request.id, {})

    async def _input(self, entry: ModelEntry, inputs: list[InferInput]
                     ) -> tuple[np.ndarray, ParsedRequest, bool, bool]:
        """(INPUT's rows, the tensors as the forwards take them, whether the forward checks them
        finite, whether they are small): every input checked against the model here, once. A
        small request's system-region inputs are read (pread) into the daemon's buffers now, to be
        checked here; a large one's once it is known where its forward runs (a serving worker's
        forward between regions runs in the primary, which reads them itself)."""
        tensors, shm_inputs = {}, {}
        for tensor in inputs:
            where = f"input {tensor.name!r}"
            if tensor.name in tensors:
                raise InvalidInput(f"{where} is given twice")
            if tensor.datatype not in MODEL_DATATYPES:
                raise InvalidInput(f"{where}: datatype must be one of {', '.join(MODEL_DATATYPES)}; got "
                                   f"{tensor.datatype!r}")
            dtype = DATATYPES[tensor.datatype]
            if (tensor.shm is None) == (tensor.data is None):
                raise InvalidInput(f"{where} needs its data or a shared-memory region, one of the two")
            if tensor.shm is not None:
                shm_inputs[tensor.name] = self.rt.shm.tensor(where, _shm_params(tensor.shm), dtype,
                                                             tuple(tensor.shape), tensor.datatype)
                tensors[tensor.name] = shm_inputs[tensor.name].array
            elif tensor.data.dtype != dtype or tensor.data.shape != tuple(tensor.shape):
                raise InvalidInput(f"{where}: its data is {list(tensor.data.shape)} but the tensor is declared "
                                   f"{tensor.datatype} {list(tensor.shape)}")
            else:
                tensors[tensor.name] = tensor.data
        parsed = ParsedRequest({}, tensors, shm=self.rt.shm, uses_shm=bool(shm_inputs), shm_inputs=shm_inputs)
        names = {INPUT: entry.spec.n_input_dims}
        small = sum(t.size for t in inputs) <= INLINE_TENSOR_VALUES
        if small:
            await copy_regions(self.rt, list(shm_inputs.values()), ShmTensor.load)
        if any(t.on_device for t in shm_inputs.values()) or not small:
            # a CUDA region's input is checked finite on its device (device_forward); a large host
            # input by its forward (on the device on a GPU backend, where it costs no host time;
            # on an H100 the host check of 65,536 FP16 rows took a compute thread ~1.4 ms, longer
            # than the forward); a refused input's output is never sent
            x = model_tensors(entry, parsed, names, True, check_finite=False)[INPUT]
            return x, parsed, not small and not entry.config.allow_nonfinite, small
        return model_tensors(entry, parsed, names, keep_fp16=True)[INPUT], parsed, False, small

    def _outputs(self, entry: ModelEntry, request: InferRequest, served: str, parsed: ParsedRequest,
                 shape: tuple[int, int]) -> tuple[list[OutputChoice], np.ndarray | None, list]:
        """(the outputs asked for, the array the forward writes into where one output takes it
        all, the outputs' views of their shared-memory regions)."""
        choices, asked = [], request.outputs or [RequestedOutput(OUTPUT)]
        for o in asked:
            if o.name != OUTPUT:
                raise InvalidInput(f"unknown output {o.name!r}; model {entry.name!r} has {OUTPUT}")
            if o.datatype not in MODEL_DATATYPES:
                raise InvalidInput(f"output {o.name!r}: datatype must be one of {', '.join(MODEL_DATATYPES)}; got "
                                   f"{o.datatype!r}")
            if o.shm is not None:
                self.rt.shm.reference(f"output {o.name!r}", _shm_params(o.shm))  # the region holds the range
            choices.append(OutputChoice(o.name, o.binary, o.datatype, None if o.shm is None else _shm_params(o.shm)))
        check_response_size(choices, shape, self.rt.settings.max_response_bytes)
        targets = shm_outputs(parsed, choices, shape) if any(c.shm is not None for c in choices) else []
        on_device = any(t.on_device for t in parsed.shm_inputs.values()) or any(t.on_device for _, t in targets)
        out = None
        if len(choices) == 1:  # the forward writes (and casts) into its one destination
            if targets:
                if not on_device:  # (on the device it writes each CUDA region there)
                    out = targets[0][1].array
            else:
                if request.allocate is not None:
                    out = request.allocate(served, asked[0], shape)
                if out is None:  # page-locked where the backend copies from a GPU: the download lands here
                    dtype = DATATYPES[choices[0].datatype]
                    out = hostmem.empty(shape[0] * shape[1] * dtype.itemsize).view(dtype).reshape(shape)
        return choices, out, targets

    @staticmethod
    def _results(outputs: list[OutputChoice], out: Any, targets: list) -> list[InferOutput]:
        results = []
        for choice in outputs:
            shape = tuple(out.shape)
            if choice.shm is not None:
                ref = ShmRef(choice.shm["shared_memory_region"], choice.shm.get("shared_memory_offset", 0),
                             choice.shm["shared_memory_byte_size"])
                results.append(InferOutput(choice.name, choice.datatype, shape, None, ref))
            else:
                data = np.asarray(out).astype(DATATYPES[choice.datatype], copy=False)
                results.append(InferOutput(choice.name, choice.datatype, shape, data))
        return results

    # -- training -------------------------------------------------------------------------------
    async def train(self, name: str, tensors: dict[str, np.ndarray], steps: int, caller: Caller,
                    stop: Callable[[], Awaitable[bool]] | None = None) -> TrainResult:
        """``steps`` optimizer steps on the batch ``tensors`` (INPUT and TARGET, checked against
        the model: names, shapes, rows, finite values), in slices between which other work gets
        the model (and ``stop()``, the caller gone away, ends it: the steps done so far stay)."""
        self._serving()
        self._admin(caller)
        check_model_name(name)
        rt = self.rt
        entry = rt.registry.get_ready(name)
        tensors = model_tensors(entry, ParsedRequest({}, tensors),
                                {INPUT: entry.spec.n_input_dims, TARGET: entry.spec.n_output_dims})
        slices, step, _gone = await train_in_slices(rt, entry, tensors[INPUT], tensors[TARGET], steps,
                                                    stop or _never)
        losses = np.concatenate(slices)
        labels = (name, rt.registry.backend_label)
        rt.metrics.training_steps.labels(*labels).inc(losses.size)
        rt.metrics.training_samples.labels(*labels).inc(tensors[INPUT].shape[0] * losses.size)
        return TrainResult([float(v) if np.isfinite(v) else None for v in losses], step)

    # -- datasets and training jobs -------------------------------------------------------------
    def _summary(self, info: DatasetInfo) -> DatasetSummary:
        return DatasetSummary(info.dataset, info.rows, info.bytes, dtype_words(info.x_dtype), dtype_words(info.y_dtype),
                              len(info.chunks), info.dataset in self.rt.registry.datasets.resident(info.model))

    def _changing_datasets(self, name: str, caller: Caller) -> ModelEntry:
        self._serving()
        self._admin(caller)
        refuse_changes(self.rt.settings, name)
        return self.rt.registry.get(name)

    async def create_dataset(self, name: str, chunk: ChunkStream, declared_bytes: int | None,
                             caller: Caller) -> DatasetSummary:
        """A new dataset from its first chunk (a safetensors file: ``x`` [rows, n_input_dims] and
        ``y`` [rows, n_output_dims], float32 or float16, finite), streamed into the store and
        checked there before it is kept."""
        entry = self._changing_datasets(name, caller)
        return self._summary(await self.rt.registry.datasets.add(entry, chunk, declared_bytes))

    async def append_dataset_chunk(self, name: str, dataset: str, chunk: ChunkStream, declared_bytes: int | None,
                                   caller: Caller) -> DatasetSummary:
        """The dataset's next chunk: the same tensors, types and columns as its first."""
        entry = self._changing_datasets(name, caller)
        check_dataset_id(dataset)
        return self._summary(await self.rt.registry.datasets.append(entry, dataset, chunk, declared_bytes))

    async def datasets(self, name: str) -> list[DatasetSummary]:
        self._entry(name, None)
        return [self._summary(info) for info in await self.rt.registry.datasets.listed(name)]

    async def dataset(self, name: str, dataset: str) -> DatasetSummary:
        self._entry(name, None)
        return self._summary(await self.rt.registry.datasets.info(name, check_dataset_id(dataset)))

    async def delete_dataset(self, name: str, dataset: str, caller: Caller) -> None:
        """Delete the dataset and drop the copy its model's backend holds (a running job that
        trains from it keeps its own until it ends)."""
        self._changing_datasets(name, caller)
        await self.rt.registry.datasets.delete(name, check_dataset_id(dataset))

    async def start_job(self, name: str, job: JobRequest, caller: Caller) -> JobStatus:
        self._serving()
        self._admin(caller)
        refuse_changes(self.rt.settings, name)
        return (await self.rt.jobs.start(name, job)).status()

    async def jobs(self) -> list[JobStatus]:
        """Every job the daemon keeps, newest first: those running and the latest finished ones."""
        self._serving()
        return [job.status() for job in sorted(self.rt.jobs.jobs.values(), key=lambda j: j.created, reverse=True)]

    async def job_status(self, name: str, job_id: str) -> JobStatus:
        self._serving()
        return self.rt.jobs.get(name, job_id).status()

    async def job_losses(self, name: str, job_id: str) -> JobLosses:
        self._serving()
        job = self.rt.jobs.get(name, job_id)
        return JobLosses(job.id, job.model, job.step, job.history.points())

    async def cancel_job(self, name: str, job_id: str, caller: Caller) -> JobStatus:
        """Stop the job at its current chunk's end, after a checkpoint of the steps it made."""
        self._serving()
        self._admin(caller)
        return self.rt.jobs.cancel(name, job_id).status()

    async def job_events(self, name: str, job_id: str) -> AsyncIterator[JobEvent]:
        self._serving()
        return self.rt.jobs.get(name, job_id).events()

    # -- shared memory --------------------------------------------------------------------------
    def _shm_admin(self, caller: Caller) -> int | None:
        """Registering or unregistering a region lets the daemon read and write that memory: an
        administrative call, with the API key where one is set. Who else may (the
        ``--shared-memory`` mode: off, loopback callers only, or any; a keyless daemon's loopback
        caller only for objects of its own user, told from ``caller.address``) is decided here
        for every front end that reaches the engine; the HTTP routes apply the same rule. Returns
        the user id whose objects the caller may register (None: any)."""
        self._serving()
        self._admin(caller)
        peer = Peer(*caller.address) if caller.address is not None else None
        return shared_memory_owner(self.rt.settings.shared_memory, self.rt.settings.api_key_value is not None, peer)

    def _cuda(self) -> None:
        if not self.rt.shm.cuda_enabled:
            raise InvalidInput(self.rt.shm.cuda_unavailable)

    async def system_shm_register(self, name: str, key: str, offset: int, byte_size: int, caller: Caller) -> None:
        owner = self._shm_admin(caller)
        # opening and (with region forwards) page-locking the object: off the event loop
        await self.rt.registry.run(self.rt.shm.register, name, key, offset, byte_size, owner,
                                   self.rt.settings.max_shm_regions)

    async def system_shm_unregister(self, name: str | None, caller: Caller) -> None:
        self._shm_admin(caller)
        self.rt.shm.unregister(name)

    async def system_shm_status(self, name: str | None = None) -> list[SystemRegion]:
        self._serving()
        return [SystemRegion(d["name"], d["key"], d["offset"], d["byte_size"], d.get("page_locked"),
                             d.get("page_locked_error")) for d in self.rt.shm.status(name)]

    async def cuda_shm_register(self, name: str, raw_handle: bytes, device_id: int, byte_size: int,
                                caller: Caller) -> None:
        self._cuda()
        self._shm_admin(caller)
        # opening an IPC handle maps device memory: off the event loop
        await self.rt.registry.run(self.rt.shm.register_cuda, name, raw_handle, device_id, byte_size,
                                   self.rt.settings.max_shm_regions)

    async def cuda_shm_unregister(self, name: str | None, caller: Caller) -> None:
        self._cuda()
        self._shm_admin(caller)
        self.rt.shm.unregister(name, cuda=True)

    async def cuda_shm_status(self, name: str | None = None) -> list[CudaRegion]:
        self._serving()
        self._cuda()
        return [CudaRegion(d["name"], d["device_id"], d["byte_size"]) for d in self.rt.shm.status(name, cuda=True)]

    # -- model management, versions and weights -------------------------------------------------
    async def create_model(self, name: str, spec: dict[str, Any], config: dict[str, Any] | None,
                           caller: Caller) -> bool:
        """Create (True) or replace (False) a model from a tiny-cuda-nn spec; version 1 holds the
        seed's weights."""
        self._serving()
        self._admin(caller)
        refuse_changes(self.rt.settings, name)
        check_model_name(name)
        return await self.rt.registry.create(name, MLPSpec.from_json(spec), ServingConfig.parse(config))

    async def delete_model(self, name: str, caller: Caller) -> None:
        self._serving()
        self._admin(caller)
        refuse_changes(self.rt.settings, name)
        await self.rt.registry.delete(name)

    async def versions(self, name: str) -> list[VersionInfo]:
        self._serving()
        return [_version_info(v) for v in self.rt.registry.versions(name)]

    async def checkpoint(self, name: str, caller: Caller) -> VersionInfo:
        self._serving()
        self._admin(caller)
        refuse_changes(self.rt.settings, name)
        registry = self.rt.registry
        return _version_info(await registry.checkpoint(registry.get_ready(name)))

    async def get_weights(self, name: str, version: str | None = None) -> WeightsSnapshot:
        """A stored version's safetensors file, else the live weights now (a consistent snapshot:
        taken under the model's lock, between optimizer steps)."""
        self._serving()
        registry = self.rt.registry
        if version is not None:
            return WeightsSnapshot(await registry.stored_weights(name, version), version, None)
        data, step = await registry.live_weights(registry.get_ready(name))
        return WeightsSnapshot(data, None, step)

    async def set_weights(self, name: str, safetensors: bytes, caller: Caller) -> VersionInfo:
        self._serving()
        self._admin(caller)
        refuse_changes(self.rt.settings, name)
        registry = self.rt.registry
        entry = registry.get_ready(name)
        params = await registry.run(uploaded_weights, entry.spec, safetensors)
        return _version_info(await registry.set_weights(entry, params))


# a weight file's safetensors header: an entry per parameter (~70 bytes: name, dtype, shape,
# offsets) with room to spare, and the metadata a writer adds ({"format": "pt"} and the like)
HEADER_BYTES_PER_PARAMETER, HEADER_METADATA_BYTES = 256, 64 * 1024


def uploaded_weights(spec: MLPSpec, data: bytes) -> dict[str, np.ndarray]:
    """The tensors of a weight upload, its header bounded by what ``spec``'s parameters need."""
    check_safetensors_header(data, "the weight file", HEADER_METADATA_BYTES + HEADER_BYTES_PER_PARAMETER * len(
        param_shapes(spec)))
    return tensors_from_bytes(data, "the weight file")


async def _never() -> bool:
    return False
