"""Several devices on one host: placement, replicas, the batcher spreading batches over them,
data-parallel training. No GPU needed: the cpu backend's virtual devices (``MMAD_CPU_DEVICES``)
are real devices to the daemon, each model replica a separate compiled model."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from safetensors.numpy import save as st_save

from mmad.backends.contract import Dataset
from mmad.backends.cpu import CpuBackend, CpuModel
from mmad.backends.numerics import epoch_rows
from mmad.backends.parallel import HostDataParallel, shard_bounds, shard_positions, shard_seed, split_batch
from mmad.errors import InvalidInput
from mmad.server import Settings, create_app
from mmad.engine.batcher import Batcher, BatchLimits
from mmad.engine.placement import DeviceLoad, place
from mmad.spec import MLPSpec

N_IN, N_OUT = 3, 2
SPEC = {"n_input_dims": N_IN, "n_output_dims": N_OUT, "network": {"n_neurons": 16, "n_hidden_layers": 1},
        "optimizer": {"otype": "Adam", "learning_rate": 1e-2}, "precision": "fp32", "seed": 5}


def fresh_rng() -> np.random.Generator:
    return np.random.default_rng(time.time_ns() % 2**32)


def data(rows: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x = rng.uniform(-1, 1, (rows, N_IN)).astype(np.float32)
    return x, np.tanh(2 * x[:, :N_OUT]).astype(np.float32)


# -- placement (pure) ------------------------------------------------------------------------------
def test_unpinned_replicas_go_to_the_least_used_devices_then_the_most_free_memory():
    devices = [DeviceLoad(0, 10 << 30, 2), DeviceLoad(1, 30 << 30, 0), DeviceLoad(2, 50 << 30, 0),
               DeviceLoad(3, None, 1)]
    assert place(devices, None, None) == [2]
    assert place(devices, None, 2) == [2, 1]
    assert place(devices, None, 3) == [2, 1, 3]
    assert place([DeviceLoad(0, None, 0), DeviceLoad(1, None, 0)], None, None) == [0]  # ties: lowest index


def test_pinned_devices_are_kept_in_order_and_checked():
    devices = [DeviceLoad(i, None, 0) for i in range(3)]
    assert place(devices, 2, None) == [2]
    assert place(devices, [2, 0], None) == [2, 0]
    assert place(devices, [1, 2], 2) == [1, 2]
    for pinned, replicas, words in ((5, None, "device 5 does not exist; this host has devices 0 to 2"),
                                    ([0, 0], None, "one replica of a model"),
                                    ([0, 1], 3, "must match the devices listed"),
                                    ([], None, "non-empty list"),
                                    (None, 4, "4 replicas need 4 devices")):
        with pytest.raises(InvalidInput, match=words):
            place(devices, pinned, replicas)
    with pytest.raises(InvalidInput, match="this host has device 0$"):
        place([DeviceLoad(0, None, 0)], None, 2)


def test_shards_and_batch_parts_cover_everything_once():
    for rows, parts in ((10, 3), (7, 7), (1 << 20, 2), (5, 1)):
        bounds = shard_bounds(rows, parts)
        assert bounds[0][0] == 0 and bounds[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        sizes = [b - a for a, b in bounds]
        assert max(sizes) - min(sizes) <= 1 and sum(split_batch(rows, parts)) == rows
    assert shard_seed(1234, 0) == 1234 and len({shard_seed(1234, r) for r in range(8)}) == 8


# -- the batcher runs one batch per replica at once -----------------------------------------------
@pytest.mark.parametrize("concurrency", [1, 2, 3])
def test_batcher_runs_up_to_one_batch_per_replica_at_once(concurrency):
    running, peak, lock = [0], [0], threading.Lock()

    def run(x: np.ndarray, out: np.ndarray, check_finite: bool) -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        out[:] = 2 * x[:, :1]
        with lock:
            running[0] -= 1

    async def main() -> list[np.ndarray]:
        with ThreadPoolExecutor(4) as pool:
            # one request a batch: max_batch_rows is one request's rows
            batcher = Batcher("m", run, 1, pool, BatchLimits(4, 0, 100), concurrency=concurrency)
            xs = [np.full((4, 2), float(i), np.float32) for i in range(6)]
            results = await asyncio.gather(*(batcher.submit(x) for x in xs))
            await batcher.stop()
            return [r.output for r in results], xs

    outputs, xs = asyncio.run(main())
    assert peak[0] == concurrency
    for out, x in zip(outputs, xs):
        np.testing.assert_array_equal(out, 2 * x[:, :1])


# -- data-parallel training on the host (the reference of the device implementations) -----------
def test_host_data_parallel_follows_one_device_on_the_same_global_batches():
    """Two replicas, each with its shard and half of each batch, end with identical weights, and
    their loss curve and weights equal one model trained on the union of their parts of each
    batch (the same global batches)."""
    spec = MLPSpec.from_json(SPEC)
    rng = fresh_rng()
    x, y = data(1001, rng)
    seed, steps, batch = int(rng.integers(2**32)), 30, 96
    bounds = shard_bounds(len(x), 2)
    replicas = [CpuBackend(devices=2).compile(spec, device=d) for d in (0, 1)]
    shards = [Dataset(x[a:b], y[a:b], b - a, 0, on_device=False) for a, b in bounds]
    positions = shard_positions(seed, 2)
    losses = HostDataParallel(replicas).train_epochs(shards, split_batch(batch, 2), steps, positions)

    single = CpuModel(spec)
    reference = []
    ref_positions = shard_positions(seed, 2)
    for _ in range(steps):
        rows = []
        for (a, b), part, position in zip(bounds, split_batch(batch, 2), ref_positions):
            rows.append(a + epoch_rows(position.seed, position.epoch, b - a, position.cursor, part))
            position.advance(b - a, part)
        rows = np.concatenate(rows)
        reference.append(single.train_step(x[rows], y[rows])[0])
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    assert [(p.epoch, p.cursor) for p in positions] == [(p.epoch, p.cursor) for p in ref_positions]
    params = [r.get_params() for r in replicas]
    for name, value in params[0].items():
        assert np.array_equal(value, params[1][name]), name
        np.testing.assert_allclose(value, single.get_params()[name], rtol=1e-4, atol=1e-6)
    assert replicas[0].step_count == replicas[1].step_count == steps


# -- the daemon on three virtual devices ------------------------------------------------------------
@pytest.fixture
def three_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("MMAD_CPU_DEVICES", "3")
    app = create_app(Settings(store_dir=tmp_path / "store", backend="cpu", probe="cpu", demo=False,
                              compute_threads=4))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, app.state.runtime


def test_models_are_placed_pinned_and_reported(three_devices):
    client, rt = three_devices
    assert client.put("/v2/models/a", json={"spec": SPEC, "config": {"replicas": 2}}).status_code == 201
    assert client.put("/v2/models/b", json={"spec": SPEC}).status_code == 201
    assert client.put("/v2/models/c", json={"spec": SPEC, "config": {"device": [2, 0]}}).status_code == 201
    assert client.get("/v2/models/a").json()["devices"] == [0, 1]
    assert client.get("/v2/models/b").json()["devices"] == [2]  # the device with no replica yet
    meta = client.get("/v2/models/c").json()
    assert meta["devices"] == [2, 0] and meta["config"]["device"] == [2, 0]
    report = client.get("/v2/devices").json()["devices"]
    assert [d["index"] for d in report] == [0, 1, 2]
    assert [d["models"] for d in report] == [["a", "c"], ["a"], ["b", "c"]]
    assert all("virtual device" in d["name"] and d["in_flight"] == 0 for d in report)
    for config, words in (({"device": 7}, "device 7 does not exist; this host has devices 0 to 2"),
                          ({"replicas": 4}, "4 replicas need 4 devices"),
                          ({"device": [1, 1]}, "one replica of a model")):
        r = client.put("/v2/models/bad", json={"spec": SPEC, "config": config})
        assert r.status_code == 400 and words in r.json()["error"], r.text
    assert client.get("/v2/models/bad").status_code == 404


def test_replicas_share_the_batches_and_serve_the_same_weights(three_devices):
    client, rt = three_devices
    client.put("/v2/models/r", json={"spec": SPEC, "config": {"replicas": 3, "max_batch_rows": 64}})
    entry = rt.registry.get("r")
    served = {r.device: 0 for r in entry.replicas}
    lock = threading.Lock()
    for replica in entry.replicas:
        forward = replica.model.forward_to_host

        def counting(x, out, pool, check_finite, forward=forward, device=replica.device):
            with lock:
                served[device] += 1
            time.sleep(0.02)  # long enough for the batches to overlap
            forward(x, out, pool, check_finite)
        replica.model.forward_to_host = counting

    rng = fresh_rng()
    new = {k: rng.normal(0, 0.5, v.shape).astype(np.float32) for k, v in entry.live.get_params().items()}
    assert client.put("/v2/models/r/weights", content=st_save(new)).status_code == 200
    oracle = CpuModel(MLPSpec.from_json(SPEC), "float64")
    oracle.set_params(new)
    xs = [rng.uniform(-1, 1, (64, N_IN)).astype(np.float32) for _ in range(24)]

    def infer(x: np.ndarray) -> np.ndarray:
        body = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
        r = client.post("/v2/models/r/infer", json=body)
        assert r.status_code == 200, r.text
        return np.array(r.json()["outputs"][0]["data"], np.float32).reshape(len(x), N_OUT)

    with ThreadPoolExecutor(12) as pool:
        outs = list(pool.map(infer, xs))
    for x, out in zip(xs, outs):
        np.testing.assert_allclose(out, oracle.forward(x), rtol=1e-4, atol=1e-5)
    assert all(n > 0 for n in served.values()), served  # every replica served some batches
    # the metrics say which device served what
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    batches = {s.labels["device"]: s.value for s in families["mmad_replica_batches"].samples
               if s.labels["model"] == "r" and s.name.endswith("_total")}
    rows = sum(s.value for s in families["mmad_replica_rows"].samples
               if s.labels["model"] == "r" and s.name.endswith("_total"))
    assert batches == {str(d): float(n) for d, n in served.items()} and rows == 24 * 64


def wait_job(client: TestClient, model: str, job: str) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = client.get(f"/v2/models/{model}/jobs/{job}").json()
        if status["state"] in ("done", "failed", "cancelled"):
            return status
        time.sleep(0.05)
    raise AssertionError(f"job {job} did not finish: {status}")


def test_a_data_parallel_job_keeps_the_replicas_identical_and_follows_one_device(three_devices):
    client, rt = three_devices
    client.put("/v2/models/dp", json={"spec": SPEC, "config": {"device": [1, 2]}})
    rng = fresh_rng()
    x, y = data(800, rng)
    dataset = client.post("/v2/models/dp/datasets", content=st_save({"x": x, "y": y})).json()["dataset"]
    seed, steps, batch = int(rng.integers(2**32)), 40, 64
    r = client.post("/v2/models/dp/jobs", json={"dataset": dataset, "steps": steps, "batch_size": batch,
                                                "seed": seed})
    assert r.status_code == 202, r.text
    status = wait_job(client, "dp", r.json()["job"])
    assert status["state"] == "done" and status["devices"] == [1, 2] and status["step"] == steps, status
    entry = rt.registry.get("dp")
    params = [rep.model.get_params() for rep in entry.replicas]
    assert all(np.array_equal(params[0][k], params[1][k]) for k in params[0])
    assert [rep.model.step_count for rep in entry.replicas] == [steps, steps]

    single = CpuModel(MLPSpec.from_json(SPEC))
    bounds, positions = shard_bounds(len(x), 2), shard_positions(seed, 2)
    for _ in range(steps):
        rows = []
        for (a, b), part, position in zip(bounds, split_batch(batch, 2), positions):
            rows.append(a + epoch_rows(position.seed, position.epoch, b - a, position.cursor, part))
            position.advance(b - a, part)
        loss = single.train_step(x[np.concatenate(rows)], y[np.concatenate(rows)])[0]
    assert status["loss"] == pytest.approx(float(loss), rel=1e-4)
    for k, value in single.get_params().items():
        np.testing.assert_allclose(params[0][k], value, rtol=1e-4, atol=1e-6)

    # a job that asks for data parallelism on a one-replica model is told why not
    client.put("/v2/models/one", json={"spec": SPEC})
    dataset = client.post("/v2/models/one/datasets", content=st_save({"x": x, "y": y})).json()["dataset"]
    r = client.post("/v2/models/one/jobs", json={"dataset": dataset, "steps": 1, "batch_size": 8,
                                                 "data_parallel": True})
    assert r.status_code == 400 and "replicas on several devices" in r.json()["error"]


def test_training_one_replica_brings_the_others_level(three_devices):
    client, rt = three_devices
    client.put("/v2/models/t", json={"spec": SPEC, "config": {"replicas": 2}})
    rng = fresh_rng()
    x, y = data(256, rng)
    r = client.post("/v2/models/t/jobs", json={
        "dataset": client.post("/v2/models/t/datasets", content=st_save({"x": x, "y": y})).json()["dataset"],
        "steps": 12, "batch_size": 64, "data_parallel": False})
    status = wait_job(client, "t", r.json()["job"])
    assert status["state"] == "done" and status["devices"] == [0], status
    entry = rt.registry.get("t")
    first, second = (rep.model for rep in entry.replicas)
    assert first.step_count == second.step_count == 12
    assert all(np.array_equal(v, second.get_params()[k]) for k, v in first.get_params().items())


def test_one_request_at_a_time_takes_the_replicas_in_turn():
    """Equally idle replicas are taken in turn: a serving process with one client (mmad serve
    --workers) would otherwise run every request on the first device."""
    from mmad.engine.registry import ModelConfig, ModelEntry, Replica

    class Counting:
        def forward_to_host(self, x, out, pool, check_finite):
            out[...] = 0

    entry = ModelEntry("m", MLPSpec.from_json({"n_input_dims": 2, "n_output_dims": 1}), ModelConfig())
    entry.replicas = [Replica(d, Counting()) for d in range(3)]
    for _ in range(9):
        entry.forward_live(np.zeros((4, 2), np.float32), np.empty((4, 1), np.float32), None)
    assert [r.batches for r in entry.replicas] == [3, 3, 3] and [r.rows for r in entry.replicas] == [12, 12, 12]
