"""A hash-grid model through the daemon (cpu backend, real HTTP; then daemons on the wgpu, vulkan
and cuda backends): created, served against the float64 oracle, trained by /train and by a job,
versioned, its weights (grid table included) downloaded and uploaded."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from safetensors.numpy import load as st_load, save as st_save
from test_server_api import oracle

from mmad.spec import MLPSpec

GRID_SPEC = {"n_input_dims": 2, "n_output_dims": 3, "precision": "fp32", "seed": 4,
             "encoding": {"otype": "HashGrid", "n_levels": 6, "n_features_per_level": 2, "log2_hashmap_size": 10,
                          "base_resolution": 8, "per_level_scale": 1.5},
             "network": {"otype": "FullyFusedMLP", "n_neurons": 32, "n_hidden_layers": 2},
             "optimizer": {"otype": "Adam", "learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.99, "epsilon": 1e-15}}


def infer(http: httpx.Client, model: str, x: np.ndarray, version: str | None = None) -> np.ndarray:
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    r = http.post(path, json={"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": list(x.shape),
                                          "data": x.ravel().tolist()}]})
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    return np.array(out["data"], np.float32).reshape(out["shape"])


def picture(x: np.ndarray) -> np.ndarray:
    return np.stack([0.5 + 0.5 * np.sin(12 * x[:, 0]), (x[:, 0] * 6 // 1 + x[:, 1] * 6 // 1) % 2,
                     x[:, 0] * x[:, 1]], 1).astype(np.float32)


def test_hash_grid_model_serves_trains_versions_and_round_trips(http):
    serve_train_version_and_round_trip(http, GRID_SPEC)


# cuda's mma variant computes in fp16 (an fp32 model is refused there: docs/cuda.md)
@pytest.mark.parametrize("backend, package, precision, rtol", [
    ("wgpu", "wgpu", "fp32", 1e-5), ("vulkan", "vulkan", "fp32", 1e-5),
    pytest.param("cuda", "cupy", "fp16", 3e-3, marks=pytest.mark.gpu)])
def test_hash_grid_model_on_a_device_daemon(tmp_path, backend, package, precision, rtol):
    """The same through a daemon on the wgpu, vulkan or cuda backend (grid kernels on the device):
    the table is a parameter like the layers' there too, so versions, weights and jobs work unchanged."""
    pytest.importorskip(package, reason=f"the {backend} backend's Python package is not installed")
    from conftest import DaemonProcess

    try:
        proc = DaemonProcess(tmp_path / "store", env={"MMAD_BACKEND": backend, "MMAD_PROBE": backend}).start()
    except RuntimeError as exc:
        pytest.skip(f"no {backend} daemon here: {str(exc)[:200]}")
    try:
        with httpx.Client(base_url=proc.url, timeout=120.0) as http:
            spec = {**GRID_SPEC, "precision": precision}
            serve_train_version_and_round_trip(http, spec, rtol)
            assert http.put("/v2/models/field", json={"spec": spec}).status_code == 201
            assert backend in http.get("/v2/models/field").json()["backend"]
    finally:
        proc.stop()


def serve_train_version_and_round_trip(http: httpx.Client, spec: dict, rtol: float = 1e-5) -> None:
    """``rtol``: the served outputs and the first loss against the float64 oracle."""
    r = http.put("/v2/models/field", json={"spec": spec})
    assert r.status_code == 201, r.text
    rng = np.random.default_rng(8)
    x = rng.uniform(0, 1, (256, 2)).astype(np.float32)
    y = picture(x)
    ref0 = oracle(http, "field", x)
    assert np.abs(infer(http, "field", x) - ref0).max() <= rtol * max(1e-3, np.abs(ref0).max())

    weights = st_load(http.get("/v2/models/field/weights").content)
    assert weights["grid0"].shape == MLPSpec.from_json(spec).grid_shapes["grid0"]
    assert np.abs(weights["grid0"]).max() <= 1e-4  # tcnn's initialisation

    r = http.post("/v2/models/field/train", json={"inputs": [
        {"name": "INPUT", "datatype": "FP32", "shape": [256, 2], "data": x.ravel().tolist()},
        {"name": "TARGET", "datatype": "FP32", "shape": [256, 3], "data": y.ravel().tolist()}],
        "parameters": {"steps": 40}})
    assert r.status_code == 200, r.text
    losses = np.array(r.json()["losses"])
    assert abs(losses[0] - float(np.mean((ref0 - y) ** 2))) <= rtol * losses[0]
    assert losses[-1] < 0.3 * losses[0]
    trained = st_load(http.get("/v2/models/field/weights").content)
    assert not np.array_equal(trained["grid0"], weights["grid0"])  # the table trained

    assert http.post("/v2/models/field/versions").json()["version"] == "2"
    live = infer(http, "field", x)
    assert np.abs(live - oracle(http, "field", x, version="2")).max() <= rtol * max(1.0, np.abs(live).max())
    # upload version 1's weights: version 3 serves like version 1
    w1 = st_load(http.get("/v2/models/field/weights", params={"version": "1"}).content)
    r = http.put("/v2/models/field/weights", content=st_save(w1))
    assert r.status_code == 200 and r.json()["version"] == "3"
    assert np.array_equal(infer(http, "field", x), infer(http, "field", x, version="1"))
    bad = http.put("/v2/models/field/weights", content=st_save({**w1, "grid0": w1["grid0"][:-8].copy()}))
    assert bad.status_code == 400 and "grid0" in bad.json()["error"]

    # a training job over a held dataset, checkpointed as versions
    r = http.post("/v2/models/field/datasets", content=st_save({"x": x, "y": y}))
    assert r.status_code == 200, r.text
    r = http.post("/v2/models/field/jobs", json={"dataset": r.json()["dataset"], "steps": 30, "batch_size": 64,
                                                 "checkpoint_every": 30})
    assert r.status_code == 202, r.text
    job = r.json()["job"]
    with http.stream("GET", f"/v2/models/field/jobs/{job}/events") as stream:
        last = [line for line in stream.iter_lines() if line.startswith("event: ")][-1]
    assert last == "event: done"
    assert http.get("/v2/models/field/versions").json()["versions"][-1]["step"] == 40 + 30  # after /train's 40
    assert http.delete("/v2/models/field").status_code == 200


def test_grid_spec_errors_are_400_naming_the_field(http):
    bad = {**GRID_SPEC, "encoding": {"otype": "HashGrid", "fixed_point_pos": True}}
    r = http.put("/v2/models/badgrid", json={"spec": bad})
    assert r.status_code == 400 and "encoding.fixed_point_pos" in r.json()["error"]
