"""The engine's typed interface: what a front end (HTTP, gRPC) sends the engine and gets back.

Every front end reaches the engine only through :class:`EngineClient`: it parses its transport
into these dataclasses, awaits one method, and encodes the result. The types carry no transport
detail (no HTTP header, no protobuf message, no JSON document) and no engine internals (no model
lock, no device array, no registry entry), so the same request means the same thing whichever
front end made it, and an engine in another process can take the same types (they are plain
data: NumPy arrays, strings and numbers).

The shapes follow Triton's in-process API (``TRITONSERVER_InferenceRequest``: inputs as typed
tensors whose data lies in a buffer or a registered shared-memory region, requested outputs that
may name a region; ``TRITONSERVER_ServerModelMetadata`` and friends) and vLLM's
``EngineCoreClient`` (one client interface, whatever the process layout behind it).

Errors are mmad's tree (:mod:`mmad.errors`): the engine raises those, and each front end maps
them onto its status codes (``mmad/server/errors.py`` for HTTP, ``mmad/grpc/errors.py`` for gRPC).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, AsyncIterable, AsyncIterator, Awaitable, Callable, Literal, Optional, Protocol, runtime_checkable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mmad.errors import InvalidInput

# Triton's datatype names (its model configuration writes them TYPE_FP32 ...), and the NumPy
# dtype each travels as: little-endian, as raw tensor contents are. The models take and give
# FP32 and FP16 tensors; the others are listed so that a front end can name what it was sent.
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("?"), "UINT8": np.dtype("u1"), "UINT16": np.dtype("<u2"), "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"), "INT8": np.dtype("i1"), "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"), "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
}
MODEL_DATATYPES = ("FP32", "FP16")  # what a model's INPUT may be sent as and its OUTPUT asked for
WIRE_DTYPES = {name: DATATYPES[name] for name in MODEL_DATATYPES}  # their little-endian NumPy types

Datatype = Literal["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
                   "FP16", "FP32", "FP64", "BYTES", "BF16"]


@dataclass(frozen=True)
class ShmRef:
    """Bytes of a registered shared-memory region (system or CUDA): the region's name, the
    offset into it and the byte size (Triton's ``shared_memory_region``, ``_offset``,
    ``_byte_size`` parameters)."""

    region: str
    offset: int
    byte_size: int


@dataclass
class InferInput:
    """One input tensor: its data in ``data`` (an array of ``shape`` in ``datatype``'s dtype,
    often a view of the request's own bytes) or in shared memory (``shm``), never both."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray | None = None
    shm: ShmRef | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass
class RequestedOutput:
    """An output the client asks for, in ``datatype``. ``binary``: the client wants raw bytes
    rather than typed values (HTTP's ``binary_data``; gRPC always returns raw contents), which
    lets a front end ask the forward to write straight into its response. ``shm``: written into
    that region instead of the response."""

    name: str
    datatype: str = "FP32"
    binary: bool = True
    shm: ShmRef | None = None


# A front end's buffer for a response's output (Triton's TRITONSERVER_ResponseAllocator): called
# with the version that answers, the output and its shape, before the forward, which then writes
# (and casts) the output straight into the returned array (shape, the output's datatype); None
# lets the engine allocate it.
OutputAllocator = Callable[[str, RequestedOutput, tuple[int, ...]], Optional[np.ndarray]]


@dataclass
class InferRequest:
    """One inference request. ``version`` None runs the live weights (dynamically batched);
    a version runs that stored, immutable version. ``outputs`` None asks for every output in
    FP32. ``parameters``: the request's own (Triton's ``parameters``), passed through.
    ``allocate``: where the one output of a response that has one lands, when it goes to the
    client rather than into shared memory (:data:`OutputAllocator`); it stays in the front end's
    process (an engine in another process allocates its own)."""

    model: str
    inputs: list[InferInput]
    outputs: list[RequestedOutput] | None = None
    version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    allocate: OutputAllocator | None = field(default=None, repr=False, compare=False)


@dataclass
class InferOutput:
    """One output: ``data`` (``shape`` in ``datatype``), or None when it was written into ``shm``."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray | None = None
    shm: ShmRef | None = None


@dataclass
class InferResponse:
    model: str
    version: str
    outputs: list[InferOutput]
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TensorMetadata:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1 for the rows: any number


@dataclass
class ModelMetadata:
    """Triton's model metadata, and the state a repository index reports (``READY`` or
    ``UNAVAILABLE`` with the reason)."""

    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]
    state: str
    reason: str
    backend: str


@dataclass(frozen=True)
class TensorConfig:
    """An input or output of a model's configuration (Triton's ``ModelInput``/``ModelOutput``)."""

    name: str
    data_type: str  # Triton's enum name: TYPE_FP32
    dims: tuple[int, ...]


@dataclass
class ModelConfig:
    """Triton's model configuration of a model (what ``GET .../config`` and gRPC's ModelConfig
    answer), not the serving config a model is created with."""

    name: str
    platform: str
    backend: str
    max_batch_size: int
    inputs: list[TensorConfig]
    outputs: list[TensorConfig]
    max_queue_delay_us: int
    parameters: dict[str, Any]  # the serving config: batching limits, devices, variant, ...


@dataclass(frozen=True)
class Duration:
    count: int = 0
    ns: int = 0


@dataclass
class InferStatistics:
    success: Duration = Duration()
    fail: Duration = Duration()
    queue: Duration = Duration()
    compute_input: Duration = Duration()
    compute_infer: Duration = Duration()
    compute_output: Duration = Duration()
    cache_hit: Duration = Duration()
    cache_miss: Duration = Duration()


@dataclass(frozen=True)
class BatchStatistics:
    batch_size: int
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration


@dataclass
class ModelStatistics:
    """Triton's statistics extension for one model version (every serving process's requests
    added up)."""

    name: str
    version: str
    last_inference: int  # ms since the epoch
    inference_count: int
    execution_count: int
    inference_stats: InferStatistics
    batch_stats: list[BatchStatistics]


@dataclass(frozen=True)
class RepositoryEntry:
    """One row of the repository index."""

    name: str
    version: str
    state: str  # READY or UNAVAILABLE
    reason: str


@dataclass(frozen=True)
class SystemRegion:
    """A registered system (POSIX) shared-memory region. ``page_locked`` (mmad's addition): where
    the daemon tried to page-lock the region for device copies, whether that worked (None: not
    tried), and ``page_locked_error`` why not."""

    name: str
    key: str
    offset: int
    byte_size: int
    page_locked: bool | None = None
    page_locked_error: str | None = None


@dataclass(frozen=True)
class CudaRegion:
    """A registered CUDA shared-memory region."""

    name: str
    device_id: int
    byte_size: int


@dataclass(frozen=True)
class ServerMetadata:
    """The server's name, version and the extensions the engine serves (each front end adds
    its own, such as HTTP's binary tensor data)."""

    name: str
    version: str
    extensions: tuple[str, ...]


@dataclass(frozen=True)
class Readiness:
    ready: bool
    reason: str = ""  # why not, in the user's terms


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as its front end established it: ``key_verified`` (it sent the
    daemon's API key, checked by :func:`mmad.engine.auth.authenticate`; False when the daemon has
    no key) and ``loopback`` (it came from this host). The engine applies the rules that depend on
    them: administrative calls need the key when one is set."""

    key_verified: bool
    loopback: bool
    # (client host, client port, the daemon's port) of a TCP client: which local user holds a
    # loopback connection can be told from it; None where the transport does not say
    address: tuple[str, int, int] | None = None


@dataclass(frozen=True)
class VersionInfo:
    """A stored version of a model: its number, the optimizer step it was saved at, when (seconds
    since the epoch) and its weight file's SHA-256 (None for a version stored without one)."""

    version: str
    step: int
    created: float
    sha256: str | None = None


@dataclass(frozen=True)
class WeightsSnapshot:
    """A model's weights as a safetensors file: a stored version's, or the live weights at
    ``step``."""

    data: bytes
    version: str | None
    step: int | None


@runtime_checkable
class InferenceClient(Protocol):
    """What serving a model needs: Triton's protocol (health, metadata, configuration, infer,
    statistics, the repository and the shared-memory extensions). Every method is a coroutine
    that owns its locks and executors: a front end never blocks its event loop on device work."""

    async def live(self) -> bool: ...

    async def ready(self) -> Readiness: ...

    async def server_metadata(self) -> ServerMetadata: ...

    async def model_metadata(self, name: str, version: str | None = None) -> ModelMetadata: ...

    async def model_ready(self, name: str, version: str | None = None) -> bool: ...

    async def model_config(self, name: str, version: str | None = None) -> ModelConfig: ...

    async def infer(self, request: InferRequest) -> InferResponse: ...

    async def statistics(self, name: str | None = None, version: str | None = None) -> list[ModelStatistics]: ...

    async def repository_index(self, ready_only: bool = False) -> list[RepositoryEntry]: ...

    async def load_model(self, name: str, caller: Caller) -> None: ...

    async def unload_model(self, name: str, caller: Caller) -> None: ...

    async def system_shm_register(self, name: str, key: str, offset: int, byte_size: int, caller: Caller) -> None: ...

    async def system_shm_unregister(self, name: str | None, caller: Caller) -> None: ...

    async def system_shm_status(self, name: str | None = None) -> list[SystemRegion]: ...

    async def cuda_shm_register(self, name: str, raw_handle: bytes, device_id: int, byte_size: int,
                                caller: Caller) -> None: ...

    async def cuda_shm_unregister(self, name: str | None, caller: Caller) -> None: ...

    async def cuda_shm_status(self, name: str | None = None) -> list[CudaRegion]: ...


@dataclass(frozen=True)
class ModelStatus:
    """mmad's own state of a model, beside Triton's metadata: the newest stored version, the live
    weights' optimizer step, requests waiting in its queues (every serving process's), the
    devices its replicas run on (primary first), the kernel variant the primary runs and the
    dispatcher's measurement that chose it, its tiny-cuda-nn spec and its serving config."""

    latest_version: str
    step: int
    queued_requests: int
    devices: tuple[int, ...]
    variant: str | None
    dispatch: dict[str, Any] | None
    spec: dict[str, Any]
    config: dict[str, Any]


@runtime_checkable
class ModelStoreClient(Protocol):
    """mmad's model management: create, replace and delete models, their stored versions and
    weights (HTTP's ``mmad_model_management``, ``mmad_weights``, ``mmad_versions``)."""

    async def create_model(self, name: str, spec: dict[str, Any], config: dict[str, Any] | None,
                           caller: Caller) -> bool: ...

    async def delete_model(self, name: str, caller: Caller) -> None: ...

    async def model_status(self, name: str, version: str | None = None) -> ModelStatus: ...

    async def versions(self, name: str) -> list[VersionInfo]: ...

    async def checkpoint(self, name: str, caller: Caller) -> VersionInfo: ...

    async def get_weights(self, name: str, version: str | None = None) -> WeightsSnapshot: ...

    async def set_weights(self, name: str, safetensors: bytes, caller: Caller) -> VersionInfo: ...


@dataclass(frozen=True)
class TrainResult:
    """The losses of a ``train`` call's steps (None where a loss was not finite) and the
    model's step count after them."""

    losses: list[float | None]
    step: int


@dataclass(frozen=True)
class DatasetSummary:
    """A stored dataset of a model: rows, bytes as stored, x's and y's element types (float32 or
    float16), the chunks it was uploaded in; ``on_device``: its model's backend holds a copy for
    training."""

    dataset: str
    rows: int
    bytes: int
    x_dtype: str
    y_dtype: str
    chunks: int
    on_device: bool


# A dataset chunk as it arrives: its bytes piece by piece (never whole in memory), and the size
# its sender declared where it did (refused at once when that is over a limit).
ChunkStream = AsyncIterable[bytes]


class JobRequest(BaseModel):
    """A training job: ``steps`` optimizer steps of ``batch_size`` rows drawn from ``dataset``."""

    model_config = ConfigDict(extra="forbid")

    dataset: str
    steps: int = Field(ge=1, le=1_000_000_000)
    batch_size: int = Field(ge=1, le=1 << 24)
    checkpoint_every: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**32, description="the epochs' order (random when not given)")
    data_parallel: bool | None = Field(
        None, description="train on every replica of the model, each on its shard of the dataset and its part "
                          "of each batch (default: when the model has replicas on several devices)")

    @classmethod
    def parse(cls, doc: Any) -> "JobRequest":
        """A request from its JSON document; the first thing wrong named in the user's terms."""
        try:
            return cls.model_validate(doc)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(body)"
            raise InvalidInput(f"{where}: {first['msg']}") from exc


