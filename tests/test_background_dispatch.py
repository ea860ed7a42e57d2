"""The daemon serving a model at once while its variants are measured in the background, then
swapping the measured one in (mmad.engine.background_dispatch): a real daemon on loopback whose
backend is the fake dispatching one (tests/fake_variants.py, started by tests/fake_daemon.py),
driven by mmad_client. The measurement is held at its first call until the test opens a gate
file, so what happens during it is seen, not raced."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import DaemonProcess
from mmad_client import Client

from mmad.backends.cpu import CpuModel
from mmad.spec import MLPSpec

TESTS = Path(__file__).resolve().parent
SPEC_DOC = {"n_input_dims": 6, "n_output_dims": 3, "network": {"n_neurons": 16, "n_hidden_layers": 2},
            "optimizer": {"otype": "Adam", "learning_rate": 1e-2}, "seed": 11}
SPEC = MLPSpec.from_json(SPEC_DOC)
# the first is the quick one; "fast" wins the measurement (forward 0.5/0.5 + train 0.5/0.5)
VARIANTS = {"quick": [1.0, 1.0, "ok"], "fast": [0.5, 0.5, "ok"], "slow": [2.0, 2.0, "ok"]}


class FakeDaemon:
    def __init__(self, tmp_path: Path, variants: dict):
        self.gate = tmp_path / "gate"
        self.timed_log = tmp_path / "timed.log"
        self.env = {"MMAD_BACKEND": "fake", "MMAD_PROBE": "fake", "FAKE_VARIANTS": json.dumps(variants),
                    "FAKE_GATE": str(self.gate), "FAKE_TIMED_LOG": str(self.timed_log),
                    "MMAD_CACHE_DIR": str(tmp_path / "cache"),
                    "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
        self.store = tmp_path / "store"
        self.proc: DaemonProcess | None = None

    def start(self) -> Client:
        self.proc = DaemonProcess(self.store, "--no-demo", env=self.env,
                                  main=[sys.executable, str(TESTS / "fake_daemon.py")]).start()
        return Client(self.proc.url)

    def meta(self, name: str = "m") -> dict:
        return httpx.get(f"{self.proc.url}/v2/models/{name}", timeout=10).json()

    def wait_decided(self, name: str = "m", timeout_s: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            meta = self.meta(name)
            if meta["dispatch"]["state"] not in ("measuring in background", "swapping in the chosen variant"):
                return meta
            time.sleep(0.05)
        raise AssertionError(f"still measuring after {timeout_s} s:\n{self.proc.log()[-2000:]}")

    def timed_calls(self) -> int:
        return len(self.timed_log.read_text().splitlines()) if self.timed_log.exists() else 0

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


@pytest.fixture
def fake_daemon(tmp_path):
    daemons: list[FakeDaemon] = []

    def make(variants=VARIANTS) -> FakeDaemon:
        daemons.append(FakeDaemon(tmp_path, variants))
        return daemons[-1]

    yield make
    for d in daemons:
        if d.proc is not None:
            d.proc.kill()


def _data(rows: int = 256):
    rng = np.random.default_rng(42)
    return (rng.standard_normal((rows, SPEC.n_input_dims), dtype=np.float32),
            rng.standard_normal((rows, SPEC.n_output_dims), dtype=np.float32))


def test_a_model_answers_during_the_measurement_and_the_swap_keeps_its_trained_state(fake_daemon):
    daemon = fake_daemon()
    client = daemon.start()
    meta = client.create_model("m", SPEC_DOC)
    assert meta["variant"] == "quick"
    doc = daemon.meta()["dispatch"]
    assert doc["state"] == "measuring in background" and doc["variant"] == "quick"
    assert doc["reason"] == "serving quick while the 2 other variants are measured: compiles at once"
    x, y = _data()
    reference = CpuModel(SPEC, "fp32")  # the same seed: the daemon's initial weights
    # inference and training answer while the measurement is held mid-way, on the quick variant
    np.testing.assert_allclose(client.infer("m", x), reference.forward(x), rtol=1e-5, atol=1e-6)
    losses = client.train_step("m", x, y, steps=5)
    np.testing.assert_allclose(losses, reference.train_step(x, y, 5), rtol=1e-5)
    assert daemon.meta()["variant"] == "quick" and daemon.meta()["dispatch"]["state"] == "measuring in background"
    before = client.get_weights("m")

    daemon.gate.touch()
    meta = daemon.wait_decided()
    assert meta["variant"] == "fast" and meta["dispatch"]["state"] == "decided"
    assert meta["dispatch"]["variant"] == "fast" and meta["dispatch"]["served_while_measuring"] == "quick"
    assert [v["variant"] for v in meta["dispatch"]["variants"]] == ["quick", "fast", "slow"]
    after = client.get_weights("m")
    assert all(np.array_equal(after[k], v) for k, v in before.items())  # the trained weights, not the seed's
    # the optimizer state came along too (Adam's moments and step count): two more steps on the
    # new variant land where two more on the reference do, and not where a fresh optimizer would
    fresh = CpuModel(SPEC, "fp32")
    fresh.set_params(reference.get_params())
    np.testing.assert_allclose(client.train_step("m", x, y, steps=2), reference.train_step(x, y, 2), rtol=1e-5)
    got, want, reset = client.get_weights("m"), reference.get_params(), (fresh.train_step(x, y, 2), fresh.get_params())[1]
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7)
    assert max(float(np.abs(reset[k] - want[k]).max()) for k in want) > 1e-4  # what the check tells apart
    assert httpx.get(f"{daemon.proc.url}/v2/devices").json()["dispatch"][0]["variant"] == "fast"
    daemon.stop()


def test_a_failed_background_measurement_keeps_the_quick_variant_and_says_why(fake_daemon):
    daemon = fake_daemon({"quick": [1.0, 1.0, "fails when measured"], "broken": [0.1, 0.1, "compile fails"]})
    daemon.gate.touch()
    client = daemon.start()
    client.create_model("m", SPEC_DOC)
    meta = daemon.wait_decided()
    assert meta["variant"] == "quick" and meta["dispatch"]["state"] == "failed"
    error = meta["dispatch"]["error"]
    assert error.startswith("the background measurement failed: no variant of the fake backend runs this model "
                            "correctly: quick: failed to run: RuntimeError: the device was lost; broken: failed to "
                            "compile: the broken kernels: ptxas error: too many resources requested")
    assert error.endswith("; quick goes on serving")
    x, y = _data(64)
    np.testing.assert_allclose(client.infer("m", x), CpuModel(SPEC, "fp32").forward(x), rtol=1e-5, atol=1e-6)
    assert np.isfinite(client.train_step("m", x, y, steps=2)).all()
    daemon.stop()


def test_a_restart_with_a_warm_cache_serves_the_chosen_variant_without_measuring(fake_daemon):
    daemon = fake_daemon()
    daemon.gate.touch()
    client = daemon.start()
    client.create_model("m", SPEC_DOC)
    assert daemon.wait_decided()["variant"] == "fast"
    x, y = _data(64)
    client.train_step("m", x, y, steps=3)
    client.checkpoint("m")  # what a restart loads
    weights = client.get_weights("m")
    timed = daemon.timed_calls()
    assert timed > 0
    daemon.stop()

    client = daemon.start()  # the same store and kernel cache
    meta = daemon.meta()
    assert meta["variant"] == "fast" and meta["dispatch"]["state"] == "decided" and meta["dispatch"]["from_cache"]
    assert "served_while_measuring" not in meta["dispatch"]
    assert daemon.timed_calls() == timed  # nothing was measured again
    restored = client.get_weights("m")
    assert all(np.array_equal(restored[k], v) for k, v in weights.items())
    daemon.stop()


def test_a_measurement_that_ends_before_it_is_watched_still_swaps_and_the_put_answers(fake_daemon):
    """The measurement ended before the registry followed it (FAKE_WATCH_LATE): its callback
    comes on the event loop, which the swap needs, and held it (the PUT never answered)."""
    daemon = fake_daemon()
    daemon.env["FAKE_WATCH_LATE"] = "1"
    daemon.gate.touch()
    client = daemon.start()
    client.create_model("m", SPEC_DOC)
    meta = daemon.wait_decided()
    assert meta["variant"] == "fast" and meta["dispatch"]["state"] == "decided", meta["dispatch"]
    x, _ = _data(16)
    np.testing.assert_allclose(client.infer("m", x), CpuModel(SPEC, "fp32").forward(x), rtol=1e-5, atol=1e-6)
    daemon.stop()


def test_a_model_replaced_while_measuring_is_not_swapped_into_its_successor(fake_daemon):
    daemon = fake_daemon()
    client = daemon.start()
    client.create_model("m", SPEC_DOC)
    other = {**SPEC_DOC, "network": {"n_neurons": 32, "n_hidden_layers": 1}}
    client.create_model("m", other)  # replaced while the first is held mid-measurement
    daemon.gate.touch()
    meta = daemon.wait_decided()
    assert meta["variant"] == "fast" and meta["dispatch"]["state"] == "decided"
    assert meta["spec"]["network"]["n_neurons"] == 32
    weights = client.get_weights("m")
    assert weights["W0"].shape == (32, 6)  # the successor's own weights: nothing of the first came in
    # the first measurement stopped before its next variant: its first variant's two timings, then
    # the successor's three variants' (one measurement at a time on the device's queue)
    assert daemon.timed_calls() == 2 + 6
    daemon.stop()


def test_cache_warm_leaves_the_decision_a_daemon_then_serves_at_once(fake_daemon, tmp_path, monkeypatch, capsys):
    """``mmad cache warm`` (what the image and scripts/start.sh run) measures the model before any
    daemon does: a daemon on that cache serves it on the chosen variant at once, measuring nothing."""
    from mmad import backends, cli

    daemon = fake_daemon()
    config = tmp_path / "model.json"
    config.write_text(json.dumps(SPEC_DOC))
    for key, value in daemon.env.items():
        if key != "PYTHONPATH":
            monkeypatch.setenv(key, value)
    monkeypatch.setitem(backends.BACKENDS, "fake", ("fake_variants", "FakeDispatchBackend"))
    daemon.gate.touch()
    assert cli.main(["cache", "warm", "--backend", "fake", "--config", str(config)]) == 0
    assert capsys.readouterr().out.startswith("model: fake:fast in ")
    timed = daemon.timed_calls()
    assert timed == 6  # three variants, forward and training each

    client = daemon.start()
    meta = client.create_model("m", SPEC_DOC)
    assert meta["variant"] == "fast"
    dispatch = daemon.meta()["dispatch"]
    assert dispatch["state"] == "decided" and dispatch["from_cache"] and daemon.timed_calls() == timed
    daemon.stop()


def test_every_replica_swaps_to_the_measured_variant(fake_daemon):
    """A model on two devices: each replica measured on its device's queue (the second finds the
    first's decision), both swapped together, training and inference going on across the swap."""
    daemon = fake_daemon()
    client = daemon.start()
    client.create_model("m", SPEC_DOC, config={"replicas": 2})
    report = httpx.get(f"{daemon.proc.url}/v2/devices").json()["dispatch"]
    assert [(r["device_index"], r["state"], r["variant"]) for r in report] == [
        (0, "measuring in background", "quick"), (1, "measuring in background", "quick")]
    x, y = _data(128)
    reference = CpuModel(SPEC, "fp32")
    np.testing.assert_allclose(client.train_step("m", x, y, steps=3), reference.train_step(x, y, 3), rtol=1e-5)
    daemon.gate.touch()
    meta = daemon.wait_decided()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the replicas' decisions end one after the other
        report = httpx.get(f"{daemon.proc.url}/v2/devices").json()["dispatch"]
        if all(r["state"] == "decided" for r in report):
            break
        time.sleep(0.05)
    assert [(r["device_index"], r["variant"]) for r in report] == [(0, "fast"), (1, "fast")]
    assert sorted(r["from_cache"] for r in report) == [False, True]  # measured once: the other queue waited for it
    assert meta["variant"] == "fast" and daemon.timed_calls() == 6
    for _ in range(4):  # the forwards go to both replicas in turn: each holds the trained weights
        np.testing.assert_allclose(client.infer("m", x), reference.forward(x), rtol=1e-5, atol=1e-6)
    daemon.stop()


