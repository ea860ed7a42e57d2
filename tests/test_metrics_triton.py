"""Triton's metric families at ``/metrics`` (docs/metrics.md), parsed with prometheus_client's own
parser after real requests to a real daemon: success and failure counts, rows and executions,
cumulative durations, pending requests, all labelled by model and version; series only for
models that exist; GPU families from NVML, absent without it.
"""

from __future__ import annotations

import concurrent.futures
import time
import types

import httpx
import numpy as np
import pytest
from conftest import DaemonProcess
from prometheus_client.parser import text_string_to_metric_families
from test_server_api import binary_infer, create

from mmad.engine.metrics import GpuCollector

COUNTERS = ("mmad_inference_request_success", "mmad_inference_request_failure", "mmad_inference_count",
            "mmad_inference_exec_count", "mmad_inference_request_duration_us", "mmad_inference_queue_duration_us",
            "mmad_inference_compute_input_duration_us", "mmad_inference_compute_infer_duration_us",
            "mmad_inference_compute_output_duration_us")
PENDING = "mmad_inference_pending_request_count"


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    proc = DaemonProcess(tmp_path_factory.mktemp("metrics") / "store").start()
    with httpx.Client(base_url=proc.url, timeout=30.0) as client:
        yield client
    proc.stop()


def scrape(http: httpx.Client) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """family -> {sorted labels: value} for the samples that carry the family's value (a
    counter's ``_total``, a gauge's own name)."""
    r = http.get("/metrics")
    assert r.status_code == 200
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(r.text):
        wanted = family.name + "_total" if family.type == "counter" else family.name
        out[family.name] = {tuple(sorted(s.labels.items())): s.value for s in family.samples if s.name == wanted}
        assert family.type in ("counter", "gauge", "histogram"), family
    return out


def at(families, family: str, model: str, version: str) -> float:
    return families[family][(("model", model), ("version", version))]


def test_triton_families_after_success_and_failure(http):
    create(http, "tri")
    before = scrape(http)
    for family in COUNTERS:  # a ready model's live version has its series before any request
        assert at(before, family, "tri", "1") == 0, family
    assert at(before, PENDING, "tri", "1") == 0

    x = np.random.default_rng(1).uniform(-1, 1, (4, 5)).astype(np.float32)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:  # concurrent: the batcher may merge them
        codes = list(pool.map(lambda _: binary_infer(http, "tri", x).status_code, range(6)))
    assert codes == [200] * 6
    assert binary_infer(http, "tri", x[:3], version="1").status_code == 200  # pinned: runs alone
    assert binary_infer(http, "tri", np.full((2, 5), np.nan, np.float32)).status_code == 400
    assert binary_infer(http, "tri", np.ones((2, 3), np.float32)).status_code == 400  # wrong width

    m = scrape(http)
    assert at(m, "mmad_inference_request_success", "tri", "1") == 7
    assert at(m, "mmad_inference_request_failure", "tri", "1") == 2
    assert at(m, "mmad_inference_count", "tri", "1") == 6 * 4 + 3
    executions = at(m, "mmad_inference_exec_count", "tri", "1")
    assert 2 <= executions <= 7  # the pinned one alone, the six in one to six batches
    stats = http.get("/v2/models/tri/stats").json()["model_stats"][0]  # Triton's statistics extension
    assert executions == stats["execution_count"]
    request_us = at(m, "mmad_inference_request_duration_us", "tri", "1")
    parts = sum(at(m, f, "tri", "1") for f in ("mmad_inference_queue_duration_us",
                                                "mmad_inference_compute_input_duration_us",
                                                "mmad_inference_compute_output_duration_us"))
    assert 0 < parts <= request_us  # the parts of a request are within its end-to-end time
    assert request_us == pytest.approx(stats["inference_stats"]["success"]["ns"] / 1000, rel=1e-6)
    assert at(m, "mmad_inference_compute_infer_duration_us", "tri", "1") > 0
    assert at(m, PENDING, "tri", "1") == 0  # nothing waits once the requests are answered
    assert at(m, "mmad_inference_request_success", "demo", "1") == 0  # other models: their own series

    # a new version: unpinned requests are counted under it, the old version keeps its counts
    assert http.post("/v2/models/tri/versions").json()["version"] == "2"
    assert binary_infer(http, "tri", x).status_code == 200
    m2 = scrape(http)
    assert at(m2, "mmad_inference_request_success", "tri", "2") == 1
    assert at(m2, "mmad_inference_count", "tri", "2") == 4
    assert at(m2, "mmad_inference_request_success", "tri", "1") == 7
    assert at(m2, PENDING, "tri", "2") == 0 and (("model", "tri"), ("version", "1")) not in m2[PENDING]

    # a deleted model's series go with it
    assert http.delete("/v2/models/tri").status_code == 200
    gone = scrape(http)
    assert not any(dict(labels)["model"] == "tri" for f in (*COUNTERS, PENDING) for labels in gone[f])


