"""Prometheus metrics (one registry per app, so several apps can live in one process).

mmad's own families are labelled with ``model`` and ``backend`` (``backend`` is
``<name>:<variant>``). Samples per second is the rate of ``mmad_inference_samples_total`` or
``mmad_training_samples_total``; the last training job's throughput is also a gauge.

Triton's families (docs/metrics.md has the table: ``nv_X`` is ``mmad_X`` here) are labelled
with ``model`` and ``version`` and written at scrape time by :class:`ModelCollector` from
counters kept per model entry, so only models the daemon has get series, and a deleted or
replaced model's series go with it. Which device served what: per replica of each model
(:class:`DeviceCollector`, labels ``model`` and ``device``). GPU utilisation, memory and power
come from NVML at scrape time (:class:`GpuCollector`), and are absent where there is no NVML.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger("mmad.engine.metrics")

LABELS = ("model", "backend")
# the ``model`` label of requests naming no model the daemon has (not a valid model name, so
# it cannot collide with one): one series for all of them, however many names clients invent
UNKNOWN_MODEL = "(unknown)"
SECONDS_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
ROW_BUCKETS = tuple(float(2 ** i) for i in range(0, 21, 2))


# families that describe the whole daemon or its training (the primary's alone): a serving
# worker's are not added to the primary's (``Metrics.samples``)
DAEMON_WIDE = ("mmad_models_loaded", "mmad_dataset_resident_bytes", "mmad_training_", "mmad_gpu_")


class _Families:
    """A registry stand-in for ``generate_latest``: families already collected."""

    def __init__(self, families) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


class Metrics:
    """``process``: this serving process's number (``mmad serve --workers``; 0: the primary);
    ``gpu``: NVML's families (read once per daemon, by the primary)."""

    def __init__(self, process: int = 0, gpu: bool = True) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.process_infers = Counter("mmad_process_infer_requests",
                                      "infer requests each serving process answered itself (mmad serve --workers; "
                                      "0 is the primary)", ("process",), registry=r).labels(str(process))
        self.process_connections = Gauge("mmad_process_connections",
                                         "HTTP connections each serving process holds open now (mmad serve --workers; "
                                         "0 is the primary)", ("process",), registry=r).labels(str(process))
        self.requests = Counter("mmad_requests", "HTTP requests per model endpoint",
                                LABELS + ("endpoint",), registry=r)
        self.failures = Counter("mmad_request_failures", "requests answered with an error",
                                LABELS + ("endpoint", "status"), registry=r)
        self.queue_seconds = Histogram("mmad_queue_seconds", "time an infer request waited for its batch",
                                       LABELS, buckets=SECONDS_BUCKETS, registry=r)
        self.compute_seconds = Histogram("mmad_compute_seconds", "time of one batched forward launch",
                                         LABELS, buckets=SECONDS_BUCKETS, registry=r)
        self.batch_rows = Histogram("mmad_batch_rows", "rows per executed batch", LABELS,
                                    buckets=ROW_BUCKETS, registry=r)
        self.batch_requests = Histogram("mmad_batch_requests", "requests merged into one batch", LABELS,
                                        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.inference_samples = Counter("mmad_inference_samples", "rows inferred", LABELS, registry=r)
        self.training_steps = Counter("mmad_training_steps", "optimizer steps taken", LABELS, registry=r)
        self.training_samples = Counter("mmad_training_samples", "rows trained on (rows x steps)",
                                        LABELS, registry=r)
        self.training_samples_per_s = Gauge("mmad_training_samples_per_second",
                                            "throughput of the latest training progress report", LABELS,
                                            registry=r)
        self.models_loaded = Gauge("mmad_models_loaded", "models loaded and ready", registry=r)
        self.dataset_bytes = Gauge("mmad_dataset_resident_bytes",
                                   "bytes of datasets the model's backend holds for training (device memory "
                                   "where it trains from the device)", LABELS, registry=r)

        self.inference = ModelCollector()
        r.register(self.inference)
        self.devices = DeviceCollector()
        r.register(self.devices)
        if gpu:
            r.register(GpuCollector())
        # (model, backend) -> its queue-time histogram: observed once per infer request, where
        # prometheus_client's labels() costs a lock and the labels' checks each time (series are
        # never removed, so a child once made stays the series' own)
        self._queue_children: dict[tuple[str, str], Any] = {}

    def queue_histogram(self, model: str, backend: str) -> Any:
        child = self._queue_children.get((model, backend))
        if child is None:
            child = self._queue_children[(model, backend)] = self.queue_seconds.labels(model, backend)
        return child

    def track(self, models: Callable[[], dict[str, Any]]) -> None:
        """Where the daemon's models are (name -> entry), read at every scrape."""
        self.inference.track(models)
        self.devices.track(models)

    def samples(self) -> list[list[Any]]:
        """This process's samples that add up across serving processes, as JSON rows
        ``[family, type, help, sample, labels, value]`` (a worker's, for the primary's ``render``)."""
        rows = []
        for family in self.registry.collect():
            if family.name.startswith(DAEMON_WIDE):
                continue
            for sample in family.samples:
                if not sample.name.endswith("_created"):  # a time, not a count
                    rows.append([family.name, family.type, family.documentation, sample.name, sample.labels,
                                 sample.value])
        return rows

    def render(self, others: list[list[list[Any]]] = ()) -> tuple[bytes, str]:
        """The Prometheus text of this process, with the serving workers' ``samples()`` added:
        a series both have is summed (counters, histogram buckets, queue gauges), one only a
        worker has is added as it is."""
        if not others:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        families = {family.name: family for family in self.registry.collect()}
        where = {(s.name, tuple(sorted(s.labels.items()))): (family, i)
                 for family in families.values() for i, s in enumerate(family.samples)}
        for name, kind, documentation, sample, labels, value in (row for rows in others for row in rows):
            family = families.get(name)
            if family is None:
                family = families[name] = Metric(name, documentation, kind)
            key = (sample, tuple(sorted(labels.items())))
            if key in where:
                held, i = where[key]
                held.samples[i] = held.samples[i]._replace(value=held.samples[i].value + value)
            else:
                family.add_sample(sample, labels, value)
                where[key] = (family, len(family.samples) - 1)
        return generate_latest(_Families(families.values())), CONTENT_TYPE_LATEST


# The labels of Triton's per-model families, in order; the model's name comes first, the rest
# is ``SeriesCounters``' key (``series_key``). A further label (the device of a replica) is
# added here and in ``series_key``, and nowhere else.
SERIES_LABELS = ("model", "version")


def series_key(version: str) -> tuple[str, ...]:
    return (version,)


@dataclass
class SeriesCounters:
    """Triton's cumulative per-model-version counters (nanoseconds; written as microseconds)."""

    request_success: int = 0
    request_failure: int = 0
    count: int = 0  # rows inferred
    exec_count: int = 0  # batches executed
    request_duration: int = 0
    queue_duration: int = 0
    compute_input_duration: int = 0
    compute_infer_duration: int = 0
    compute_output_duration: int = 0


# (family, SeriesCounters field, help, nanoseconds to microseconds)
_COUNTER_FAMILIES = (
    ("mmad_inference_request_success", "request_success",
     "successful inference requests (a request of n rows counts 1); Triton: nv_inference_request_success", False),
    ("mmad_inference_request_failure", "request_failure",
     "failed inference requests that reached an existing model version; Triton: nv_inference_request_failure",
     False),
    ("mmad_inference_count", "count", "rows inferred (a batch of n counts n); Triton: nv_inference_count", False),
    ("mmad_inference_exec_count", "exec_count",
     "batch executions (rows / executions is the mean batch); Triton: nv_inference_exec_count", False),
    ("mmad_inference_request_duration_us", "request_duration",
     "cumulative end-to-end time of successful requests; Triton: nv_inference_request_duration_us", True),
    ("mmad_inference_queue_duration_us", "queue_duration",
     "cumulative time requests waited in the batcher's queue; Triton: nv_inference_queue_duration_us", True),
    ("mmad_inference_compute_input_duration_us", "compute_input_duration",
     "cumulative time reading and checking inputs; Triton: nv_inference_compute_input_duration_us", True),
    ("mmad_inference_compute_infer_duration_us", "compute_infer_duration",
     "cumulative time of the forward that served each request (its batch's); "
     "Triton: nv_inference_compute_infer_duration_us", True),
    ("mmad_inference_compute_output_duration_us", "compute_output_duration",
     "cumulative time encoding outputs; Triton: nv_inference_compute_output_duration_us", True),
)
assert {f[1] for f in _COUNTER_FAMILIES} == {f.name for f in fields(SeriesCounters)}


def live_version(entry: Any) -> str:
    """The version unpinned requests are labelled with: the newest the store acknowledged."""
    return entry.versions[-1]["version"] if entry.versions else ""


class ModelCollector:
    """Triton's per-model families, from counters kept per model entry.

    Recorded only once a request has reached an existing model and version (the daemon's
    routes look them up first), and written only for the entries ``models()`` still holds:
    a client's made-up names never get a series, and a deleted or replaced model's counters
    are dropped at the next scrape (as Triton's go with an unloaded model). Every ready
    model's live version is written even before its first request, as Triton does.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # model name -> (the entry counted, label values after the model -> counters)
        self._series: dict[str, tuple[Any, dict[tuple[str, ...], SeriesCounters]]] = {}
        self._models: Callable[[], dict[str, Any]] = dict

    def track(self, models: Callable[[], dict[str, Any]]) -> None:
        """Where the daemon's models are (name -> entry), read at every scrape."""
        self._models = models

    def _counters(self, entry: Any, version: str | None) -> SeriesCounters:
        """Under the lock: the counters of ``entry`` at ``version`` (None: its live version)."""
        held = self._series.get(entry.name)
        if held is None or held[0] is not entry:  # first use, or the name now holds a new model
            held = self._series[entry.name] = (entry, {})
        key = series_key(live_version(entry) if version is None else version)
        counters = held[1].get(key)
        if counters is None:
            counters = held[1][key] = SeriesCounters()
        return counters

    def request_succeeded(self, entry: Any, version: str | None, request_ns: int, queue_ns: int,
                          input_ns: int, infer_ns: int, output_ns: int) -> None:
        with self._lock:
            c = self._counters(entry, version)
            c.request_success += 1
            c.request_duration += request_ns
            c.queue_duration += queue_ns
            c.compute_input_duration += input_ns
            c.compute_infer_duration += infer_ns
            c.compute_output_duration += output_ns

    def request_failed(self, entry: Any, version: str | None) -> None:
        with self._lock:
            self._counters(entry, version).request_failure += 1

    def batch_executed(self, entry: Any, version: str | None, rows: int) -> None:
        with self._lock:
            c = self._counters(entry, version)
            c.exec_count += 1
            c.count += rows

    def collect(self) -> Iterator[Metric]:
        models = self._models()
        rows: list[tuple[tuple[str, ...], SeriesCounters]] = []
        pending: list[tuple[tuple[str, ...], int]] = []
        with self._lock:
            for name in [n for n, (entry, _) in self._series.items() if models.get(n) is not entry]:
                del self._series[name]
            for name, entry in sorted(models.items()):
                counted = dict(self._series[name][1]) if name in self._series else {}
                if entry.ready:
                    live = series_key(live_version(entry))
                    counted.setdefault(live, SeriesCounters())  # a copy: a scrape records nothing
                    batcher = entry.batcher
                    pending.append(((name, *live), batcher.queued if batcher is not None else 0))
                rows.extend(((name, *key), replace(c)) for key, c in sorted(counted.items()))
        for family, attr, doc, in_us in _COUNTER_FAMILIES:
            metric = CounterMetricFamily(family, doc, labels=SERIES_LABELS)
            for labels, c in rows:
                value = getattr(c, attr)
                metric.add_metric(labels, value / 1000 if in_us else value)
            yield metric
        metric = GaugeMetricFamily("mmad_inference_pending_request_count",
                                   "requests waiting in the batcher's queue; Triton: nv_inference_pending_request_count",
                                   labels=SERIES_LABELS)
        for labels, n in pending:
            metric.add_metric(labels, n)
        yield metric


class DeviceCollector:
    """Where each model runs: per replica (labels ``model``, ``device``: the backend's device
    index, as ``GET /v2/devices`` and the model's ``devices`` list give it) the batches and rows
    it ran and the forwards running or waiting on it now; written at scrape time for the models
    the daemon has, so a model's series go with it."""

    def __init__(self) -> None:
        self._models: Callable[[], dict[str, Any]] = dict

    def track(self, models: Callable[[], dict[str, Any]]) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        labels = ("model", "device")
        batches = CounterMetricFamily("mmad_replica_batches", "batches a model's replica on a device ran", labels=labels)
        rows = CounterMetricFamily("mmad_replica_rows", "rows a model's replica on a device inferred", labels=labels)
        in_flight = GaugeMetricFamily("mmad_replica_in_flight", "forwards running or waiting on a model's replica",
                                      labels=labels)
        for name, entry in sorted(self._models().items()):
            for replica in entry.replicas:
                if replica.model is None:
                    continue
                key = (name, str(replica.device))
                batches.add_metric(key, replica.batches)
                rows.add_metric(key, replica.rows)
                in_flight.add_metric(key, replica.in_flight)
        yield from (batches, rows, in_flight)


class GpuCollector:
    """Triton's GPU families from NVML (``nvidia-ml-py``), read at each scrape, labelled by
    ``gpu_uuid`` as Triton's are. Without the NVML library or a driver it writes nothing (once
    logged); a quantity a GPU does not report (power on some boards) is left out for that GPU."""

    def __init__(self, nvml: Any = None) -> None:
        self._nvml = nvml  # the pynvml module once initialised; injected by tests
        self._tried = nvml is not None
        self._lock = threading.Lock()

    def _init(self) -> Any:
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    import pynvml

                    pynvml.nvmlInit()
                    self._nvml = pynvml
                except ImportError:
                    log.info("no GPU metrics: nvidia-ml-py is not installed")
                except Exception as exc:  # noqa: BLE001 - pynvml.NVMLError: no driver, no GPU
                    log.info("no GPU metrics: NVML is not available (%s)", exc)
            return self._nvml

    def collect(self) -> Iterator[Metric]:
        nvml = self._init()
        if nvml is None:
            return
        util = GaugeMetricFamily("mmad_gpu_utilization", "GPU utilisation (0.0 - 1.0) over NVML's last sample "
                                 "period; Triton: nv_gpu_utilization", labels=("gpu_uuid",))
        total = GaugeMetricFamily("mmad_gpu_memory_total_bytes", "GPU memory; Triton: nv_gpu_memory_total_bytes",
                                  labels=("gpu_uuid",))
        used = GaugeMetricFamily("mmad_gpu_memory_used_bytes", "GPU memory in use (all processes); "
                                 "Triton: nv_gpu_memory_used_bytes", labels=("gpu_uuid",))
        power = GaugeMetricFamily("mmad_gpu_power_usage", "GPU power draw in watts; Triton: nv_gpu_power_usage",
                                  labels=("gpu_uuid",))
        limit = GaugeMetricFamily("mmad_gpu_power_limit", "GPU power limit in watts; Triton: nv_gpu_power_limit",
                                  labels=("gpu_uuid",))
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            log.warning("GPU metrics: NVML cannot count the GPUs: %s", exc)
            return
        for i in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                uuid = nvml.nvmlDeviceGetUUID(handle)
            except nvml.NVMLError:  # a GPU that fell off the bus: the others are still reported
                continue
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            readings = (
                (util, lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100),
                (total, lambda: nvml.nvmlDeviceGetMemoryInfo(handle).total),
                (used, lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used),
                (power, lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000),  # NVML: milliwatts
                (limit, lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000),
            )
            for family, read in readings:
                try:
                    family.add_metric((uuid,), read())
                except nvml.NVMLError:  # not supported by this GPU
                    pass
        yield from (util, total, used, power, limit)
