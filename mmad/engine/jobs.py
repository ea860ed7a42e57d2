"""Training jobs: optimizer steps over an uploaded dataset, with progress, cancel and checkpoints.

A job is an asyncio task that trains from the dataset's copy held by the model's backend (on
the device where the backend trains there: ``DatasetCache.on_device``). Mini-batches follow
each epoch's order (``numerics.epoch_rows``: every row once per epoch, drawn on the device),
and the job runs in chunks of about ``CHUNK_S`` seconds of steps on the training threads: a
chunk's steps are submitted without a host round trip between them, and its losses come back
once at its end. Between chunks inference gets the model's lock, cancel is seen, and progress
is published. Every ``checkpoint_every`` steps, at the end, on cancel and on shutdown it
writes a version; a version is announced (``checkpoint`` event, ``versions`` list) only once the
store has acknowledged it. Progress goes to Server-Sent Events subscribers, throttled to a few
reports per second; every chunk's losses go to the job's bounded history (``LossHistory``). A
step that diverges (NaN/Inf loss or weights) ends the job ``failed`` with the reason, and the
live model goes back to the newest finite stored version: a diverged state is never
checkpointed nor left serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import secrets
import time
import uuid
from typing import AsyncIterator

from mmad.backends.contract import Dataset
from mmad.backends.parallel import shard_positions, split_batch
from mmad.engine.api import JobEvent, JobRequest, JobStatus
from mmad.errors import ConflictError, Diverged, InvalidInput, MMADError, ModelNotFound
from mmad.engine.loss_history import LossHistory
from mmad.engine.registry import Registry

log = logging.getLogger("mmad.engine.jobs")

PROGRESS_INTERVAL_S = 0.2
CHUNK_S = 0.1  # training between two looks from the host (losses, progress, cancel)
FINISHED = ("done", "cancelled", "failed")
KEEP_FINISHED_JOBS = 256  # statuses of finished jobs stay queryable until this many newer ones finish


class Job:
    def __init__(self, model: str, request: JobRequest, checkpoint_every: int, rows: int, devices: list[int]):
        self.id = uuid.uuid4().hex
        self.model = model
        self.request = request
        self.checkpoint_every = checkpoint_every
        self.rows = rows
        self.devices = devices  # the devices training runs on: several for a data-parallel job
        seed = request.seed if request.seed is not None else secrets.randbits(32)
        self.positions = shard_positions(seed, len(devices))  # each shard's order; the first is the job's
        self.position = self.positions[0]
        self.state = "queued"
        self.step = 0
        self.loss: float | None = None
        self.history = LossHistory()
        self.samples_per_s = 0.0
        self.versions: list[str] = []
        self.error: str | None = None
        self.created = time.time()
        self.cancel_reason: str | None = None
        self.task: asyncio.Task | None = None
        self._subscribers: set[asyncio.Queue] = set()

    @property
    def reported_loss(self) -> float | None:
        """The last loss, None where it was NaN or Inf (JSON has neither)."""
        return self.loss if self.loss is None or math.isfinite(self.loss) else None

    def status(self) -> JobStatus:
        return JobStatus(self.id, self.model, self.state, self.step, self.request.steps, self.request.batch_size,
                         self.checkpoint_every, self.request.dataset, self.rows, self.position.seed,
                         self.position.epoch, list(self.devices), self.reported_loss, self.samples_per_s,
                         list(self.versions), self.error)

    def progress(self) -> JobEvent:
        return JobEvent("progress", {"step": self.step, "steps": self.request.steps, "epoch": self.position.epoch,
                                     "loss": self.reported_loss, "samples_per_s": self.samples_per_s})

    def final(self) -> JobEvent:
        return JobEvent(self.state, dataclasses.asdict(self.status()))

    def publish(self, event: JobEvent | None) -> None:
        for queue in self._subscribers:
            queue.put_nowait(event)

    async def events(self) -> AsyncIterator[JobEvent]:
        """Current progress first (its final state when it has ended), then live events until the
        job ends."""
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            if self.state in FINISHED:
                yield self.final()
                return
            yield self.progress()
            while (event := await queue.get()) is not None:  # None: the job ended, its final event came before
                yield event
        finally:
            self._subscribers.discard(queue)


class JobManager:
    def __init__(self, registry: Registry):
        self.registry = registry
        self.jobs: dict[str, Job] = {}

    def get(self, model: str, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None or job.model != model:
            raise ModelNotFound(f"model {model!r} has no job {job_id!r}")
        return job

    async def start(self, model: str, request: JobRequest) -> Job:
        entry = self.registry.get_ready(model)
        if entry.busy_job:
            raise ConflictError(f"model {model!r} is already training (job {entry.busy_job})")
        parallel = len(entry.replicas) > 1 if request.data_parallel is None else request.data_parallel
        if parallel:
            if len(entry.replicas) < 2:
                raise InvalidInput(f"data_parallel needs a model with replicas on several devices; model {model!r} "
                                   f"has one (config.replicas or config.device place more)")
            if request.batch_size < len(entry.replicas):
                raise InvalidInput(f"batch_size {request.batch_size} is smaller than the {len(entry.replicas)} "
                                   f"replicas it is split over")
            data = await self.registry.datasets.shards(entry, request.dataset)
            rows = sum(d.rows for d in data)
            for part, shard in zip(split_batch(request.batch_size, len(data)), data):
                if part > shard.rows:
                    raise InvalidInput(f"batch_size {request.batch_size} is larger than the dataset ({rows} rows)")
            if entry.parallel is None:
                entry.parallel = await self.registry.run(self.registry.backend.data_parallel,
                                                         [r.model for r in entry.replicas])
        else:
            data = [await self.registry.datasets.on_device(entry, request.dataset)]
            rows = data[0].rows
            if request.batch_size > rows:
                raise InvalidInput(f"batch_size {request.batch_size} is larger than the dataset ({rows} rows)")
        if self.registry.get_ready(model) is not entry:  # replaced while the dataset loaded
            raise ConflictError(f"model {model!r} changed while its dataset was being loaded; start the job again")
        if entry.busy_job:
            raise ConflictError(f"model {model!r} is already training (job {entry.busy_job})")
        job = Job(model, request, request.checkpoint_every or self.registry.settings.checkpoint_every, rows,
                  entry.devices if parallel else entry.devices[:1])
        entry.busy_job = job.id
        self._forget_old_jobs()
        self.jobs[job.id] = job
        job.task = asyncio.get_running_loop().create_task(self._run(job, data), name=f"job:{job.id}")
        return job

    def _forget_old_jobs(self) -> None:
        finished = [j for j in self.jobs.values() if j.state in FINISHED]
        for job in finished[:max(0, len(finished) - KEEP_FINISHED_JOBS)]:
            del self.jobs[job.id]

    def cancel(self, model: str, job_id: str, reason: str = "cancelled by request") -> Job:
        job = self.get(model, job_id)
        if job.state not in FINISHED and job.cancel_reason is None:
            job.cancel_reason = reason
        return job

    def stop_all(self) -> list[Job]:
        """Ask every running job to stop at its next chunk's end (after a final checkpoint): the
        daemon is shutting down. Returns them."""
        running = [j for j in self.jobs.values() if j.state not in FINISHED]
        for job in running:
            job.cancel_reason = job.cancel_reason or "the server is shutting down"
        return running

    async def shutdown(self) -> None:
        """Stop every running job after a final checkpoint (graceful shutdown)."""
        for job in self.stop_all():
            if job.task is not None:
                await asyncio.shield(job.task)

    async def _checkpoint(self, job: Job, entry) -> None:
        version = (await self.registry.run(self.registry.checkpoint_blocking, entry))["version"]
        job.versions.append(version)
        job.publish(JobEvent("checkpoint", {"version": version, "step": job.step}))

    async def _run(self, job: Job, data: list[Dataset]) -> None:
        """Train in chunks on ``data``: the dataset held by the primary replica, or one shard per
        replica (data-parallel)."""
        entry = self.registry.get(job.model)
        batches = split_batch(job.request.batch_size, len(data))
        labels = (job.model, self.registry.backend_label)
        metrics = self.registry.metrics
        batch, total = job.request.batch_size, job.request.steps
        last_checkpoint_step = 0
        per_step_s: float | None = None
        job.state = "running"
        started = last_report = time.perf_counter()
        try:
            while job.step < total and job.cancel_reason is None:
                n = 1 if per_step_s is None else max(1, int(CHUNK_S / max(per_step_s, 1e-7)))
                n = min(n, total - job.step, job.checkpoint_every - job.step % job.checkpoint_every)
                chunk_started = time.perf_counter()
                if len(data) > 1:
                    losses, _ = await self.registry.run_training(entry.train_parallel_epochs, data, batches, n,
                                                                 job.positions, job.step, total)
                else:
                    losses, _ = await self.registry.run_training(entry.train_live_epochs, data[0], batch, n,
                                                                 job.position, job.step, total)
                now = time.perf_counter()
                per_step_s = (now - chunk_started) / n
                job.step += n
                job.loss = float(losses[-1])
                job.history.add(job.step, losses)
                metrics.training_steps.labels(*labels).inc(n)
                metrics.training_samples.labels(*labels).inc(n * batch)
                job.samples_per_s = job.step * batch / max(now - started, 1e-9)
                if now - last_report >= PROGRESS_INTERVAL_S or job.step == total:
                    last_report = now
                    metrics.training_samples_per_s.labels(*labels).set(job.samples_per_s)
                    job.publish(job.progress())
                if job.step % job.checkpoint_every == 0 or job.step == total:
                    await self._checkpoint(job, entry)
                    last_checkpoint_step = job.step
            if job.step > last_checkpoint_step:  # cancelled between checkpoints: keep the work
                await self._checkpoint(job, entry)
            job.state = "done" if job.cancel_reason is None else "cancelled"
            job.error = job.cancel_reason
        except Diverged as exc:
            if exc.losses is not None:  # the curve ends at the step that diverged (its weights were put back)
                job.history.add(exc.step, exc.losses)
            try:
                restored = await self.registry.run(self.registry.restore_last_finite_blocking, entry)
            except MMADError as restore_exc:
                restored, why = None, f" ({restore_exc})"
            else:
                why = ""
            job.state = "failed"
            job.error = (f"{exc}; the live weights are those of version {restored}" if restored
                         else f"{exc}; no finite stored version could be restored{why}")
            log.warning("training job %s: %s", job.id, job.error)
        except MMADError as exc:
            job.state, job.error = "failed", str(exc)
        except Exception as exc:  # a bug: report it on the job instead of losing it in the task
            log.exception("training job %s failed", job.id)
            job.state, job.error = "failed", f"internal error: {type(exc).__name__}: {exc}"
        finally:
            entry.busy_job = None
            job.publish(job.final())
            job.publish(None)
