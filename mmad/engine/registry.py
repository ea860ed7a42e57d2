"""Loaded models: compiled weights on the device, versions in the store, consistent snapshots.

Each model has one *live* compiled model (the weights training updates) and a lock: every
forward, train step, weight upload and snapshot of the live model holds it, so a forward sees
the weights before or after a whole optimizer step, never in between. A version is an
immutable snapshot in the store; infer pinned to a version runs a separate compiled copy loaded
from the store (kept in a small cache), so a new version becomes visible in one step (the
store's listing is replaced atomically) and old versions never change.

Nothing non-finite is published: a train step whose loss or weights are NaN/Inf puts the live
weights back (``Diverged``), and no version of non-finite weights is written. Weight uploads are
written to the store first and swapped into the live model only once acknowledged. Training
runs on its own bounded executor so that it never takes every compute thread from inference.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from mmad.backends import parse_forced
from mmad.backends.contract import Backend, CompiledModel, Dataset, EpochPosition, ProbeRow, check_params
from mmad.errors import ConflictError, Diverged, MMADError, ModelNotFound, ModelNotReady, StoreDamaged
from mmad.engine import background_dispatch
from mmad.engine.batcher import Batcher
from mmad.engine.config import ModelConfig
from mmad.engine.datasets import DatasetCache
from mmad.engine.messages import ServedModel
from mmad.engine.metrics import Metrics
from mmad.engine.placement import DeviceLoad, place
from mmad.settings import Settings
from mmad.engine.store import Store, check_model_name, check_version, tensors_to_bytes
from mmad.spec import MLPSpec

log = logging.getLogger("mmad.engine.registry")

PINNED_CACHE_SIZE = 2
INPUT, OUTPUT, TARGET = "INPUT", "OUTPUT", "TARGET"

DEMO_NAME = "demo"
# a small neural field: 2-D coordinates -> RGB, frequency-encoded like NeRF-style models
DEMO_SPEC = {
    "n_input_dims": 2, "n_output_dims": 3,
    "network": {"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "None",
                "n_neurons": 64, "n_hidden_layers": 2},
    "encoding": {"otype": "Frequency", "n_frequencies": 6},
    "loss": {"otype": "L2"},
    "optimizer": {"otype": "Adam", "learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.99, "epsilon": 1e-15},
    "precision": "fp16", "seed": 1337,
}


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class InferStats:
    """Triton's statistics extension counters for one model."""

    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    batches: dict[int, Duration] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record_batch(self, rows: int, compute_ns: int) -> None:
        with self.lock:
            self.execution_count += 1
            self.batches.setdefault(rows, Duration()).add(compute_ns)

    def to_json(self, name: str, version: str) -> dict[str, Any]:
        with self.lock:
            durations = {k: getattr(self, k).to_json() for k in
                         ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")}
            batch_stats = [{"batch_size": rows, "compute_input": {"count": d.count, "ns": 0},
                            "compute_infer": d.to_json(), "compute_output": {"count": d.count, "ns": 0}}
                           for rows, d in sorted(self.batches.items())]
            return {"name": name, "version": version, "last_inference": self.last_inference_ms,
                    "inference_count": self.inference_count, "execution_count": self.execution_count,
                    "inference_stats": {**durations, "cache_hit": {"count": 0, "ns": 0},
                                        "cache_miss": {"count": 0, "ns": 0}},
                    "batch_stats": batch_stats}


@dataclass
class Replica:
    """One compiled copy of a model on one device, with the lock every use of it holds."""

    device: int
    model: CompiledModel | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    in_flight: int = 0  # forwards running or waiting on it (the batcher's choice of replica)
    batches: int = 0  # forwards it ran (metrics: which device served what)
    rows: int = 0


class ModelEntry:
    """One model known to the daemon (loaded or not).

    Its replicas hold the same weights on different devices; the first (``live``, ``lock``) is
    the one training updates, the others (``copies``) are brought level after each training call,
    or train alongside it (data-parallel jobs). Inference takes the least busy replica."""

    def __init__(self, name: str, spec: MLPSpec, config: ModelConfig):
        self.name = name
        self.spec = spec
        self.config = config
        self.replicas: list[Replica] = [Replica(0)]  # the first: the primary; its device set when placed
        self._pick_lock = threading.Lock()
        self._turn = 0  # the replica that goes first among equally busy ones
        self.parallel: Any = None  # the data-parallel trainer over the replicas, made by the first job needing it
        self.checkpoint_lock = threading.Lock()  # orders snapshots with their version numbers
        self.batcher: Batcher | None = None
        self.pinned: collections.OrderedDict[str, CompiledModel] = collections.OrderedDict()
        self.pinned_lock = threading.Lock()
        self.stats = InferStats()
        self.busy_job: str | None = None  # a running training job owns the model's lifecycle
        self.versions: list[dict[str, Any]] = []  # the store's acknowledged listing, replaced whole
        self.incarnation: str | None = None  # the store directory this entry's versions go to
        self.damaged: dict[str, str] = {}  # version -> why it could not be loaded
        self.loaded_version: str | None = None  # the version the last load restored
        self.reason = ""
        # bumped by every change inference can see (weights, versions, readiness): the serving
        # workers (mmad/server/workers.py) re-read a model whose generation moved
        self.generation = 0
        self.notify: Callable[["ModelEntry"], None] = lambda entry: None

    @property
    def live(self) -> CompiledModel | None:
        return self.replicas[0].model

    @live.setter
    def live(self, model: CompiledModel | None) -> None:
        self.replicas[0].model = model

    @property
    def lock(self) -> threading.Lock:
        """Held by every use of ``live`` (the primary replica)."""
        return self.replicas[0].lock

    @property
    def copies(self) -> list[Replica]:
        return self.replicas[1:]

    @property
    def devices(self) -> list[int]:
        return [r.device for r in self.replicas]

    @property
    def ready(self) -> bool:
        return self.live is not None

    def forward_live(self, x: np.ndarray, out: np.ndarray, pool: Executor, check_finite: bool = False) -> None:
        """The forward of ``x`` written into ``out`` (host chunks on ``pool``'s threads), on the
        replica with the fewest forwards in flight (``check_finite``: as ``forward_to_host``'s)."""
        with self._pick_lock:
            # the fewest in flight; among equals, each in turn: one request at a time (a serving
            # process with one client) would otherwise always find the first replica idle
            n = len(self.replicas)
            self._turn = (self._turn + 1) % n
            replica = min((self.replicas[(self._turn + k) % n] for k in range(n)), key=lambda r: r.in_flight)
            replica.in_flight += 1
        try:
            with replica.lock:
                if replica.model is None:
                    raise ModelNotReady(self.name)
                replica.model.forward_to_host(x, out, pool, check_finite)
                replica.batches += 1
                replica.rows += x.shape[0]
        finally:
            with self._pick_lock:
                replica.in_flight -= 1

    def put_all(self, params: dict[str, np.ndarray] | None, optimizer_state: dict[str, np.ndarray] | None = None,
                replicas: list[Replica] | None = None) -> None:
        """Weights and/or optimizer state into every replica (or those given), each under its lock."""
        for replica in self.replicas if replicas is None else replicas:
            with replica.lock:
                if replica.model is None:
                    raise ModelNotReady(self.name)
                if params is not None:
                    replica.model.set_params(params)
                if optimizer_state is not None:
                    replica.model.set_optimizer_state(optimizer_state)
        self.notify(self)

    def sync_copies(self) -> None:
        """Bring the other replicas level with the primary after it trained alone."""
        if not self.copies:
            return
        with self.lock:
            if self.live is None:
                raise ModelNotReady(self.name)
            params, state = self.live.get_params(), self.live.get_optimizer_state()
        self.put_all(params, state, self.copies)

    def train_live(self, x: np.ndarray, y: np.ndarray, steps: int, done: int = 0,
                   total: int | None = None) -> tuple[np.ndarray, int]:
        """``steps`` optimizer steps on one batch (on the primary; the copies follow); see
        ``_train_guarded``."""
        result = self._train_guarded(lambda model: model.train_step(x, y, steps), steps, done, total)
        self.sync_copies()
        return result

    def train_live_epochs(self, data: Dataset, batch: int, steps: int, position: EpochPosition,
                          done: int = 0, total: int | None = None) -> tuple[np.ndarray, int]:
        """``steps`` optimizer steps on batches of a held dataset drawn on the device in the order
        of ``position`` (advanced), on the primary (the copies follow); see ``_train_guarded``."""
        result = self._train_guarded(lambda model: model.train_epochs(data, batch, steps, position), steps, done,
                                     total)
        self.sync_copies()
        return result

    def train_parallel_epochs(self, shards: list[Dataset], batches: list[int], steps: int,
                              positions: list[EpochPosition], done: int = 0,
                              total: int | None = None) -> tuple[np.ndarray, int]:
        """``steps`` data-parallel optimizer steps: replica r draws ``batches[r]`` rows a step from
        ``shards[r]`` in the order of ``positions[r]``; see ``_train_guarded``."""
        return self._train_guarded(
            lambda model: self.parallel.train_epochs(shards, batches, steps, positions), steps, done, total,
            self.replicas)

    def _train_guarded(self, train: Callable[[CompiledModel], np.ndarray], steps: int, done: int,
                       total: int | None, replicas: list[Replica] | None = None) -> tuple[np.ndarray, int]:
        """(losses, step count) of ``train(live model)`` holding the locks of the primary and of
        ``replicas`` (those that train too); a non-finite loss or weights puts back the weights
        (and optimizer state) of before the call on each and raises Diverged, so no forward ever
        sees them."""
        held = replicas or self.replicas[:1]
        try:
            return self._train_holding(train, steps, done, total, held)
        finally:
            self.notify(self)

    def _train_holding(self, train: Callable[[CompiledModel], np.ndarray], steps: int, done: int,
                       total: int | None, held: list[Replica]) -> tuple[np.ndarray, int]:
        with contextlib.ExitStack() as stack:
            for replica in held:  # always in replica order: no two trainers wait on each other
                stack.enter_context(replica.lock)
            if any(r.model is None for r in held):
                raise ModelNotReady(self.name)
            before = (self.live.get_params(), self.live.get_optimizer_state())
            losses = train(self.live)
            bad = np.flatnonzero(~np.isfinite(losses))
            if bad.size or not params_finite(self.live.get_params()):
                for replica in held:
                    replica.model.set_params(before[0])
                    replica.model.set_optimizer_state(before[1])
                at = int(bad[0]) + 1 if bad.size else steps
                exc = Diverged(
                    f"training of model {self.name!r} diverged at step {done + at} of {total or steps} "
                    f"({'loss ' + str(float(losses[at - 1])) if bad.size else 'non-finite weights'}); lower the "
                    "learning rate or scale the targets")
                if bad.size:
                    exc.step, exc.losses = done + at, losses[:at].tolist()
                raise exc
            return losses, self.live.step_count


def params_finite(params: dict[str, np.ndarray]) -> bool:
    return all(np.isfinite(a).all() for a in params.values())


class Registry:
    """Every model of the store, with its compiled form when loaded."""

    def __init__(self, settings: Settings, store: Store, backend: Backend, row: ProbeRow,
                 executor: Executor, metrics: Metrics, forward_pool: Executor):
        self.settings = settings
        self.store = store
        self.backend = backend
        self.row = row
        self.executor = executor
        self.forward_pool = forward_pool
        self.metrics = metrics
        self.models: dict[str, ModelEntry] = {}
        self.unreadable: dict[str, str] = {}  # models whose model.json cannot be read: the reason
        self._admin = asyncio.Lock()  # create / replace / delete / load / unload, one at a time
        # training's own threads: long train requests and jobs never hold every compute thread,
        # so inference (on ``executor``) keeps its share
        self.train_executor = ThreadPoolExecutor(max(1, settings.compute_threads // 2),
                                                 thread_name_prefix="mmad-train")
        self.datasets = DatasetCache(self)  # datasets held by the models' backends for training
        # what the serving workers see: bumped after every change of a model or of the
        # shared-memory regions, before the request that made it is answered
        self.generation = 0
        self._generation_lock = threading.Lock()
        self.publish: Callable[[int], None] | None = None  # the workers' shared counter, with --workers
        # a serving worker's on cuda: its small batches run in the primary's CUDA context
        # (mmad.engine.region_forwards.RegionForwardClient.forward_rows)
        self.row_forwards: Any = None

    def changed(self, entry: ModelEntry | None = None) -> None:
        """A change inference can see (in ``entry``, or elsewhere: the regions); published to
        the workers once made."""
        with self._generation_lock:
            if entry is not None:
                entry.generation += 1
            self.generation += 1
            if self.publish is not None:
                self.publish(self.generation)

    @property
    def backend_label(self) -> str:
        return f"{self.row.backend}:{self.row.variant}"

    async def run(self, fn: Callable, *args: Any) -> Any:
        """Run blocking (device or disk) work on the compute threads."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def run_training(self, fn: Callable, *args: Any) -> Any:
        """Run one slice of training on the training threads."""
        return await asyncio.get_running_loop().run_in_executor(self.train_executor, fn, *args)

    def get(self, name: str) -> ModelEntry:
        check_model_name(name)
        entry = self.models.get(name)
        if entry is None:
            raise ModelNotFound(f"unknown model {name!r}")
        return entry

    def get_ready(self, name: str) -> ModelEntry:
        entry = self.get(name)
        if not entry.ready:
            raise ModelNotReady(name)
        return entry

    def versions(self, name: str) -> list[dict[str, Any]]:
        """The acknowledged versions (cached from the store; every write replaces the list)."""
        entry = self.get(name)
        if not entry.versions:  # a model whose load failed: read the listing as it is
            try:
                entry.versions = self.store.versions(name)
            except MMADError:  # a damaged listing: the model stays UNAVAILABLE, its reason says why
                return []
        return entry.versions

    def latest_version(self, name: str) -> str:
        versions = self.versions(name)
        return versions[-1]["version"] if versions else ""

    def check_version(self, name: str, version: str) -> str:
        check_version(version)
        if not any(v["version"] == version for v in self.versions(name)):
            raise ModelNotFound(f"model {name!r} has no version {version!r}")
        return version

    # -- placement ------------------------------------------------------------------------
    def device_loads(self) -> list[DeviceLoad]:
        """Each device's free memory (read now) and the replicas placed there."""
        held = collections.Counter(r.device for e in self.models.values() if e.ready for r in e.replicas)
        return [DeviceLoad(d.index, d.memory_free, held[d.index]) for d in self.backend.devices()]

    def _place(self, config: ModelConfig) -> list[int]:
        return place(self.device_loads(), config.device, config.replicas)

    # -- lifecycle ------------------------------------------------------------------------
    def _compile(self, spec: MLPSpec, device: int = 0, variant: str | None = None,
                 batch_rows: int | None = None) -> CompiledModel:
        """``variant`` (the model's config), else the one MMAD_BACKEND names, else the backend's
        choice, measured on ``batch_rows`` rows (the model's max_batch_rows) where it measures: a
        decision not yet cached is measured in the background while a quick variant serves
        (``_activate`` follows it, :mod:`mmad.engine.background_dispatch`)."""
        forced = parse_forced(self.settings.backend or "")
        return self.backend.compile(spec, variant=variant or (forced[1] if forced else None), device=device,
                                    batch_rows=batch_rows)

    def _compile_replicas(self, spec: MLPSpec, devices: list[int], variant: str | None = None,
                          batch_rows: int | None = None,
                          params: dict[str, np.ndarray] | None = None) -> list[CompiledModel]:
        """The model compiled on each device, holding ``params`` if given (all closed again if one fails)."""
        params = check_params(spec, params) if params is not None else None
        compiled: list[CompiledModel] = []
        try:
            for device in devices:
                compiled.append(self._compile(spec, device, variant, batch_rows))
                if params is not None:
                    compiled[-1].set_params(params)
        except BaseException:
            for model in compiled:
                model.close()
            raise
        return compiled

    def _load_blocking(self, entry: ModelEntry) -> CompiledModel:
        """Compile and restore the newest intact, finite version (weights + optimizer state).

        A damaged version (missing or altered file, non-finite weights) is reported in
        ``entry.damaged`` and never hides an intact newer or older one; with none intact the
        load fails with every version's reason.
        """
        entry.incarnation = self.store.incarnation(entry.name)
        self.store.remove_unlisted_files(entry.name)
        versions = self.store.versions(entry.name)
        damaged: dict[str, str] = {}
        loaded = None
        # what is served is read and sha256-checked; the older versions only seen to be there
        # (their sha256 is checked when a request reads one): start-up stays linear in versions
        for v in reversed(versions):
            try:
                if loaded is None:
                    params, optimizer_state = self.store.load_version(entry.name, v["version"], v)
                    if not params_finite(params):
                        raise StoreDamaged(f"stored weights of {entry.name!r} version {v['version']} hold NaN or Inf")
                    loaded = v["version"], params, optimizer_state
                else:
                    self.store.version_files_present(entry.name, v["version"])
            except MMADError as exc:
                damaged[v["version"]] = str(exc)
        entry.versions = versions
        entry.damaged = damaged
        entry.loaded_version = loaded[0] if loaded else None
        if loaded is None:
            raise MMADError(f"no intact version of model {entry.name!r}: " + "; ".join(damaged.values()))
        compiled = self._compile_replicas(entry.spec, self._place(entry.config), entry.config.variant,
                                          entry.config.limits(self.settings).max_batch_rows)
        try:
            for model in compiled:
                model.set_params(loaded[1])
                model.set_optimizer_state(loaded[2])
        except BaseException:
            for model in compiled:
                model.close()
            raise
        return compiled

    def _damage_note(self, entry: ModelEntry) -> str:
        damaged = entry.damaged
        if not damaged:
            return ""
        order = sorted(damaged, key=int)  # (a damaged version beyond the loaded one: found when read)
        return (f"serving version {entry.loaded_version}, the newest intact one; damaged versions "
                f"{', '.join(order)}: " + "; ".join(damaged[v] for v in order))

    def _activate(self, entry: ModelEntry, compiled: list[CompiledModel]) -> None:
        """Serve ``compiled`` (one model per replica, the primary first)."""
        entry.replicas = [Replica(model.device_index, model) for model in compiled]
        entry.reason = self._damage_note(entry)
        entry.notify = self.changed
        entry.batcher = Batcher(entry.name, lambda x, out, check: entry.forward_live(x, out, self.forward_pool, check),
                                entry.spec.n_output_dims, self.executor, entry.config.limits(self.settings),
                                on_batch=lambda rows, n, ns, e=entry: self.record_batch(e, rows, n, ns),
                                concurrency=len(compiled), remote=lambda x, e=entry: self._remote_forward(e, x))
        entry.batcher.start()
        self.metrics.models_loaded.set(sum(1 for e in self.models.values() if e.ready))
        self.changed(entry)
        background_dispatch.watch(self, entry)  # a quick variant serving meanwhile: the measured one swapped in

    def _remote_forward(self, entry: ModelEntry, x: np.ndarray) -> Callable | None:
        """Where a batch of the model's batcher runs in another process: a serving worker's small
        batch in the primary's CUDA context (every worker's own context on the GPU would be
        time-sliced with the others'); None: on this process's replicas."""
        remote = self.row_forwards
        if remote is None or not remote.takes_rows(x):
            return None
        return functools.partial(remote.forward_rows, entry.name)

    def record_batch(self, entry: ModelEntry, rows: int, requests: int, compute_ns: int,
                     version: str | None = None) -> None:
        """One executed batch of the live model, or of ``version`` when pinned."""
        entry.stats.record_batch(rows, compute_ns)
        self.metrics.inference.batch_executed(entry, version, rows)
        labels = (entry.name, self.backend_label)
        self.metrics.compute_seconds.labels(*labels).observe(compute_ns / 1e9)
        self.metrics.batch_rows.labels(*labels).observe(rows)
        self.metrics.batch_requests.labels(*labels).observe(requests)
        self.metrics.inference_samples.labels(*labels).inc(rows)

    async def _deactivate(self, entry: ModelEntry) -> None:
        self.datasets.forget_model(entry.name)  # copies made for the compiled model closed below
        if entry.batcher is not None:
            await entry.batcher.stop()
            entry.batcher = None

        def close_all() -> None:
            if entry.parallel is not None:
                entry.parallel.close()
                entry.parallel = None
            for replica in entry.replicas:
                with replica.lock:
                    if replica.model is not None:
                        replica.model.close()
                        replica.model = None
            with entry.pinned_lock:
                for compiled in entry.pinned.values():
                    compiled.close()
                entry.pinned.clear()

        await self.run(close_all)
        self.metrics.models_loaded.set(sum(1 for e in self.models.values() if e.ready))
        self.changed(entry)

    def _entry_from_store(self, name: str) -> ModelEntry:
        """A model's entry from its stored description; one that cannot be used is StoreDamaged (409)."""
        doc = self.store.read_model_doc(name)
        try:
            return ModelEntry(name, MLPSpec.from_json(doc["spec"]), ModelConfig.parse(doc.get("config")))
        except Exception as exc:  # noqa: BLE001 - a spec or config no longer valid, in any way
            raise StoreDamaged(f"the description of model {name!r} (model.json) is unreadable: {_reason(exc)}") from exc

    async def load_all(self) -> None:
        """Load every model of the store; one that cannot be loaded stays UNAVAILABLE with its
        reason (index, metadata, log) and never stops the others."""
        for name in self.store.list_models():
            if name in self.models:  # created by this process already (the demo model)
                continue
            try:
                entry = self._entry_from_store(name)
            except MMADError as exc:  # whatever is wrong with one model, the others serve
                self.unreadable[name] = str(exc)
                log.error("model %s in the store stays unloaded: %s", name, self.unreadable[name])
                continue
            self.models[name] = entry
            try:
                self._activate(entry, await self.run(self._load_blocking, entry))
                if entry.reason:
                    log.warning("model %s: %s", name, entry.reason)
                log.info("loaded model %s (version %s)", name, self.latest_version(name))
            except Exception as exc:  # noqa: BLE001
                entry.reason = _reason(exc)
                log.error("model %s could not be loaded: %s", name, exc)

    async def create(self, name: str, spec: MLPSpec, config: ModelConfig,
                     params: dict[str, np.ndarray] | None = None, version: str = "1") -> bool:
        """Create or replace a model at version 1 (or ``version``) holding the seed's weights (or
        ``params``, checked); True when it did not exist before.

        The new model is compiled first; an old one is then drained and closed before the store
        swaps the directories, so nothing of the old model can write into the new one.
        """
        check_model_name(name)
        async with self._admin:
            old = self.models.get(name)
            if old is not None and old.busy_job:
                raise ConflictError(f"model {name!r} is training (job {old.busy_job}); cancel it first")
            # the old model's replicas count against its devices until it goes: placed as if it stayed
            compiled = await self.run(lambda: self._compile_replicas(
                spec, self._place(config), config.variant, config.limits(self.settings).max_batch_rows, params))
            doc = {"spec": spec.to_json(), "config": config.model_dump(), "created": time.time()}
            try:
                if old is not None:
                    await self._deactivate(old)
                first, incarnation = await self.run(lambda: (
                    self.store.create_model(name, doc, compiled[0].get_params(), compiled[0].get_optimizer_state(),
                                            version),
                    self.store.incarnation(name)))
            except BaseException:
                for model in compiled:
                    model.close()
                if old is not None:  # the store still holds the old model: serve it again
                    try:
                        self._activate(old, await self.run(self._load_blocking, old))
                    except MMADError as exc:
                        old.reason = str(exc)
                raise
            entry = ModelEntry(name, spec, config)
            entry.versions = [first]
            entry.incarnation = incarnation
            self.unreadable.pop(name, None)
            self.models[name] = entry
            self._activate(entry, compiled)
            return old is None

    async def delete(self, name: str) -> None:
        async with self._admin:
            entry = self.get(name)
            if entry.busy_job:
                raise ConflictError(f"model {name!r} is training (job {entry.busy_job}); cancel it first")
            # the store first: a refused deletion (a read-only store: 507) changes nothing served; once
            # the directory is gone, a checkpoint racing this fails (the incarnation is gone too)
            await self.run(self.store.delete_model, name)
            await self._deactivate(entry)
            del self.models[name]
            self.changed()
            self.unreadable.pop(name, None)

    async def load(self, name: str) -> None:
        check_model_name(name)
        async with self._admin:
            entry = self.models.get(name)
            if entry is not None and entry.ready:
                return
            if entry is None:
                if not self.store.exists(name):
                    raise ModelNotFound(f"unknown model {name!r}")
                entry = self._entry_from_store(name)
                self.models[name] = entry
            self._activate(entry, await self.run(self._load_blocking, entry))

    async def unload(self, name: str) -> None:
        async with self._admin:
            entry = self.get(name)
            if entry.busy_job:
                raise ConflictError(f"model {name!r} is training (job {entry.busy_job}); cancel it first")
            await self._deactivate(entry)
            entry.reason = "unloaded"

    async def close(self) -> None:
        for entry in list(self.models.values()):
            await self._deactivate(entry)
        self.datasets.clear()
        self.train_executor.shutdown(wait=True)

    # -- weights and versions -------------------------------------------------------------
    def checkpoint_blocking(self, entry: ModelEntry) -> dict[str, Any]:
        """Persist the live weights and optimizer state as a new version (acknowledged on return)."""
        with entry.checkpoint_lock:
            with entry.lock:
                if entry.live is None:
                    raise ModelNotReady(entry.name)
                params = entry.live.get_params()
                optimizer_state = entry.live.get_optimizer_state()
                step = entry.live.step_count
            if not params_finite(params):
                raise Diverged(f"the live weights of model {entry.name!r} hold NaN or Inf; they were not saved "
                               f"(put a version back: PUT /v2/models/{entry.name}/weights)")
            version = self.store.add_version(entry.name, params, optimizer_state, step, entry.incarnation,
                                             entry.config.keep_versions)
            self._versions_changed(entry)
            return version

    def snapshot_blocking(self, entry: ModelEntry) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]:
        """(params, optimizer state, step count) of the live model, for ``restore_blocking``."""
        with entry.lock:
            if entry.live is None:
                raise ModelNotReady(entry.name)
            return entry.live.get_params(), entry.live.get_optimizer_state(), entry.live.step_count

    def restore_blocking(self, entry: ModelEntry, snapshot, at_step: int) -> bool:
        """Put ``snapshot`` back into the live model (and its copies) if its step count is still
        ``at_step`` (no other training came in between, whose steps this would undo); True when it did."""
        with entry.lock:
            if entry.live is None or entry.live.step_count != at_step:
                return False
            entry.live.set_params(snapshot[0])
            entry.live.set_optimizer_state(snapshot[1])
        entry.put_all(snapshot[0], snapshot[1], entry.copies)
        return True

    def restore_last_finite_blocking(self, entry: ModelEntry) -> str | None:
        """Put the newest stored version with finite weights back into the live model (after a
        diverged job); its version, or None when none could be restored."""
        for v in reversed(self.store.versions(entry.name)):
            try:
                params, optimizer_state = self.store.load_version(entry.name, v["version"])
            except MMADError:
                continue
            if not params_finite(params):
                continue
            try:
                entry.put_all(params, optimizer_state)
            except ModelNotReady:
                return None
            return v["version"]
        return None

    def _versions_changed(self, entry: ModelEntry) -> None:
        """Re-read the listing after a new version (the store may have dropped the oldest, see
        ``keep_versions``) and free the pinned copies of versions it no longer lists."""
        entry.versions = self.store.versions(entry.name)
        listed = {v["version"] for v in entry.versions}
        entry.loaded_version = entry.versions[-1]["version"]  # what the live weights were saved as
        entry.damaged = {v: why for v, why in entry.damaged.items() if v in listed}
        entry.reason = self._damage_note(entry)
        with entry.pinned_lock:
            for version in [v for v in entry.pinned if v not in listed]:
                entry.pinned.pop(version).close()
        self.changed(entry)

    def set_weights_blocking(self, entry: ModelEntry, params: dict[str, np.ndarray], version: str | None = None,
                             keep_versions: int | None = None) -> dict[str, Any]:
        """``params`` as a new version (numbered ``version``, else the next) and the live weights;
        ``keep_versions``: the versions kept (default the model's config)."""
        params = check_params(entry.spec, params)  # refuses NaN/Inf too
        with entry.checkpoint_lock:
            with entry.lock:
                if entry.live is None:
                    raise ModelNotReady(entry.name)
                optimizer_state = entry.live.get_optimizer_state()
                step = entry.live.step_count
            # the store first: a refused write (full disk, replaced model) changes nothing served
            version = self.store.add_version(
                entry.name, params, optimizer_state, step, entry.incarnation,
                entry.config.keep_versions if keep_versions is None else keep_versions, version)
            entry.put_all(params)
            self._versions_changed(entry)
            return version

    async def checkpoint(self, entry: ModelEntry) -> dict[str, Any]:
        """:meth:`checkpoint_blocking` on a compute thread."""
        return await self.run(self.checkpoint_blocking, entry)

    async def set_weights(self, entry: ModelEntry, params: dict[str, np.ndarray]) -> dict[str, Any]:
        """:meth:`set_weights_blocking` on a compute thread."""
        return await self.run(self.set_weights_blocking, entry, params)

    async def stored_weights(self, name: str, version: str) -> bytes:
        """The safetensors file of a stored version of model ``name``."""
        self.get(name)
        return await self.run(self.store.weights_bytes, name, self.check_version(name, version))

    async def live_weights(self, entry: ModelEntry) -> tuple[bytes, int]:
        """(the live weights as safetensors, their step count): one consistent snapshot, taken
        under the model's lock between optimizer steps."""

        def snapshot() -> tuple[bytes, int]:
            with entry.lock:  # serialised under it too: a backend's parameters may be its own arrays
                if entry.live is None:
                    raise ModelNotReady(entry.name)
                return tensors_to_bytes(entry.live.get_params()), entry.live.step_count

        return await self.run(snapshot)

    def served_models(self) -> list[ServedModel]:
        """The ready models as serving workers compile and follow them."""
        models = []
        for name, entry in list(self.models.items()):
            live = entry.live  # read once: an unload may clear it meanwhile
            if live is None:  # a worker passes its requests to the primary, which says why
                continue
            models.append(ServedModel(name, entry.incarnation, entry.generation, entry.spec.to_json(),
                                      entry.config.model_dump(), [r.device for r in entry.replicas], live.variant,
                                      self.latest_version(name)))
        return models

    def forward_pinned(self, entry: ModelEntry, version: str, x: np.ndarray, out: np.ndarray,
                       check_finite: bool = False) -> np.ndarray:
        """Forward through an immutable stored version (compiled copy cached per version) into ``out``."""
        with entry.pinned_lock:
            live = entry.live  # read once: an unload may close it at any moment
            if live is None:  # unloaded meanwhile: its pinned copies were freed, do not compile one
                raise ModelNotReady(entry.name)
            compiled = entry.pinned.get(version)
            if compiled is None:
                try:
                    params, _ = self.store.load_version(entry.name, version, optimizer=False)
                except StoreDamaged as exc:  # found now: said in the model's reason from here on
                    entry.damaged[version] = str(exc)
                    entry.reason = self._damage_note(entry)
                    raise
                # the live model's variant: a pinned version computes as the live one does
                compiled = self._compile(entry.spec, live.device_index, live.variant)
                compiled.set_params(params)
                entry.pinned[version] = compiled
                while len(entry.pinned) > PINNED_CACHE_SIZE:
                    entry.pinned.popitem(last=False)[1].close()
            entry.pinned.move_to_end(version)
            compiled.forward_to_host(x, out, self.forward_pool, check_finite)  # under the lock: eviction closes copies
        return out


def _reason(exc: BaseException) -> str:
    """A load failure in the user's terms: mmad's own message, else the error's kind without paths."""
    if isinstance(exc, MMADError):
        return str(exc)
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {exc.strerror or 'cannot be read'}"
    return f"{type(exc).__name__}: {exc}"
