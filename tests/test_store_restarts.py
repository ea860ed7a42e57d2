"""The store and restarts (docs/reliability.md, "Shared memory, the store and restarts"):
start-up linear in stored versions, retention, a refused DELETE that changes nothing, damaged
descriptions and versions answered 409 (never 500, never served), pinned infers racing
unload/load, and the bound on datasets held in host memory. In-process (``TestClient`` runs the
real lifespan) on the cpu backend."""

from __future__ import annotations

import errno
import pathlib
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save as st_save

import mmad.engine.store as store_module
from mmad.errors import DeviceMemoryFull
from test_fault_injection import load_script
from test_store_faults import SPEC, app_client, infer, live_weights, outputs, same, train, version_weights


attack = load_script("attack_shm_store")  # its store writer: thousands of versions in seconds


def stored_model(root: Path, versions: int, name: str = "m") -> None:
    attack.write_versions(root, versions, name, SPEC)


# -- item 5: start-up linear in versions; retention ---------------------------------------------
def test_start_up_reads_the_listing_once_and_only_the_served_versions_weights(tmp_path, monkeypatch):
    """A model of 300 versions: start-up reads its versions.json once (not once per version, the
    quadratic start-up: 4,000 versions took 44 s) and the weights of the one it serves; the
    others are only seen to be there (their sha256 is checked when one is read)."""
    store = tmp_path / "store"
    stored_model(store, 300)
    reads: dict[str, int] = {}
    real = pathlib.Path.read_bytes

    def counting(self):
        reads[self.name if self.name == "versions.json" else self.parent.name] = \
            reads.get(self.name if self.name == "versions.json" else self.parent.name, 0) + 1
        return real(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", counting)
    with app_client(store, keep_versions=0) as c:
        assert c.get("/v2/models/m").json()["latest_version"] == "300"
        startup = dict(reads)
        assert startup.get("versions.json", 0) == 1, startup
        assert startup.get("weights", 0) == 1, startup  # the served version's, sha256-checked
        x = np.random.default_rng().uniform(-1, 1, (4, 5)).astype(np.float32)
        assert infer(c, "m", x).status_code == 200
        # a new version writes the listing without reading it again
        assert c.post("/v2/models/m/versions").status_code == 200
        assert reads.get("versions.json", 0) == 1, reads
        assert [v["version"] for v in c.get("/v2/models/m/versions").json()["versions"]][-1] == "301"


def test_a_damaged_old_version_is_never_served_and_answers_409(tmp_path):
    store = tmp_path / "store"
    stored_model(store, 5)
    path = store / "models" / "m" / "weights" / "2.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # a weight's last byte: still a safetensors file, its sha256 no longer matches
    path.write_bytes(bytes(data))
    (store / "models" / "m" / "weights" / "3.safetensors").unlink()  # missing: seen at start-up
    x = np.random.default_rng().uniform(-1, 1, (4, 5)).astype(np.float32)
    with app_client(store, keep_versions=0) as c:
        meta = c.get("/v2/models/m").json()
        assert meta["state"] == "READY" and "version 3" in meta["reason"], meta
        for version in ("2", "3"):
            r = infer(c, "m", x, version=version)
            assert r.status_code == 409 and f"version {version}" in r.json()["error"], r.text
            r = c.get("/v2/models/m/weights", params={"version": version})
            assert r.status_code == 409 and f"version {version}" in r.json()["error"], r.text
        assert "sha256" in c.get("/v2/models/m").json()["reason"]  # found when read: said from now on
        assert infer(c, "m", x, version="4").status_code == 200
        np.testing.assert_array_equal(outputs(infer(c, "m", x, version="1")), outputs(infer(c, "m", x)))


def test_retention_the_daemons_default_and_a_models_own(tmp_path):
    with app_client(tmp_path / "store", keep_versions=3) as c:
        assert c.put("/v2/models/daemon-rule", json={"spec": SPEC}).status_code == 201
        assert c.put("/v2/models/own-rule", json={"spec": SPEC, "config": {"keep_versions": 0}}).status_code == 201
        for _ in range(4):
            for name in ("daemon-rule", "own-rule"):
                assert c.post(f"/v2/models/{name}/versions").status_code == 200
        kept = {name: [v["version"] for v in c.get(f"/v2/models/{name}/versions").json()["versions"]]
                for name in ("daemon-rule", "own-rule")}
        assert kept == {"daemon-rule": ["3", "4", "5"], "own-rule": ["1", "2", "3", "4", "5"]}
        assert c.get("/v2/models/daemon-rule/weights", params={"version": "1"}).status_code == 404
    files = sorted(p.name for p in (tmp_path / "store" / "models" / "daemon-rule" / "weights").iterdir())
    assert files == ["3.safetensors", "4.safetensors", "5.safetensors"]


# -- item 6: a refused DELETE changes nothing served ---------------------------------------------
def test_a_delete_refused_by_a_read_only_store_changes_nothing_served(tmp_path, monkeypatch):
    """Before: the model was unloaded (its unsaved training steps lost) and then the store
    refused, with a 507 saying nothing changed."""
    rng = np.random.default_rng()
    x = rng.uniform(-1, 1, (16, 5)).astype(np.float32)
    with app_client(tmp_path / "store") as c:
        assert c.put("/v2/models/m", json={"spec": SPEC}).status_code == 201
        assert train(c, "m", x, rng.uniform(-1, 1, (16, 4)).astype(np.float32), 3).status_code == 200
        trained, served = live_weights(c, "m"), outputs(infer(c, "m", x))
        assert not same(trained, version_weights(c, "m", "1"))  # steps no version holds

        def read_only(src, dst):
            raise OSError(errno.EROFS, "Read-only file system", str(src))

        monkeypatch.setattr(store_module.os, "replace", read_only)
        r = c.delete("/v2/models/m")
        monkeypatch.undo()
        assert r.status_code == 507 and "nothing served changed" in r.json()["error"], r.text
        assert c.get("/v2/models/m").json()["state"] == "READY"
        assert same(live_weights(c, "m"), trained)
        np.testing.assert_array_equal(outputs(infer(c, "m", x)), served)
        assert c.delete("/v2/models/m").status_code == 200  # writable again: deleted
        assert c.get("/v2/models/m").status_code == 404


# -- item 7: damaged descriptions and racing unloads are 4xx/503, never 500 -----------------------
@pytest.mark.parametrize("damage", ["not JSON", "a directory", "no spec"])
def test_loading_a_model_whose_description_is_damaged_is_409(tmp_path, damage):
    store = tmp_path / "store"
    stored_model(store, 1)
    doc = store / "models" / "m" / "model.json"
    if damage == "a directory":
        doc.unlink()
        doc.mkdir()
    else:
        doc.write_text("{" if damage == "not JSON" else '{"config": {}}')
    with app_client(store) as c:
        index = {row["name"]: row for row in c.post("/v2/repository/index", content=b"").json()}
        assert index["m"]["state"] == "UNAVAILABLE" and "model.json" in index["m"]["reason"], index
        r = c.post("/v2/repository/models/m/load", json={})
        assert r.status_code == 409 and "model.json" in r.json()["error"], r.text
        assert str(tmp_path) not in r.text


def test_a_pinned_infer_whose_model_is_unloaded_under_it_is_never_500(tmp_path):
    """The pinned copy is compiled while an unload closes the live model (the race that gave
    17 x 500 in 30 s): the answer is the pinned version's output or 503, never a 500."""
    x = np.random.default_rng().uniform(-1, 1, (4, 5)).astype(np.float32)
    with app_client(tmp_path / "store") as c:
        assert c.put("/v2/models/m", json={"spec": SPEC}).status_code == 201
        assert c.post("/v2/models/m/versions").status_code == 200
        expected = outputs(infer(c, "m", x, version="1"))
        registry = c.app.state.runtime.registry
        entry = registry.get("m")
        entry.pinned.clear()  # the next pinned infer compiles its copy
        real = registry.store.load_version

        def unloaded_meanwhile(*args, **kwargs):
            loaded = real(*args, **kwargs)
            with entry.lock:  # what the unload's close does, between the lookup and the compile
                entry.live.close()
                entry.replicas[0].model = None
            return loaded

        registry.store.load_version = unloaded_meanwhile
        r = infer(c, "m", x, version="1")
        registry.store.load_version = real
        assert r.status_code in (200, 503), r.text
        if r.status_code == 200:
            np.testing.assert_array_equal(outputs(r), expected)
        assert infer(c, "m", x, version="1").status_code == 503  # not loaded now: the live copy is gone
        assert c.post("/v2/repository/models/m/unload", json={}).status_code == 200
        assert c.post("/v2/repository/models/m/load", json={}).status_code == 200
        np.testing.assert_array_equal(outputs(infer(c, "m", x, version="1")), expected)


def test_pinned_infers_racing_unload_and_load_answer_200_or_503(tmp_path):
    x = np.random.default_rng().uniform(-1, 1, (4, 5)).astype(np.float32)
    with app_client(tmp_path / "store") as c:
        assert c.put("/v2/models/m", json={"spec": SPEC}).status_code == 201
        for _ in range(3):
            assert c.post("/v2/models/m/versions").status_code == 200
        codes, stop = [], threading.Event()

        def pinned() -> None:
            k = 0
            while not stop.is_set():
                k += 1
                codes.append(infer(c, "m", x, version=str(1 + k % 4)).status_code)

        threads = [threading.Thread(target=pinned) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            for _ in range(15):  # rounds, not seconds
                assert c.post("/v2/repository/models/m/unload", json={}).status_code == 200
                assert c.post("/v2/repository/models/m/load", json={}).status_code == 200
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert codes and set(codes) <= {200, 503}, sorted(set(codes))


# -- item 8: datasets held in host memory are bounded ---------------------------------------------
def test_datasets_held_in_host_memory_are_bounded_least_recently_used_first(tmp_path):
    rows = 2000
    size = rows * (5 + 4) * 4  # float32 x [rows, 5], y [rows, 4]
    rng = np.random.default_rng()
    with app_client(tmp_path / "store", max_host_dataset_bytes=3 * size + 100) as c:
        assert c.put("/v2/models/m", json={"spec": SPEC}).status_code == 201
        rt = c.app.state.runtime
        entry, cache = rt.registry.get("m"), rt.registry.datasets
        ids = []
        for _ in range(5):
            x, y = rng.uniform(-1, 1, (rows, 5)).astype(np.float32), rng.uniform(-1, 1, (rows, 4)).astype(np.float32)
            ids.append(c.post("/v2/models/m/datasets", content=st_save({"x": x, "y": y})).json()["dataset"])
        for i, dataset in enumerate(ids):
            c.portal.call(cache.on_device, entry, dataset)
            if i == 2:
                c.portal.call(cache.on_device, entry, ids[0])  # used again: the most recent
            assert cache.host_bytes() <= 3 * size + 100
        assert sorted(cache.resident("m")) == sorted([ids[0], ids[3], ids[4]])
        big_x, big_y = rng.uniform(-1, 1, (4 * rows, 5)).astype(np.float32), np.zeros((4 * rows, 4), np.float32)
        big = c.post("/v2/models/m/datasets", content=st_save({"x": big_x, "y": big_y})).json()["dataset"]
        with pytest.raises(DeviceMemoryFull, match="--max-host-dataset-bytes"):
            c.portal.call(cache.on_device, entry, big)
        assert sorted(cache.resident("m")) == sorted([ids[0], ids[3], ids[4]])  # nothing dropped for it
        r = c.post("/v2/models/m/jobs", json={"dataset": big, "steps": 2, "batch_size": 32})
        if r.status_code == 202:  # refused when the job starts: it fails with the reason
            job = r.json()["job"]
            deadline = time.monotonic() + 60
            while (status := c.get(f"/v2/models/m/jobs/{job}").json())["state"] not in ("done", "failed"):
                assert time.monotonic() < deadline, status
                time.sleep(0.05)
            assert status["state"] == "failed" and "--max-host-dataset-bytes" in status["error"], status
        else:
            assert r.status_code == 507 and "--max-host-dataset-bytes" in r.json()["error"], r.text
