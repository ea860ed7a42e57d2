"""``mmad serve --model-repository DIR`` (mmad/engine/repository.py) against real daemon processes
on loopback: the models a repository holds are served with their weights and serving config, a
folder that fails is UNAVAILABLE with its reason and stops no other, and a restart keeps what the
store trained.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import DaemonProcess
from oracle import rel_err
from safetensors.numpy import load as st_load, save_file
from test_server_api import SMALL_SPEC, binary_infer, decode_binary, oracle

from mmad.backends.contract import param_shapes
from mmad.spec import MLPSpec


def weights(spec: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(0, 0.3, shape).astype(np.float32)
            for k, shape in param_shapes(MLPSpec.from_json(spec)).items()}


def folder(root: Path, name: str, spec=None, config=None, params=None) -> Path:
    d = root / name
    d.mkdir(parents=True)
    if spec is not None:
        (d / "config.json").write_text(spec if isinstance(spec, str) else json.dumps(spec))
    if config is not None:
        (d / "mmad.json").write_text(json.dumps(config))
    if params is not None:
        save_file(params, str(d / "model.safetensors"))
    return d


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    good = weights(SMALL_SPEC, 1)
    folder(root, "field", SMALL_SPEC, {"max_queue_delay_us": 1234, "max_queue_requests": 17},
           {k: v.astype(np.float16) for k, v in good.items()})  # fp16 files are taken, as by PUT .../weights
    folder(root, "plain", {**SMALL_SPEC, "n_output_dims": 2})
    folder(root, "broken-json", '{"n_input_dims": 5,')
    folder(root, "wrong-shapes", SMALL_SPEC, params=weights({**SMALL_SPEC, "n_input_dims": 6}, 2))
    folder(root, "bad-config", SMALL_SPEC, {"max_queue_delay_us": -1})
    folder(root, "no-spec", config={})
    folder(root, "bad name")
    folder(root, ".hidden", SMALL_SPEC)
    (root / "README.txt").write_text("files beside the folders are not models")
    return root, {k: v.astype(np.float16).astype(np.float32) for k, v in good.items()}


def index(http: httpx.Client) -> dict[str, dict]:
    return {row["name"]: row for row in http.post("/v2/repository/index").json()}


def test_repository_models_are_served_and_failures_reported(repo, tmp_path):
    root, good = repo
    daemon = DaemonProcess(tmp_path / "store", "--model-repository", str(root)).start()
    try:
        with httpx.Client(base_url=daemon.url, timeout=30.0) as http:
            rows = index(http)
            assert set(rows) == {"field", "plain", "broken-json", "wrong-shapes", "bad-config", "no-spec",
                                 "bad name"}  # no demo model, nothing hidden, no file
            assert rows["field"]["state"] == "READY" and rows["field"]["reason"] == ""
            assert rows["plain"]["state"] == "READY"
            reasons = {name: rows[name]["reason"] for name in rows if rows[name]["state"] == "UNAVAILABLE"}
            assert set(reasons) == {"broken-json", "wrong-shapes", "bad-config", "no-spec", "bad name"}
            assert "config.json is not JSON" in reasons["broken-json"]
            assert "model.safetensors" in reasons["wrong-shapes"] and "W0" in reasons["wrong-shapes"]
            assert "mmad.json" in reasons["bad-config"] and "max_queue_delay_us" in reasons["bad-config"]
            assert "no config.json" in reasons["no-spec"]
            assert "invalid model name" in reasons["bad name"]
            for name in reasons:  # a failed folder leaves nothing in the store
                assert name == "bad name" or http.get(f"/v2/models/{name}").status_code == 404

            # the folder's weights are version 2 (version 1 holds the seed's, as after PUT + PUT weights)
            versions = [v["version"] for v in http.get("/v2/models/field/versions").json()["versions"]]
            assert versions == ["1", "2"]
            stored = st_load(http.get("/v2/models/field/weights", params={"version": "2"}).content)
            assert all(np.array_equal(stored[k], good[k]) for k in good)
            meta = http.get("/v2/models/field").json()
            assert meta["config"]["max_queue_delay_us"] == 1234 and meta["config"]["max_queue_requests"] == 17
            x = np.random.default_rng(3).uniform(-1, 1, (8, 5)).astype(np.float32)
            _, out = decode_binary(binary_infer(http, "field", x))
            assert rel_err(out, oracle(http, "field", x)) < 1e-5
            assert [v["version"] for v in http.get("/v2/models/plain/versions").json()["versions"]] == ["1"]
            assert decode_binary(binary_infer(http, "plain", x))[1].shape == (8, 2)

            # training after the start: a checkpoint the next start must keep
            y = np.zeros((8, 4), np.float32)
            body = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [8, 5], "data": x.ravel().tolist()},
                               {"name": "TARGET", "datatype": "FP32", "shape": [8, 4], "data": y.ravel().tolist()}],
                    "parameters": {"steps": 5}}
            assert http.post("/v2/models/field/train", json=body).status_code == 200
            assert http.post("/v2/models/field/versions").json()["version"] == "3"
            trained = http.get("/v2/models/field/weights", params={"version": "3"}).content
        daemon.stop()

        # restart: the store's versions are served (trained ones too); a folder fixed since loads now
        shutil.rmtree(root / "wrong-shapes")
        folder(root, "wrong-shapes", SMALL_SPEC, params=weights(SMALL_SPEC, 2))
        daemon = DaemonProcess(tmp_path / "store", "--model-repository", str(root)).start()
        with httpx.Client(base_url=daemon.url, timeout=30.0) as http:
            rows = index(http)
            assert rows["field"]["state"] == "READY" and rows["field"]["reason"] == ""
            assert rows["field"]["version"] == "3"
            assert http.get("/v2/models/field/weights").content == trained  # live weights: version 3's
            assert rows["wrong-shapes"]["state"] == "READY"
        daemon.stop()

        # a folder that now differs from the stored model: the store's is served, the reason says so
        (root / "field" / "config.json").write_text(json.dumps({**SMALL_SPEC, "network": {"n_neurons": 16}}))
        (root / "plain" / "config.json").write_text("{")
        daemon = DaemonProcess(tmp_path / "store", "--model-repository", str(root)).start()
        with httpx.Client(base_url=daemon.url, timeout=30.0) as http:
            rows = index(http)
            assert rows["field"]["state"] == "READY" and rows["field"]["version"] == "3"
            assert "another spec (config.json)" in rows["field"]["reason"]
            assert "stored model is served" in rows["field"]["reason"]
            assert http.get("/v2/models/field").json()["spec"]["network"]["n_neurons"] == 32
            assert rows["plain"]["state"] == "READY" and "config.json is not JSON" in rows["plain"]["reason"]
    finally:
        daemon.stop()


def test_missing_repository_stops_the_start(tmp_path):
    daemon = DaemonProcess(tmp_path / "store", "--model-repository", str(tmp_path / "nowhere"))
    with pytest.raises(RuntimeError, match="is not a folder"):
        daemon.start()
    assert daemon.proc.returncode == 2
