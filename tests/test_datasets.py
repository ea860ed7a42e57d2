"""Datasets uploaded in chunks: the store's chunk files, the streamed upload routes and
their limits, the copies held by the model's backend (``registry.datasets``), the client's split.

HTTP tests run against a real daemon on loopback (cpu backend, a 256 KiB body cap and a 1 MiB
dataset limit, so that the limits are reached with small data); the held copies are checked in
process (TestClient runs the real lifespan) where the registry can be reached.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import DaemonProcess
from fastapi.testclient import TestClient
from safetensors.numpy import load_file, save as st_save
from test_error_wording import NUMPY_WORDS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))

from mmad_client import AsyncClient, Client  # noqa: E402

from mmad.errors import DeviceMemoryFull  # noqa: E402
from mmad.server import Settings, create_app  # noqa: E402
from mmad.server.errors import status_for  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BODY_CAP = 256 * 1024
DATASET_CAP = 1 << 20
N_IN, N_OUT = 5, 4
SPEC = {"n_input_dims": N_IN, "n_output_dims": N_OUT, "network": {"n_neurons": 32, "n_hidden_layers": 2},
        "optimizer": {"otype": "Adam", "learning_rate": 1e-2}, "precision": "fp32", "seed": 3}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    store = tmp_path_factory.mktemp("datasets") / "store"
    proc = DaemonProcess(store, "--max-body-bytes", str(BODY_CAP), "--max-dataset-bytes", str(DATASET_CAP),
                         "--no-demo").start()
    yield proc
    proc.stop()


@pytest.fixture
def http(daemon):
    with httpx.Client(base_url=daemon.url, timeout=60.0) as client:
        yield client


def create(http: httpx.Client, name: str) -> None:
    r = http.put(f"/v2/models/{name}", json={"spec": SPEC})
    assert r.status_code in (200, 201), r.text


def data(rows: int, seed: int, x_dtype=np.float32, y_dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (rows, N_IN)).astype(x_dtype)
    y = np.tanh(2 * x[:, :N_OUT].astype(np.float32)).astype(y_dtype)
    return x, y


def chunk_files(daemon: DaemonProcess, model: str, dataset: str) -> list[Path]:
    return sorted((daemon.store / "datasets" / model / dataset).glob("*.safetensors"))


def incoming(daemon: DaemonProcess) -> list[Path]:
    folder = daemon.store / "datasets" / ".incoming"
    return sorted(folder.iterdir()) if folder.exists() else []


def upload(http: httpx.Client, model: str, x: np.ndarray, y: np.ndarray, splits: list[int]) -> tuple[str, dict]:
    """Create a dataset from the rows before ``splits[0]`` and append the rest at the splits."""
    bounds = [0, *splits, len(x)]
    r = http.post(f"/v2/models/{model}/datasets", content=st_save({"x": x[:bounds[1]], "y": y[:bounds[1]]}))
    assert r.status_code == 200, r.text
    dataset, doc = r.json()["dataset"], r.json()
    for a, b in zip(bounds[1:-1], bounds[2:]):
        r = http.post(f"/v2/models/{model}/datasets/{dataset}/chunks", content=st_save({"x": x[a:b], "y": y[a:b]}))
        assert r.status_code == 200, r.text
        doc = r.json()
    return dataset, doc


def read_back(daemon: DaemonProcess, model: str, dataset: str) -> tuple[np.ndarray, np.ndarray]:
    chunks = [load_file(p) for p in chunk_files(daemon, model, dataset)]
    return np.concatenate([c["x"] for c in chunks]), np.concatenate([c["y"] for c in chunks])


def wait_job(http: httpx.Client, model: str, job: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status = http.get(f"/v2/models/{model}/jobs/{job}").json()
        if status["state"] in ("done", "cancelled", "failed"):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.05)


# -- chunked upload over HTTP ----------------------------------------------------------------------
def test_three_chunks_then_a_job_trains_on_them(http, daemon):
    create(http, "chunky")
    x, y = data(1500, seed=int(time.time_ns() % 2**32))
    dataset, doc = upload(http, "chunky", x, y, [400, 1100])
    files = chunk_files(daemon, "chunky", dataset)
    assert [p.name for p in files] == ["00000000.safetensors", "00000001.safetensors", "00000002.safetensors"]
    assert doc == {"dataset": dataset, "rows": 1500, "bytes": sum(p.stat().st_size for p in files), "chunks": 3}
    stored_x, stored_y = read_back(daemon, "chunky", dataset)
    np.testing.assert_array_equal(stored_x, x)  # bit for bit, in order
    np.testing.assert_array_equal(stored_y, y)
    assert incoming(daemon) == []

    before = http.get("/v2/models/chunky/weights").content
    r = http.post("/v2/models/chunky/jobs", json={"dataset": dataset, "steps": 40, "batch_size": 256})
    assert r.status_code == 202, r.text
    status = wait_job(http, "chunky", r.json()["job"])
    assert status["state"] == "done" and status["step"] == 40 and status["versions"], status
    assert http.get("/v2/models/chunky/weights").content != before
    # the trained model fits the whole dataset better than the initial one did
    initial = http.post("/v2/models/chunky/versions/1/infer", json={"inputs": [
        {"name": "INPUT", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}).json()
    trained = http.post("/v2/models/chunky/infer", json={"inputs": [
        {"name": "INPUT", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}).json()

    def mse(doc):
        return float(np.mean((np.asarray(doc["outputs"][0]["data"]).reshape(y.shape) - y) ** 2))
    assert mse(trained) < 0.8 * mse(initial), (mse(trained), mse(initial))


def test_a_chunk_of_other_types_is_refused_in_words(http, daemon):
    create(http, "typed")
    x, y = data(300, seed=int(time.time_ns() % 2**32))
    dataset, _ = upload(http, "typed", x, y, [])
    for body, words in [
        ({"x": x.astype(np.float16), "y": y}, "x is float16 in this chunk but float32 in the dataset's first chunk"),
        ({"x": x, "y": y.astype(np.float16)}, "y is float16 in this chunk but float32 in the dataset's first chunk"),
        ({"x": x[:, :3].copy(), "y": y}, "dataset x must have 5 columns (the model's n_input_dims); this chunk's x has 3"),
        ({"x": x, "y": y.astype(np.float64)}, "dataset y must be float32 or float16 numbers"),
        ({"x": x, "y": y[:-1].copy()}, "dataset x has 300 rows and y 299"),
        ({"x": x}, "holds exactly the tensors x and y"),
    ]:
        r = http.post(f"/v2/models/typed/datasets/{dataset}/chunks", content=st_save(body))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert words in error and not NUMPY_WORDS.search(error), error
    bad = x.copy()
    bad[123, 2] = np.nan
    r = http.post(f"/v2/models/typed/datasets/{dataset}/chunks", content=st_save({"x": bad, "y": y}))
    assert r.status_code == 400 and "dataset x holds NaN or Inf (row 123 of this chunk)" in r.json()["error"], r.text
    r = http.post(f"/v2/models/typed/datasets/{dataset}/chunks", content=b"not safetensors at all")
    assert r.status_code == 400 and "not a safetensors file" in r.json()["error"], r.text
    assert len(chunk_files(daemon, "typed", dataset)) == 1  # nothing was added
    assert http.get(f"/v2/models/typed/datasets/{dataset}").json()["chunks"] == 1
    assert incoming(daemon) == []


def test_a_dataset_over_its_limit_is_413_before_anything_is_written(http, daemon):
    create(http, "bounded")
    x, y = data(5000, seed=int(time.time_ns() % 2**32))  # 36 bytes a row: 180 KB a chunk of 5000
    dataset, doc = upload(http, "bounded", x, y, [])
    bodies = 1 + (DATASET_CAP - doc["bytes"]) // len(st_save({"x": x, "y": y}))  # chunks that still fit: 5
    for _ in range(bodies - 1):
        r = http.post(f"/v2/models/bounded/datasets/{dataset}/chunks", content=st_save({"x": x, "y": y}))
        assert r.status_code == 200, r.text
    held = http.get(f"/v2/models/bounded/datasets/{dataset}").json()
    files = [(p.name, p.stat().st_size) for p in chunk_files(daemon, "bounded", dataset)]
    body = st_save({"x": x, "y": y})
    would = held["bytes"] + len(body)
    assert would > DATASET_CAP and f"{would / 2**20:.1f}" == "1.0"  # the sizes in bytes tell them apart
    words = (f"the dataset would hold 1.0 MiB ({would} bytes); this daemon's limit (--max-dataset-bytes) is "
             f"1.0 MiB ({DATASET_CAP} bytes)")
    r = http.post(f"/v2/models/bounded/datasets/{dataset}/chunks", content=body)  # Content-Length: refused unread
    assert r.status_code == 413 and r.json()["error"] == words, r.text

    def streamed():  # no Content-Length: refused while it streams
        for i in range(0, len(body), 16384):
            yield body[i:i + 16384]
    r = http.post(f"/v2/models/bounded/datasets/{dataset}/chunks", content=streamed())
    assert r.status_code == 413 and "this daemon's limit (--max-dataset-bytes) is 1.0 MiB" in r.json()["error"], r.text
    assert http.get(f"/v2/models/bounded/datasets/{dataset}").json() == held  # chunk count and size unchanged
    assert [(p.name, p.stat().st_size) for p in chunk_files(daemon, "bounded", dataset)] == files
    assert incoming(daemon) == []


def test_a_chunk_over_the_body_cap_is_413_and_nothing_is_written(http, daemon):
    create(http, "capped")
    x, y = data(200, seed=int(time.time_ns() % 2**32))
    dataset, _ = upload(http, "capped", x, y, [])
    big_x, big_y = data(8000, seed=1)  # 288 KB > the 256 KiB cap
    body = st_save({"x": big_x, "y": big_y})
    assert len(body) > BODY_CAP
    r = http.post(f"/v2/models/capped/datasets/{dataset}/chunks", content=body)
    assert r.status_code == 413 and r.json()["error"] == f"the body is {len(body)} bytes; the limit is {BODY_CAP}"

    def streamed():
        for i in range(0, len(body), 32768):
            yield body[i:i + 32768]
    for path in (f"/v2/models/capped/datasets/{dataset}/chunks", "/v2/models/capped/datasets"):
        r = http.post(path, content=streamed())
        assert r.status_code == 413 and r.json()["error"] == f"the body exceeds the limit of {BODY_CAP} bytes", r.text
    assert len(chunk_files(daemon, "capped", dataset)) == 1
    assert [d["dataset"] for d in http.get("/v2/models/capped/datasets").json()["datasets"]] == [dataset]
    assert incoming(daemon) == []


def test_list_get_and_delete(http, daemon):
    create(http, "listed")
    x, y = data(64, seed=int(time.time_ns() % 2**32), x_dtype=np.float16)
    first, _ = upload(http, "listed", x, y, [20])
    second, _ = upload(http, "listed", x[:10], y[:10], [])
    listing = http.get("/v2/models/listed/datasets").json()
    assert listing["max_chunk_bytes"] == BODY_CAP and listing["max_dataset_bytes"] == DATASET_CAP
    by_id = {d["dataset"]: d for d in listing["datasets"]}
    assert set(by_id) == {first, second}
    assert by_id[first] == {"dataset": first, "rows": 64, "chunks": 2, "x_dtype": "float16", "y_dtype": "float32",
                            "bytes": sum(p.stat().st_size for p in chunk_files(daemon, "listed", first)),
                            "on_device": False}
    assert http.get(f"/v2/models/listed/datasets/{second}").json()["rows"] == 10
    r = http.delete(f"/v2/models/listed/datasets/{first}")
    assert r.status_code == 200 and r.json() == {"model_name": "listed", "dataset": first, "deleted": True}
    assert not (daemon.store / "datasets" / "listed" / first).exists()
    assert http.get(f"/v2/models/listed/datasets/{first}").status_code == 404
    assert http.delete(f"/v2/models/listed/datasets/{first}").status_code == 404
    assert http.post(f"/v2/models/listed/datasets/{first}/chunks", content=st_save({"x": x, "y": y})).status_code == 404
    assert [d["dataset"] for d in http.get("/v2/models/listed/datasets").json()["datasets"]] == [second]
    r = http.get("/v2/models/listed/datasets/..%2F..%2Fmodels")
    assert r.status_code in (400, 404)
    r = http.get("/v2/models/listed/datasets/" + "g" * 32)
    assert r.status_code == 400 and "invalid dataset id" in r.json()["error"]
    assert http.get("/v2/models/nosuchmodel/datasets").status_code == 404
    http.delete("/v2/models/listed")  # a model's datasets go with it
    assert not (daemon.store / "datasets" / "listed").exists()


def test_a_dataset_an_earlier_mmad_wrote_as_one_file_still_loads(http, daemon):
    create(http, "legacy")
    x, y = data(700, seed=int(time.time_ns() % 2**32))
    dataset = "0123456789abcdef" * 2
    folder = daemon.store / "datasets" / "legacy"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{dataset}.safetensors").write_bytes(st_save({"x": x[:500], "y": y[:500]}))  # the old layout
    doc = http.get(f"/v2/models/legacy/datasets/{dataset}").json()
    assert doc["rows"] == 500 and doc["chunks"] == 1
    r = http.post("/v2/models/legacy/jobs", json={"dataset": dataset, "steps": 5, "batch_size": 100})
    assert r.status_code == 202, r.text
    assert wait_job(http, "legacy", r.json()["job"])["state"] == "done"
    r = http.post(f"/v2/models/legacy/datasets/{dataset}/chunks", content=st_save({"x": x[500:], "y": y[500:]}))
    assert r.status_code == 200 and r.json()["rows"] == 700 and r.json()["chunks"] == 2, r.text
    assert not (folder / f"{dataset}.safetensors").exists()  # now a directory of chunks
    stored_x, stored_y = read_back(daemon, "legacy", dataset)
    np.testing.assert_array_equal(stored_x, x)
    np.testing.assert_array_equal(stored_y, y)


# -- the client ----------------------------------------------------------------------------------
def test_client_uploads_in_chunks_bit_exact_and_fp16_stays_fp16(daemon):
    rng = np.random.default_rng(int(time.time_ns() % 2**32))
    x = rng.standard_normal((3000, N_IN)).astype(np.float16)
    y = rng.standard_normal((3000, N_OUT))  # float64: sent as float32
    with Client(daemon.url) as client:
        client.create_model("clienty", SPEC)
        dataset = client.upload_dataset("clienty", x, y, chunk_bytes=16 * 1024, progress=False)
        [listed] = client.list_datasets("clienty")
        files = chunk_files(daemon, "clienty", dataset)
        assert listed["dataset"] == dataset and listed["rows"] == 3000 and listed["chunks"] == len(files) > 3
        assert listed["x_dtype"] == "float16" and listed["y_dtype"] == "float32"
        assert all(p.stat().st_size <= 16 * 1024 for p in files)
        stored_x, stored_y = read_back(daemon, "clienty", dataset)
        assert stored_x.dtype == np.float16
        np.testing.assert_array_equal(stored_x.view(np.uint16), x.view(np.uint16))
        np.testing.assert_array_equal(stored_y, y.astype(np.float32))
        # chunk_bytes over the server's body cap: the client keeps to the cap
        dataset = client.upload_dataset("clienty", x, y.astype(np.float32), chunk_bytes=64 << 20)
        assert all(p.stat().st_size <= BODY_CAP for p in chunk_files(daemon, "clienty", dataset))
        client.delete_dataset("clienty", dataset)
        assert [d["dataset"] for d in client.list_datasets("clienty")] == [listed["dataset"]]
        with pytest.raises(ValueError, match=r"the dataset would hold .* its limit \(--max-dataset-bytes\) is 1.0 MiB"):
            client.upload_dataset("clienty", np.zeros((40000, N_IN), np.float32), np.zeros((40000, N_OUT), np.float32))
        assert len(client.list_datasets("clienty")) == 1  # refused before anything was sent


def test_async_client_uploads_in_chunks(daemon):
    rng = np.random.default_rng(int(time.time_ns() % 2**32))
    x = rng.standard_normal((1000, N_IN)).astype(np.float32)
    y = rng.standard_normal((1000, N_OUT)).astype(np.float16)

    async def main():
        async with AsyncClient(daemon.url) as client:
            await client.create_model("asyncy", SPEC)
            dataset = await client.upload_dataset("asyncy", x, y, chunk_bytes=8192)
            return dataset, await client.list_datasets("asyncy")
    dataset, listing = asyncio.run(main())
    assert listing[0]["rows"] == 1000 and listing[0]["chunks"] > 3 and listing[0]["y_dtype"] == "float16"
    stored_x, stored_y = read_back(daemon, "asyncy", dataset)
    np.testing.assert_array_equal(stored_x, x)
    np.testing.assert_array_equal(stored_y.view(np.uint16), y.view(np.uint16))


def test_client_progress_true_without_tqdm_says_what_to_install(daemon, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes "import tqdm" fail
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    x, y = data(100, seed=5)
    with Client(daemon.url) as client:
        client.create_model("noprogress", SPEC)
        with pytest.raises(ImportError, match=r"pip install 'mmad-client\[progress\]'"):
            client.upload_dataset("noprogress", x, y, chunk_bytes=1024, progress=True)
        assert client.list_datasets("noprogress") == []


# -- copies held by the backend (in process) ------------------------------------------------------
@pytest.fixture
def app_client(tmp_path):
    app = create_app(Settings(store_dir=tmp_path / "store", backend="cpu", probe="cpu", demo=False))
    with TestClient(app, raise_server_exceptions=False) as c:
        c.put("/v2/models/held", json={"spec": SPEC}).raise_for_status()
        yield c, app.state.runtime


def test_on_device_builds_once_holds_the_rows_and_goes_with_the_model(app_client):
    client, rt = app_client
    x, y = data(900, seed=int(time.time_ns() % 2**32), x_dtype=np.float16)
    r = client.post("/v2/models/held/datasets", content=st_save({"x": x[:300], "y": y[:300]}))
    dataset = r.json()["dataset"]
    client.post(f"/v2/models/held/datasets/{dataset}/chunks", content=st_save({"x": x[300:], "y": y[300:]}))
    entry = rt.registry.get("held")
    calls = []
    put = entry.live.put_dataset

    def recording(chunks, rows, x_dtype, y_dtype):
        calls.append((rows, np.dtype(x_dtype), np.dtype(y_dtype)))
        time.sleep(0.05)  # the other callers arrive while it builds
        return put(chunks, rows, x_dtype, y_dtype)
    entry.live.put_dataset = recording

    async def three():
        return await asyncio.gather(*(rt.registry.datasets.on_device(entry, dataset) for _ in range(3)))
    held = client.portal.call(three)
    assert calls == [(900, np.dtype(np.float16), np.dtype(np.float32))]  # built once
    assert held[0] is held[1] is held[2] and held[0].rows == 900
    assert held[0].x.dtype == np.float16
    np.testing.assert_array_equal(held[0].x, x)
    np.testing.assert_array_equal(held[0].y, y)
    assert rt.registry.datasets.resident("held") == [dataset]
    assert client.get(f"/v2/models/held/datasets/{dataset}").json()["on_device"] is True
    assert f'mmad_dataset_resident_bytes{{backend="cpu:numpy",model="held"}} {float(held[0].nbytes)}' in \
        client.get("/metrics").text

    # appending drops the copy; the next use holds the new rows
    more_x, more_y = data(100, seed=2, x_dtype=np.float16)
    client.post(f"/v2/models/held/datasets/{dataset}/chunks", content=st_save({"x": more_x, "y": more_y}))
    assert rt.registry.datasets.resident("held") == []
    again = client.portal.call(rt.registry.datasets.on_device, entry, dataset)
    assert again.rows == 1000 and len(calls) == 2
    np.testing.assert_array_equal(again.x[900:], more_x)

    # deleting the model frees its copies; the copy a caller holds stays usable
    assert client.delete("/v2/models/held").status_code == 200
    assert rt.registry.datasets.resident("held") == [] and rt.registry.datasets._held == {}
    assert 'mmad_dataset_resident_bytes{backend="cpu:numpy",model="held"} 0.0' in client.get("/metrics").text
    np.testing.assert_array_equal(again.y[:900], y)


def test_deleting_a_dataset_drops_its_copy(app_client):
    client, rt = app_client
    x, y = data(50, seed=int(time.time_ns() % 2**32))
    dataset = client.post("/v2/models/held/datasets", content=st_save({"x": x, "y": y})).json()["dataset"]
    entry = rt.registry.get("held")
    held = client.portal.call(rt.registry.datasets.on_device, entry, dataset)
    assert rt.registry.datasets.resident("held") == [dataset]
    assert client.delete(f"/v2/models/held/datasets/{dataset}").status_code == 200
    assert rt.registry.datasets.resident("held") == []
    np.testing.assert_array_equal(held.x, x)  # a job holding it trains on
    # unloading the model frees the copies too
    client.post("/v2/models/held/datasets", content=st_save({"x": x, "y": y}))
    other = client.get("/v2/models/held/datasets").json()["datasets"][0]["dataset"]
    client.portal.call(rt.registry.datasets.on_device, entry, other)
    assert client.post("/v2/repository/models/held/unload", json={}).status_code == 200
    assert rt.registry.datasets.resident("held") == []


def test_on_device_refuses_with_507_before_allocating(app_client):
    client, rt = app_client
    x, y = data(4096, seed=int(time.time_ns() % 2**32))
    dataset = client.post("/v2/models/held/datasets", content=st_save({"x": x, "y": y})).json()["dataset"]
    entry = rt.registry.get("held")
    need = entry.live.dataset_bytes(4096, np.float32, np.float32)
    assert need == 4096 * (N_IN + N_OUT) * 4
    calls = []
    entry.live.free_device_bytes = lambda: 100 * 1024
    entry.live.put_dataset = lambda *args: calls.append(args)
    with pytest.raises(DeviceMemoryFull) as info:
        client.portal.call(rt.registry.datasets.on_device, entry, dataset)
    assert status_for(info.value) == 507
    assert str(info.value).startswith("the dataset needs 144.0 KiB on cpu:numpy's device; 100.0 KiB is free"), info.value
    assert not NUMPY_WORDS.search(str(info.value))
    assert calls == [] and rt.registry.datasets.resident("held") == []
    # unknown free memory (None) skips the check
    entry.live.free_device_bytes = lambda: None
    del entry.live.put_dataset
    assert client.portal.call(rt.registry.datasets.on_device, entry, dataset).rows == 4096


def test_a_full_disk_while_a_chunk_streams_in_is_507_and_leaves_nothing(app_client, monkeypatch, tmp_path):
    import errno

    import mmad.engine.datasets as datasets_module

    client, rt = app_client
    x, y = data(100, seed=int(time.time_ns() % 2**32))

    def full(f):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path))
    monkeypatch.setattr(datasets_module, "_flush_and_sync", full)
    r = client.post("/v2/models/held/datasets", content=st_save({"x": x, "y": y}))
    assert r.status_code == 507 and "the model store is full" in r.json()["error"], r.text
    assert str(tmp_path) not in r.text
    assert client.get("/v2/models/held/datasets").json()["datasets"] == []
    assert list((rt.store.datasets_dir / ".incoming").iterdir()) == []
    monkeypatch.undo()
    assert client.post("/v2/models/held/datasets", content=st_save({"x": x, "y": y})).status_code == 200


# -- a job trains as in-process training on the same batches ----------------------------------------
def test_a_job_with_a_seed_trains_exactly_as_train_epochs_in_process(daemon):
    """The job's batches are the epochs' order of its seed (every row once an epoch): the same
    steps in process on the cpu backend give the same weights and the same final loss."""
    from mmad.backends.contract import EpochPosition
    from mmad.backends.cpu import CpuBackend
    from mmad.spec import MLPSpec

    rng = np.random.default_rng()
    seed = int(rng.integers(0, 2**32))
    x, y = data(700, int(rng.integers(0, 2**31)))
    steps, batch = 23, 64  # 10 batches an epoch: the job crosses two epoch ends
    with Client(daemon.url, timeout=60) as client:
        client.create_model("job_vs_local", SPEC)
        dataset = client.upload_dataset("job_vs_local", x, y, chunk_bytes=8 * 1024, progress=False)
        job = client.start_job("job_vs_local", dataset, steps, batch, checkpoint_every=5, seed=seed)
        final = client.follow_job("job_vs_local", job, progress=False)
        weights = client.get_weights("job_vs_local")
    assert final["state"] == "done" and final["seed"] == seed and final["step"] == steps
    assert final["epoch"] == steps // (700 // batch) and final["rows"] == 700

    model = CpuBackend().compile(MLPSpec.from_json(SPEC))
    held = model.put_dataset([(x, y)], 700, x.dtype, y.dtype)
    position = EpochPosition(seed)
    losses = np.concatenate([model.train_epochs(held, batch, n, position) for n in (5, 5, 5, 5, 3)])
    assert position.epoch == final["epoch"]
    assert final["loss"] == pytest.approx(float(losses[-1]), rel=1e-6)
    for name, value in model.get_params().items():
        np.testing.assert_allclose(weights[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
