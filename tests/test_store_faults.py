"""Store and training faults: a damaged model never stops start-up,
diverged training is never published, a refused store write changes nothing served, a full or
read-only store is a 507 without paths. In-process (``TestClient`` runs the real lifespan)."""

from __future__ import annotations

import errno
import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from safetensors.numpy import load as st_load, save as st_save

import mmad.engine.store as store_module
from mmad.server.app import create_app
from mmad.settings import Settings

SPEC = {"n_input_dims": 5, "n_output_dims": 4, "network": {"n_neurons": 32, "n_hidden_layers": 2},
        "precision": "fp32", "seed": 7}
# the largest learning rate a spec allows, plain SGD: huge targets blow the weights up at once
DIVERGING_SPEC = {**SPEC, "optimizer": {"otype": "SGD", "learning_rate": 10.0}}


def app_client(store: Path, **settings) -> TestClient:
    app = create_app(Settings(store_dir=store, backend="cpu", probe="cpu", demo=False, forward_threads=1,
                              **settings))
    return TestClient(app, raise_server_exceptions=False)


def json_tensor(name: str, a: np.ndarray) -> dict:
    return {"name": name, "datatype": "FP32", "shape": list(a.shape), "data": a.ravel().tolist()}


def infer(c: TestClient, model: str, x: np.ndarray, version: str | None = None):
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    return c.post(path, json={"inputs": [json_tensor("INPUT", x)]})


def outputs(r) -> np.ndarray:
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    return np.array(out["data"], np.float32).reshape(out["shape"])


def train(c: TestClient, model: str, x: np.ndarray, y: np.ndarray, steps: int):
    return c.post(f"/v2/models/{model}/train", json={
        "inputs": [json_tensor("INPUT", x), json_tensor("TARGET", y)], "parameters": {"steps": steps}})


def live_weights(c: TestClient, model: str) -> dict[str, np.ndarray]:
    r = c.get(f"/v2/models/{model}/weights")
    assert r.status_code == 200, r.text
    return st_load(r.content)


def version_weights(c: TestClient, model: str, version: str) -> dict[str, np.ndarray]:
    r = c.get(f"/v2/models/{model}/weights", params={"version": version})
    assert r.status_code == 200, r.text
    return st_load(r.content)


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def finite(params: dict[str, np.ndarray]) -> bool:
    return all(np.isfinite(v).all() for v in params.values())


# -- item 2: one damaged model never stops the daemon -------------------------------------------
def _flip_first_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[0] ^= 0xFF
    p.write_bytes(bytes(data))


def _drop_sha256(version: str):
    def mutate(m: Path) -> None:
        doc = json.loads((m / "versions.json").read_bytes())
        for v in doc["versions"]:
            if v["version"] == version:
                del v["sha256"]
        (m / "versions.json").write_text(json.dumps(doc))
    return mutate


def _dir_to_file(m: Path) -> None:
    for p in (m / "weights").iterdir():
        p.unlink()
    (m / "weights").rmdir()
    (m / "weights").write_bytes(b"a file where the weights directory should be")