def test_a_training_job_goes_on_across_the_swap(fake_daemon):
    """A job started on the quick variant during the measurement trains on after the swap, on the
    chosen variant, with the dataset copy it holds: its steps keep counting up, none is lost."""
    daemon = fake_daemon()
    client = daemon.start()
    client.create_model("m", SPEC_DOC)
    x, y = _data(4096)
    dataset = client.upload_dataset("m", x, y, progress=False)
    job = client.start_job("m", dataset, steps=10_000_000, batch_size=64)
    deadline = time.monotonic() + 30
    while client.job_status("m", job)["step"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.meta()["variant"] == "quick" and client.job_status("m", job)["state"] == "running"
    daemon.gate.touch()
    assert daemon.wait_decided()["variant"] == "fast"
    at_swap = client.job_status("m", job)
    assert at_swap["state"] == "running"
    deadline = time.monotonic() + 30
    while client.job_status("m", job)["step"] <= at_swap["step"] and time.monotonic() < deadline:
        time.sleep(0.05)
    later = client.job_status("m", job)
    assert later["state"] == "running" and later["step"] > at_swap["step"]
    client.cancel_job("m", job)
    deadline = time.monotonic() + 30
    while client.job_status("m", job)["state"] == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    final = client.job_status("m", job)
    assert final["state"] == "cancelled" and daemon.meta()["step"] == final["step"] >= later["step"]
    daemon.stop()
