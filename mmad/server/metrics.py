"""Prometheus metrics (one registry per app, so several apps can live in one process).

Every series is labelled with ``model`` and ``backend`` (``backend`` is ``<name>:<variant>``).
Samples per second is the rate of ``mmad_inference_samples_total`` or
``mmad_training_samples_total``; the last training job's throughput is also a gauge.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LABELS = ("model", "backend")
# the ``model`` label of requests naming no model the daemon has (not a valid model name, so
# it cannot collide with one): one series for all of them, however many names clients invent
UNKNOWN_MODEL = "(unknown)"
SECONDS_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
ROW_BUCKETS = tuple(float(2 ** i) for i in range(0, 21, 2))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
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

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