# (mutation of the bad model's directory, the version it must serve or None (UNAVAILABLE),
#  a word its reason must hold); the bad model has versions 1, 2, 3 before the damage
CORRUPTIONS = {
    "missing newest weights": (lambda m: (m / "weights" / "3.safetensors").unlink(), "2", "version 3"),
    "missing old weights": (lambda m: (m / "weights" / "1.safetensors").unlink(), "3", "version 1"),
    "missing newest optimizer": (lambda m: (m / "optimizer" / "3.safetensors").unlink(), "2", "optimizer"),
    "flipped byte in newest weights": (lambda m: _flip_first_byte(m / "weights" / "3.safetensors"), "2", "sha256"),
    "newest entry without sha256": (_drop_sha256("3"), "2", "sha256"),
    "empty versions.json": (lambda m: (m / "versions.json").write_bytes(b""), None, "listing"),
    "byte-flipped versions.json": (lambda m: _flip_first_byte(m / "versions.json"), None, "listing"),
    "no versions": (lambda m: (m / "versions.json").write_text('{"versions": []}'), None, "no version"),
    "weights directory is a file": (_dir_to_file, None, "no intact version"),
    "model.json unreadable": (lambda m: (m / "model.json").write_bytes(b"{"), None, "model.json"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_a_damaged_model_is_unavailable_with_its_reason_and_the_others_serve(tmp_path, case, caplog):
    store = tmp_path / "store"
    rng = np.random.default_rng()
    x = rng.uniform(-1, 1, (8, 5)).astype(np.float32)
    with app_client(store) as c:
        for name in ("good", "bad"):
            assert c.put(f"/v2/models/{name}", json={"spec": SPEC}).status_code == 201
        for _ in range(2):
            assert c.put("/v2/models/bad/weights", content=st_save(
                {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in live_weights(c, "bad").items()}
            )).status_code == 200
        good_out = outputs(infer(c, "good", x))
        kept = {v: version_weights(c, "bad", v) for v in ("1", "2", "3")}
    mutate, serves, word = CORRUPTIONS[case]
    mutate(store / "models" / "bad")
    caplog.set_level(logging.WARNING, logger="mmad.engine.registry")
    with app_client(store) as c:  # the daemon starts
        assert c.get("/v2/health/ready").status_code == 200
        np.testing.assert_array_equal(outputs(infer(c, "good", x)), good_out)
        rows = {row["name"]: row for row in c.post("/v2/repository/index", content=b"").json()}
        assert rows["good"]["state"] == "READY" and rows["good"]["reason"] == ""
        row = rows["bad"]
        assert word in row["reason"], row
        assert str(tmp_path) not in row["reason"]
        assert word in caplog.text
        if serves is None:
            assert row["state"] == "UNAVAILABLE"
            # no spec, no model entry: unknown to inference (404); else known but not loaded (503)
            assert infer(c, "bad", x).status_code == (404 if case == "model.json unreadable" else 503)
            meta = c.get("/v2/models/bad")
            if case != "model.json unreadable":  # without its spec the model has no metadata
                assert meta.status_code == 200 and word in meta.json()["reason"]
                assert meta.json()["state"] == "UNAVAILABLE"
        else:  # a damaged version never hides an intact one: the newest intact version serves
            assert row["state"] == "READY"
            assert word in c.get("/v2/models/bad").json()["reason"]
            assert same(live_weights(c, "bad"), kept[serves])
            assert infer(c, "bad", x).status_code == 200


# -- item 6: diverged training is never published -----------------------------------------------
def huge_batch(rows: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng()
    x = rng.uniform(-1, 1, (rows, 5)).astype(np.float32)
    return x, (rng.standard_normal((rows, 4)) * 1e18).astype(np.float32)  # finite, but huge


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow is the point
def test_diverging_train_request_is_refused_and_keeps_the_last_good_weights(tmp_path):
    with app_client(store_dir := tmp_path / "store") as c:
        assert c.put("/v2/models/m", json={"spec": DIVERGING_SPEC}).status_code == 201
        v1 = version_weights(c, "m", "1")
        x, y = huge_batch()
        r = train(c, "m", x, y, 5)
        assert r.status_code == 409 and "diverged" in r.json()["error"], r.text
        live = live_weights(c, "m")
        assert finite(live) and same(live, v1)
        assert np.isfinite(outputs(infer(c, "m", x))).all()
        # a sane batch still trains afterwards, from the kept weights
        r = train(c, "m", x, np.zeros((x.shape[0], 4), np.float32), 1)
        assert r.status_code == 200 and r.json()["step"] == 1, r.text
    assert store_dir.exists()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow is the point
def test_diverging_job_fails_with_the_reason_and_leaves_the_last_finite_version_live(tmp_path):
    with app_client(tmp_path / "store") as c:
        assert c.put("/v2/models/m", json={"spec": DIVERGING_SPEC}).status_code == 201
        x, y = huge_batch(256)
        dataset = c.post("/v2/models/m/datasets", content=st_save({"x": x, "y": y})).json()["dataset"]
        r = c.post("/v2/models/m/jobs", json={"dataset": dataset, "steps": 50, "batch_size": 32,
                                               "checkpoint_every": 1})
        assert r.status_code == 202, r.text
        job = r.json()["job"]
        deadline = time.monotonic() + 60
        while (status := c.get(f"/v2/models/m/jobs/{job}").json())["state"] not in ("done", "failed", "cancelled"):
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert status["state"] == "failed" and "diverged" in status["error"], status
        # the curve ends at the step that diverged, its loss null (NaN or Inf, not JSON numbers)
        points = c.get(f"/v2/models/m/jobs/{job}/losses").json()["points"]
        diverged_at = int(status["error"].split("diverged at step ")[1].split()[0])
        assert points[-1] == [diverged_at, None], points
        assert all(p[1] is not None for p in points[:-1]) and diverged_at == status["step"] + 1
        versions = [v["version"] for v in c.get("/v2/models/m/versions").json()["versions"]]
        assert all(finite(version_weights(c, "m", v)) for v in versions)
        live = live_weights(c, "m")
        assert finite(live) and same(live, version_weights(c, "m", versions[-1]))
        assert c.get("/v2/models/m").json()["state"] == "READY"


def test_checkpoint_of_nonfinite_weights_is_refused(tmp_path):
    with app_client(tmp_path / "store") as c:
        assert c.put("/v2/models/m", json={"spec": SPEC}).status_code == 201
        entry = c.app.state.runtime.registry.get("m")
        good = entry.live.get_params
        # a backend whose weights went bad by a route no check saw: the checkpoint is the last guard
        entry.live.get_params = lambda: {k: np.full_like(v, np.nan) for k, v in good().items()}
        r = c.post("/v2/models/m/versions")
        assert r.status_code == 409 and "NaN" in r.json()["error"], r.text
        assert [v["version"] for v in c.get("/v2/models/m/versions").json()["versions"]] == ["1"]


# -- items 7, 8: a refused store write changes nothing served; 507 without paths ----------------
@pytest.mark.parametrize("code,status", [(errno.ENOSPC, 507), (errno.EDQUOT, 507), (errno.EROFS, 507),
                                         (errno.EACCES, 507)])
def test_full_or_readonly_store_is_507_and_nothing_served_changes(tmp_path, monkeypatch, code, status):
    store = tmp_path / "store"
    rng = np.random.default_rng()
    x = rng.uniform(-1, 1, (8, 5)).astype(np.float32)
    with app_client(store) as c:
        assert c.put("/v2/models/m", json={"spec": SPEC}).status_code == 201
        before = live_weights(c, "m")
        served = outputs(infer(c, "m", x))
        upload = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in before.items()}

        def refuse(path, data):
            raise OSError(code, "simulated", str(path))

        monkeypatch.setattr(store_module, "atomic_write", refuse)
        for method, path, body in (("PUT", "/v2/models/m/weights", st_save(upload)),
                                   ("POST", "/v2/models/m/versions", b""),
                                   ("PUT", "/v2/models/m", json.dumps({"spec": SPEC}).encode()),
                                   ("PUT", "/v2/models/other", json.dumps({"spec": SPEC}).encode())):
            r = c.request(method, path, content=body)
            assert r.status_code == status, (path, r.text)
            assert "store" in r.json()["error"] and str(tmp_path) not in r.text and "/models/" not in r.text
        # nothing served changed: the live weights, the outputs, the versions, the model list
        assert same(live_weights(c, "m"), before)
        np.testing.assert_array_equal(outputs(infer(c, "m", x)), served)
        assert [v["version"] for v in c.get("/v2/models/m/versions").json()["versions"]] == ["1"]
        assert c.get("/v2/models/other").status_code == 404
        monkeypatch.undo()
        assert c.put("/v2/models/m/weights", content=st_save(upload)).status_code == 200
        assert same(live_weights(c, "m"), upload)
    with app_client(store) as c:  # and the restart serves what the store acknowledged
        assert same(live_weights(c, "m"), upload)


def test_other_store_oserrors_name_no_path(tmp_path, monkeypatch):
    with app_client(tmp_path / "store") as c:
        assert c.put("/v2/models/m", json={"spec": SPEC}).status_code == 201

        def broken(path, data):
            raise OSError(errno.EIO, "Input/output error", str(path))

        monkeypatch.setattr(store_module, "atomic_write", broken)
        r = c.post("/v2/models/m/versions")
        assert r.status_code == 500 and "Input/output error" in r.json()["error"]
        assert str(tmp_path) not in r.text


def _read_response(sock) -> tuple[int, dict[str, str], bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", "0")):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def test_a_full_store_keeps_the_keepalive_connection(tmp_path, monkeypatch):
    """The 507 is an answer, not a crash: the same connection serves the next request."""
    import socket
    import threading

    import uvicorn

    app = create_app(Settings(store_dir=tmp_path / "store", backend="cpu", probe="cpu", demo=False,
                              forward_threads=1))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, http="h11", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            body = json.dumps({"spec": SPEC}).encode()
            sock.sendall(b"PUT /v2/models/m HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            assert _read_response(sock)[0] == 201

            def full(path, data):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))

            monkeypatch.setattr(store_module, "atomic_write", full)
            sock.sendall(b"POST /v2/models/m/versions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            status, headers, text = _read_response(sock)
            assert status == 507 and headers.get("connection", "").lower() != "close", (status, headers)
            assert str(tmp_path).encode() not in text
            sock.sendall(b"GET /v2/models/m/ready HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_response(sock)[0] == 200  # the same connection
    finally:
        server.should_exit = True
        thread.join(30)