def test_pending_counts_requests_waiting_in_the_queue(http):
    create(http, "slow", config={"max_queue_delay_us": 3_000_000, "max_batch_rows": 1 << 20})
    x = np.ones((1, 5), np.float32)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(binary_infer, httpx.Client(base_url=str(http.base_url), timeout=30), "slow", x)
                   for _ in range(3)]
        waiting, deadline = 0, time.monotonic() + 2.5  # the batch waits 3 s for more rows
        while waiting < 3 and time.monotonic() < deadline:
            waiting = at(scrape(http), PENDING, "slow", "1")
        assert waiting == 3
        assert [f.result().status_code for f in futures] == [200] * 3
    assert at(scrape(http), PENDING, "slow", "1") == 0


def test_unknown_names_and_versions_add_no_series(http):
    body = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 5], "data": [0, 0, 0, 0, 0]}]}
    create(http, "known")

    def series() -> set:
        return {(f, labels) for f, samples in scrape(http).items() for labels in samples}

    # the first of each adds the one series they share in mmad's own families: model="(unknown)",
    # and a 404 of model "known" (status is a label there)
    assert http.post("/v2/models/made-up/infer", json=body).status_code == 404
    assert http.post("/v2/models/known/versions/99/infer", json=body).status_code == 404
    before = series()
    for i in range(1000):
        assert http.post(f"/v2/models/made-up-{i}/infer", json=body).status_code == 404
    for i in range(50):  # a model that exists, versions that do not
        assert http.post(f"/v2/models/known/versions/{i + 7}/infer", json=body).status_code == 404
    after = series()
    assert after == before, sorted(after - before)[:5]
    assert not any("made-up" in str(labels) for _, labels in after)
    failures = scrape(http)["mmad_inference_request_failure"]
    assert failures[(("model", "known"), ("version", "1"))] == 0  # never reached a version it has


def test_no_gpu_families_without_nvml(http):
    text = http.get("/metrics").text
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - the case under test: no driver here
        assert "mmad_gpu_" not in text, f"NVML failed ({exc}) yet GPU families were written"
    else:
        pytest.skip("NVML works on this machine: test_gpu_families_from_nvml covers the GPU case")


class FakeNvml(types.SimpleNamespace):
    """The part of pynvml the collector calls, for two GPUs; the second reports no power."""

    class NVMLError(Exception):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}"

    def nvmlDeviceGetUtilizationRates(self, h):
        return types.SimpleNamespace(gpu=37 + h, memory=5)

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(total=80 << 30, used=(h + 1) << 30, free=0)

    def nvmlDeviceGetPowerUsage(self, h):
        if h == 1:
            raise self.NVMLError("Not Supported")
        return 123_456  # milliwatts

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 700_000


def test_gpu_families_from_nvml():
    """The collector's mapping from NVML's units to Triton's (fractions, bytes, watts), and a
    quantity one GPU does not report left out for that GPU only."""
    families = {m.name: {s.labels["gpu_uuid"]: s.value for s in m.samples}
                for m in GpuCollector(FakeNvml()).collect()}
    assert families["mmad_gpu_utilization"] == {"GPU-0": 0.37, "GPU-1": 0.38}
    assert families["mmad_gpu_memory_total_bytes"] == {"GPU-0": 80 << 30, "GPU-1": 80 << 30}
    assert families["mmad_gpu_memory_used_bytes"] == {"GPU-0": 1 << 30, "GPU-1": 2 << 30}
    assert families["mmad_gpu_power_usage"] == {"GPU-0": 123.456}
    assert families["mmad_gpu_power_limit"] == {"GPU-0": 700.0, "GPU-1": 700.0}
