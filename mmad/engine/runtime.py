"""The engine's components of one daemon process, as its start-up made them: what the engine's
functions and every front end reach (the HTTP routers through ``request.app.state.runtime``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from mmad.backends.contract import Backend, ProbeRow
from mmad.engine.metrics import Metrics
from mmad.engine.shm import SharedMemoryRegistry
from mmad.settings import Settings

if TYPE_CHECKING:  # only annotations: these modules import the runtime themselves
    from mmad.engine.jobs import JobManager
    from mmad.engine.messages import WorkerRecords
    from mmad.engine.region_forwards import RegionForwardClient, RegionForwardRunner
    from mmad.engine.registry import Registry
    from mmad.engine.repository_poll import RepositoryPoller
    from mmad.engine.store import Store


class ServingWorkers(Protocol):
    """What the engine needs of the processes serving beside it (``mmad serve --workers``): which
    are still starting, their counts, and what tells them that something inference sees changed.
    The process layout implements it; the engine and the front ends never know more of it."""

    token: str  # the internal routes' token, made at start

    @property
    def waiting(self) -> list[int]: ...

    async def records(self) -> list[WorkerRecords]: ...

    @property
    def region_forwards_socket(self) -> str: ...  # where the primary runs its workers' region forwards

    def publish(self, generation: int) -> None: ...

    def mark_ready(self, index: int) -> None: ...


@dataclass
class Runtime:
    """Everything the engine and the front ends reach."""

    settings: Settings
    metrics: Metrics
    executor: ThreadPoolExecutor
    forward_pool: ThreadPoolExecutor  # the chunks of one large host-side forward (never blocks on anything)
    backend: Backend | None = None
    selected: ProbeRow | None = None
    probe_rows: list[ProbeRow] | None = None
    store: Store | None = None
    registry: Registry | None = None
    jobs: JobManager | None = None
    shm: SharedMemoryRegistry = field(default_factory=SharedMemoryRegistry)  # Triton's system shared-memory regions
    ready: bool = False
    shutting_down: bool = False
    workers: ServingWorkers | None = None  # the serving workers of a primary with --workers
    # --workers on the cuda backend (mmad.engine.region_forwards): the primary runs its workers'
    # forwards between CUDA regions and between system regions, and their small batches of body
    # rows (its RegionForwardRunner); a worker sends them (its RegionForwardClient, which its
    # registry's batchers also reach)
    region_service: RegionForwardRunner | None = None
    region_forwards: RegionForwardClient | None = None
    repository_poller: RepositoryPoller | None = None  # --model-control-mode poll