@dataclass(frozen=True)
class JobStatus:
    """A training job's state (queued, running, done, cancelled, failed) and progress: the step
    it reached of ``steps``, the epoch and the last loss (None where it was NaN or Inf), the
    versions it checkpointed, the error that ended it. The field names are the JSON keys."""

    job: str
    model_name: str
    state: str
    step: int
    steps: int
    batch_size: int
    checkpoint_every: int
    dataset: str
    rows: int
    seed: int
    epoch: int
    devices: list[int]
    loss: float | None
    samples_per_s: float
    versions: list[str]
    error: str | None


@dataclass(frozen=True)
class JobLosses:
    """A job's loss curve from its first step: ``[step, loss]`` pairs (loss None where it was NaN
    or Inf), at most about a thousand, evenly merged as the job runs."""

    job: str
    model_name: str
    step: int
    points: list[list[Any]]


@dataclass(frozen=True)
class JobEvent:
    """One event of a job's progress stream: ``progress`` (step, steps, epoch, loss,
    samples_per_s), ``checkpoint`` (version, step), and last the state it ended in (done,
    cancelled, failed) with the job's whole status."""

    event: str
    data: dict[str, Any]


@runtime_checkable
class TrainingClient(Protocol):
    """Training on a sent batch, datasets and training jobs (HTTP's ``mmad_training``,
    ``mmad_datasets``, ``mmad_training_jobs``); no front end but HTTP serves them (docs/api.md,
    "gRPC")."""

    async def train(self, name: str, tensors: dict[str, np.ndarray], steps: int, caller: Caller,
                    stop: Callable[[], Awaitable[bool]] | None = None) -> TrainResult: ...

    async def create_dataset(self, name: str, chunk: ChunkStream, declared_bytes: int | None,
                             caller: Caller) -> DatasetSummary: ...

    async def append_dataset_chunk(self, name: str, dataset: str, chunk: ChunkStream, declared_bytes: int | None,
                                   caller: Caller) -> DatasetSummary: ...

    async def datasets(self, name: str) -> list[DatasetSummary]: ...

    async def dataset(self, name: str, dataset: str) -> DatasetSummary: ...

    async def delete_dataset(self, name: str, dataset: str, caller: Caller) -> None: ...

    async def start_job(self, name: str, job: JobRequest, caller: Caller) -> JobStatus: ...

    async def jobs(self) -> list[JobStatus]: ...

    async def job_status(self, name: str, job_id: str) -> JobStatus: ...

    async def job_losses(self, name: str, job_id: str) -> JobLosses: ...

    async def cancel_job(self, name: str, job_id: str, caller: Caller) -> JobStatus: ...

    async def job_events(self, name: str, job_id: str) -> AsyncIterator[JobEvent]:
        """The job's events from now on, current progress first (or its final state when it has
        ended); an unknown job is refused when this is awaited, before the first event."""
        ...


@dataclass(frozen=True)
class DevicesReport:
    """What the daemon runs on: the backend and variant chosen at start (``selected``: a probe
    row's JSON), every probe row, each device models can be placed on (memory now, the models
    with a replica there, the forwards running or waiting there) and the dispatcher's decision
    for each replica whose variant was measured."""

    selected: dict[str, Any]
    rows: list[dict[str, Any]]
    devices: list[dict[str, Any]]
    dispatch: list[dict[str, Any]]


@runtime_checkable
class EngineClient(InferenceClient, ModelStoreClient, TrainingClient, Protocol):
    """The one engine interface: every front end talks to the engine through it, whether the
    engine runs in the front end's process (:class:`~mmad.engine.inprocess.InProcessEngine`) or
    behind it in others, so no front end branches on the process layout."""

    async def devices(self) -> DevicesReport: ...
